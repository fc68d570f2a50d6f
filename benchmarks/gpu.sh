#!/usr/bin/env bash
# The GPU in one prepared shot: on a freshly lent GPU machine, install what its image lacks and run
# `python -m benchmarks --gpu` (benchmarks/gpu.py), which writes benchmarks/records/gpu-<device>.json.
#
#   bash benchmarks/gpu.sh --fetch-wheels   # HERE, where PyPI is reachable: the wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu.sh                  # THERE (the repository's copy, .whl/ carried): install, run, record
#   bash benchmarks/gpu.sh --tiny --out F   # the same path at a CPU size (tests/test_gpu_script.py runs it)
#
# The GPU machine reaches no package registry. Its image has Python 3.12 with jax (CUDA), flax, optax,
# orbax-checkpoint, torch, numpy, tqdm, pyyaml, matplotlib, psutil, filelock, tokenizers and scikit-learn; jaxloop
# also needs grain, tyro and tensorboardX, which travel as wheels in .whl/ (git-ignored) with the dependencies
# the image lacks. They are installed with --no-index into their own folder (nothing of the image is replaced),
# and jaxloop and torch_ref are imported from the repository itself (PYTHONPATH), not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tyro==1.0.17 docstring-parser==0.18.0
        typeguard==4.6.1 tensorboardX==2.6.5)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
    ls .whl
    exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then
    SITE="${TMPDIR:-/tmp}/jaxloop-gpu-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" -m benchmarks --gpu "$@"
