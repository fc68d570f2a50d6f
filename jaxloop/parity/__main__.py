"""python -m jaxloop.parity PATH.py:FACTORY — check a PyTorch model against its Flax translation.

FACTORY is a function in PATH.py taking no arguments and returning a jaxloop.parity.Port (the torch
module, the Flax module, an example batch, the two losses, optionally the trajectory's batches). The
command prints the weight mapping, then one row per check (measured difference, tolerance, why),
the first diverging layer with its diagnoses, and a summary line.

Exit status: 0 when every check is within tolerance, 1 when one is not, 2 on bad input (a missing
file or factory, torch not installed, weights that do not map, a batch a model rejects, a Port the check
cannot run on, a factory that raised or ended the process), 130 when interrupted, with one clear message.
The command runs the check in a child process and requires its verdict: a process that ends without one
(a factory calling os._exit(0)) is an error, never a silent 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxloop.config.run import Config

BAD_INPUT = 2
INTERRUPTED = 130
VERDICT_FILE = "JAXLOOP_PARITY_VERDICT"
"""The environment variable naming the file the child process writes its exit status to (cli())."""


class BadInput(Exception):
    """A message for stderr and exit status 2."""


def load_factory(spec: str) -> Any:
    """The function FACTORY of PATH.py in "PATH.py:FACTORY"."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise BadInput(f"expected PATH.py:FACTORY, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"no such file: {path}")
    module_name = f"_jaxloop_port_{abs(hash(str(file.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, file)
    if loader is None or loader.loader is None:
        raise BadInput(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except SystemExit as e:  # a script's sys.exit at import: not a silent status
        raise BadInput(
            f"importing {path} called sys.exit({e.code!r}); a factory file defines FACTORY and exits nowhere"
        ) from e
    except Exception as e:  # the user's file failed to import
        raise BadInput(f"importing {path} failed: {type(e).__name__}: {e}") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(
            k
            for k, v in vars(module).items()
            if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module_name
        )
        raise BadInput(f"{path} has no function {name!r}; functions it defines: {found}")
    return factory


EXPECTED = "a jaxloop.parity.Port(torch_module, flax_module, batch, torch_loss, flax_loss)"


def port_of(value: Any, spec: str) -> Any:
    """The factory's Port, its two modules each of the framework its field names (a dict of Port's fields
    is taken too); anything else is bad input naming what was expected."""
    from jaxloop.parity.port import Port

    if isinstance(value, dict):
        try:
            value = Port(**value)
        except TypeError as e:
            raise BadInput(f"{spec} returned a dict that is not a Port's fields ({e}); expected {EXPECTED}") from e
    if not isinstance(value, Port):
        raise BadInput(f"{spec} returned a {type(value).__name__}; expected {EXPECTED}")
    t, f = _framework(value.torch_module), _framework(value.flax_module)
    if (t, f) == ("Flax", "torch"):
        raise BadInput(
            f"{spec} returned a Port with torch and Flax swapped (torch_module is a Flax "
            f"{type(value.torch_module).__name__}, flax_module a torch {type(value.flax_module).__name__}); "
            f"expected {EXPECTED}"
        )
    if t != "torch":
        raise BadInput(
            f"{spec} returned a Port whose torch_module is a {type(value.torch_module).__name__}, not a "
            f"torch.nn.Module; expected {EXPECTED}"
        )
    if f != "Flax":
        raise BadInput(
            f"{spec} returned a Port whose flax_module is a {type(value.flax_module).__name__}, not a Flax "
            f"Linen or NNX module; expected {EXPECTED}"
        )
    return value


def _framework(module: Any) -> str:
    import flax.linen as nn
    from flax import nnx

    from jaxloop.parity.torchside import require_torch

    if isinstance(module, require_torch().nn.Module):
        return "torch"
    if isinstance(module, (nn.Module, nnx.Module)):
        return "Flax"
    return "neither"


DEFAULT_COMPILE_CACHE = Config.compile_cache
"""python -m jaxloop.train's default --compile_cache: the check's programs are kept where a run's are."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxloop.parity", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("factory", metavar="PATH.py:FACTORY", help="a function returning a jaxloop.parity.Port")
    parser.add_argument(
        "--precision",
        nargs="+",
        default=["fp64", "fp32"],
        choices=["fp64", "fp32"],
        help="precisions to check in (default: fp64 fp32)",
    )
    parser.add_argument(
        "--updates", type=int, default=100, help="updates of the trajectory check (0 = none; default 100)"
    )
    parser.add_argument("--no-trajectory", action="store_true", help="skip the trajectory (same as --updates 0)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    parser.add_argument("--plots", metavar="DIR", help="also write the layer and trajectory plots (PNG)")
    parser.add_argument("--no-mapping", action="store_true", help="leave the weight mapping table out")
    parser.add_argument(
        "--compile_cache",
        metavar="DIR",
        default=DEFAULT_COMPILE_CACHE,
        help="JAX's persistent compilation cache, shared with python -m jaxloop.train: a second check of the same "
        f"port loads its compiled programs ('' = off; default {DEFAULT_COMPILE_CACHE})",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()

    def progress(message: str) -> None:  # on stderr, so that stdout stays the report
        print(f"{message} (at {time.monotonic() - start:.1f}s)", file=sys.stderr, flush=True)

    try:
        check_outputs(args.updates, args.markdown, args.compile_cache)
        from jaxloop.parity.torchside import require_torch

        require_torch()
        factory = load_factory(args.factory)
        try:
            made = factory()
        except SystemExit as e:  # not the check's status: the factory never returned
            raise BadInput(f"{args.factory} called sys.exit({e.code!r}) instead of returning {EXPECTED}") from e
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's factory failed, with any exception
            raise BadInput(f"{args.factory} raised {type(e).__name__}: {first_line(e)}") from e
        port = port_of(made, args.factory)
        progress(f"{args.factory}: torch and the Port loaded")  # an error before this is one line alone
        from jaxloop.parity.compare import check
        from jaxloop.parity.errors import ModelError
        from jaxloop.parity.weights import MappingError

        try:
            with contextlib.ExitStack() as scope:
                if args.compile_cache:
                    from jaxloop.runtime.compilation import compilation_cache

                    scope.enter_context(compilation_cache(args.compile_cache))
                report = check(
                    port,
                    precisions=args.precision,
                    trajectory=0 if args.no_trajectory else args.updates,
                    progress=progress,
                )
        except (MappingError, ModelError) as e:
            raise BadInput(str(e)) from e
        except Exception as e:  # noqa: BLE001 - a Port the check cannot run on (no batch, a loss that is a vector)
            raise BadInput(
                f"the check could not run on the Port {args.factory} returned: {type(e).__name__}: {first_line(e)}"
            ) from e
        progress("checked")
        print(report.text(mapping=not args.no_mapping))
        if args.markdown:
            print(f"markdown: {report.write_markdown(args.markdown)}")
        if args.plots:
            for path in report.plot(args.plots):
                print(f"plot: {path}")
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    except (ImportError, OSError) as e:  # OSError: the markdown or a plot could not be written
        print(f"error: {first_line(e)}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted (a Ctrl-C, or a KeyboardInterrupt the factory or a model raised)", file=sys.stderr)
        return INTERRUPTED
    return 0 if report.ok else 1


def first_line(error: BaseException) -> str:
    """An exception's message as one line of at most a few hundred characters (or its class's name)."""
    from jaxloop.config.errors import VALUE_SHOWN

    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= VALUE_SHOWN else line[:VALUE_SHOWN] + f"... (cut at {VALUE_SHOWN} characters)"


def check_outputs(updates: int, markdown: str | None, compile_cache: str = "") -> None:
    """BadInput, before the check runs, for --updates below 0, a --markdown file whose directory is missing or
    a --compile_cache that cannot be a directory."""
    if compile_cache:
        cache = Path(compile_cache).expanduser()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(
                f"--compile_cache={compile_cache!r} is not allowed: a directory that can be made and written "
                f"({first_line(e)}; '' turns the cache off)"
            ) from e
    if updates < 0:
        raise BadInput(f"--updates={updates} is not allowed: an integer >= 0 (0 = no trajectory)")
    if markdown:
        parent = Path(markdown).expanduser().absolute().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise BadInput(
                f"--markdown={markdown!r} is not allowed: a file in an existing, writable directory "
                f"({parent} {'is not writable' if parent.is_dir() else 'is not a directory'})"
            )


def cli(argv: list[str] | None = None) -> int:
    """`python -m jaxloop.parity`: main() in a child process, whose verdict (its exit status, written to the
    file VERDICT_FILE names once main returns) is required: a child that ends without one (the factory or a
    model called os._exit, or the process was killed) is reported in one line, with status 2."""
    argv = sys.argv[1:] if argv is None else argv
    verdict = os.environ.pop(VERDICT_FILE, None)  # popped: a command the check starts is a command of its own
    if verdict:  # the child: main, then its verdict
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's --help (0) or usage error (2)
            status = e.code if isinstance(e.code, int) else BAD_INPUT
        Path(verdict).write_text(str(status))
        return status
    with tempfile.TemporaryDirectory(prefix="jaxloop-parity-") as directory:
        file = Path(directory) / "verdict"
        child = subprocess.Popen(
            [sys.executable, "-m", "jaxloop.parity", *argv], env={**os.environ, VERDICT_FILE: str(file)}
        )
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the child got the Ctrl-C too (one process group): it answers it
            code = child.wait()
        if file.is_file():
            return int(file.read_text())
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(
        f"error: the check ended without its verdict: its process {how} before main() returned (does the "
        "factory or a model call os._exit?)",
        file=sys.stderr,
    )
    return BAD_INPUT


if __name__ == "__main__":
    sys.exit(cli())
