"""jaxloop.loop.executables: compiled calls stored by a key computed before tracing, loaded without tracing."""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jaxloop import run
from jaxloop.loop import executables
from jaxloop.loop.executables import compile_cached, fingerprint
from jaxloop.loop.runner import compiled_context
from jaxloop.core.config import Config


@struct.dataclass
class State:
    """Like TrainState: arrays, and a static field holding a function (which does not pickle)."""

    w: jax.Array
    count: jax.Array
    rule: Callable[..., Any] = struct.field(pytree_node=False)


def sgd(w: jax.Array, g: jax.Array) -> jax.Array:
    return w - 0.1 * g


def fresh_state() -> State:
    return State(w=jnp.arange(6.0).reshape(2, 3), count=jnp.zeros((), jnp.int32), rule=sgd)


def step(state: State, batch: jax.Array) -> tuple[State, dict[str, jax.Array]]:
    g = batch.mean(0) * state.w
    return state.replace(w=state.rule(state.w, g), count=state.count + 1), {"loss": (g ** 2).sum(), "n": state.count}


def fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn as a new function object, with its module and name (so its key): jit compiles it afresh instead of
    answering from its in-process caches (a call is stored only from an XLA compile seen happening)."""
    return functools.wraps(fn)(lambda *args: fn(*args))


class NoTracing:
    """A stand-in for jax.jit(fn) (the same function, hence the same key) that fails if lowered (traced)."""

    def __init__(self, fn: Callable[..., Any] = step) -> None:
        self.__wrapped__ = fn

    def lower(self, *args: Any) -> Any:
        raise AssertionError("traced and lowered again instead of loading the stored call")


BATCH = jnp.ones((4, 3))


def test_a_stored_call_is_loaded_without_tracing_and_computes_the_same_bits(tmp_path: Path) -> None:
    compiled = compile_cached(jax.jit(fresh(step), donate_argnums=0), (fresh_state(), BATCH), tmp_path,
                              {"call": "train"})
    assert len(list(tmp_path.glob("*.exe"))) == 1
    loaded = compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {"call": "train"})
    (a, ma), (b, mb) = compiled(fresh_state(), BATCH), loaded(fresh_state(), BATCH)
    assert jax.tree.structure(a) == jax.tree.structure(b)  # the state comes back as a State, metrics as a dict
    for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb))):
        np.testing.assert_array_equal(x, y)  # the same executable: bit for bit


def test_a_loaded_call_still_donates_its_state(tmp_path: Path) -> None:
    compile_cached(jax.jit(fresh(step), donate_argnums=0), (fresh_state(), BATCH), tmp_path, {})
    loaded = compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})
    state = fresh_state()
    loaded(state, BATCH)
    assert state.w.is_deleted()  # the input buffers were given to the outputs, as the loop's step needs


def _key(context: Any = None, args: tuple | None = None) -> str:
    return fingerprint({"call": "train"} if context is None else context, (fresh_state(), BATCH) if args is None else args)


@pytest.mark.parametrize("change", [
    lambda: _key(context={"call": "eval"}),
    lambda: _key(args=(fresh_state(), jnp.ones((5, 3)))),  # a shape
    lambda: _key(args=(fresh_state(), jnp.ones((4, 3), jnp.float16))),  # a dtype
    lambda: _key(args=(fresh_state().replace(count=jnp.asarray(0)), BATCH)),  # weak-typed (a Python scalar's type)
    lambda: _key(args=(fresh_state(), {"x": BATCH})),  # the arguments' structure
], ids=["context", "shape", "dtype", "weak_type", "structure"])
def test_the_key_changes_with_the_context_and_the_arguments_types(change: Callable[[], str]) -> None:
    assert _key() == _key()  # deterministic
    assert change() != _key()


def test_the_key_changes_with_xla_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert _key() != before


def test_the_key_changes_with_jax_configuration() -> None:
    before = _key()
    with jax.default_matmul_precision("bfloat16"):
        assert _key() != before


def test_the_source_digest_changes_when_a_source_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fake_steps"
    package.mkdir()
    (package / "__init__.py").write_text("def loss(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_steps", raising=False)
    before = executables._source_digest(("fake_steps",))
    (package / "__init__.py").write_text("def loss(x):\n    return x * 3\n")
    assert executables._source_digest(("fake_steps",)) != before
    sys.modules.pop("fake_steps", None)


def test_the_key_holds_the_sources_as_loaded_not_as_they_are_on_disk_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # A file edited while a run goes on must not key code traced from its former text: the key uses the
    # digest taken when jaxloop was imported.
    before = _key()
    monkeypatch.setattr(executables, "_source_digest", lambda packages: "edited on disk")
    assert _key() == before
    monkeypatch.setattr(executables, "LOADED_SOURCES", "other sources")
    assert _key() != before


def test_sources_that_cannot_be_read_mean_compiling_without_storing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "compiled_only"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("compiled_only")
    (package / "__init__.py").unlink()  # no .py left to read, as in a zip or .pyc-only install
    assert executables._source_digest(("compiled_only",)) is None
    sys.modules.pop("compiled_only", None)
    monkeypatch.setattr(executables, "LOADED_SOURCES", None)
    compiled = compile_cached(jax.jit(step), (fresh_state(), BATCH), tmp_path / "exe", {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0
    assert not (tmp_path / "exe").exists()


def test_the_key_changes_with_the_function() -> None:
    other = jax.jit(lambda state, batch: step(state, 2 * batch))
    assert fingerprint({}, (fresh_state(), BATCH), jax.jit(step)) != fingerprint({}, (fresh_state(), BATCH), other)


def test_the_key_changes_with_the_sharding() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    named = jax.device_put(BATCH, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert _key(args=(fresh_state(), named)) != _key()


def test_a_fresh_miss_fills_jax_s_persistent_cache_too(tmp_path: Path) -> None:
    from jax._src.compilation_cache import reset_cache

    from jaxloop.loop.compilation import enable_compilation_cache

    before, args = jax.config.jax_compilation_cache_dir, (fresh_state(), BATCH)
    try:
        enable_compilation_cache(tmp_path / "jax")
        compile_cached(jax.jit(fresh(step)), args, tmp_path / "exe", {})
        assert list((tmp_path / "jax").iterdir()) and list((tmp_path / "exe").iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        reset_cache()


def test_the_cache_keeps_xla_s_autotuning_results_but_not_its_gpu_kernel_cache(tmp_path: Path) -> None:
    # "all" adds XLA's GPU kernel cache: with it, on an H100 (jax 0.11.2), the fp32 eval step compiled
    # after the train step in one process died with CUDA_ERROR_ILLEGAL_INSTRUCTION. CPU runs never show
    # it, so the setting itself is what this checks.
    from jax._src.compilation_cache import reset_cache

    from jaxloop.loop.compilation import enable_compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_enable_xla_caches)
    try:
        for asked, kept in [("all", "xla_gpu_per_fusion_autotune_cache_dir"),
                            ("xla_gpu_kernel_cache_file", "xla_gpu_per_fusion_autotune_cache_dir"),
                            ("none", "none")]:  # a user's choice without the kernel cache stands
            jax.config.update("jax_persistent_cache_enable_xla_caches", asked)
            enable_compilation_cache(tmp_path / "jax")
            assert jax.config.jax_persistent_cache_enable_xla_caches == kept, asked
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_enable_xla_caches", before[1])
        reset_cache()


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path: Path) -> None:
    compile_cached(jax.jit(fresh(step)), (fresh_state(), BATCH), tmp_path, {})
    (entry,) = tmp_path.glob("*.exe")
    entry.write_bytes(b"not an executable")
    compiled = compile_cached(jax.jit(fresh(step)), (fresh_state(), BATCH), tmp_path, {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0
    compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})  # replaced by a readable entry


def _entries_aged(directory: Path, names: str, size: int = 100) -> None:
    """Fake entries of `size` bytes, each used one second after the one before it (oldest first)."""
    for i, name in enumerate(names):
        path = directory / f"{name}.exe"
        path.write_bytes(b"x" * size)
        os.utime(path, ns=(1_000_000_000 * (i + 1),) * 2)


def test_eviction_deletes_the_least_recently_used_entries_until_under_the_bound(tmp_path: Path) -> None:
    _entries_aged(tmp_path, "abcd")
    executables._evict(tmp_path, 250, keep=tmp_path / "d.exe")
    assert sorted(p.name for p in tmp_path.glob("*.exe")) == ["c.exe", "d.exe"]  # 400 bytes -> 200


def test_eviction_never_deletes_the_entry_just_stored(tmp_path: Path) -> None:
    _entries_aged(tmp_path, "abc")
    executables._evict(tmp_path, 250, keep=tmp_path / "a.exe")  # the oldest, but just stored
    assert sorted(p.name for p in tmp_path.glob("*.exe")) == ["a.exe", "c.exe"]


def test_a_store_evicts_beyond_the_bound(tmp_path: Path) -> None:
    _entries_aged(tmp_path, "ab")
    compile_cached(jax.jit(fresh(step)), (fresh_state(), BATCH), tmp_path, {}, max_bytes=0)
    (kept,) = tmp_path.glob("*.exe")  # a bound of 0 leaves only the entry just stored
    assert kept.name not in ("a.exe", "b.exe")
    compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})  # and it loads


def test_a_load_marks_its_entry_used(tmp_path: Path) -> None:
    compile_cached(jax.jit(fresh(step)), (fresh_state(), BATCH), tmp_path, {})
    (entry,) = tmp_path.glob("*.exe")
    os.utime(entry, ns=(1_000_000_000, 1_000_000_000))  # last used long ago
    compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})
    assert entry.stat().st_mtime_ns > 1_000_000_000  # now the most recently used: evicted last


def test_outputs_whose_structure_cannot_be_stored_are_compiled_every_time(tmp_path: Path) -> None:
    # The output is a State built inside the step (not the first argument's tree): its function-valued
    # static field cannot be pickled, so the call is not stored, and still compiles and runs.
    def make(batch: jax.Array) -> State:
        return State(w=batch, count=jnp.zeros((), jnp.int32), rule=lambda w, g: w)

    compiled = compile_cached(jax.jit(make), (BATCH,), tmp_path, {})
    np.testing.assert_array_equal(compiled(BATCH).w, BATCH)
    assert not list(tmp_path.glob("*.exe"))


def test_a_call_jit_had_compiled_already_in_this_process_is_not_stored(tmp_path: Path) -> None:
    # jit answers from its in-process cache without compiling: that executable may have come from JAX's
    # persistent cache (see the next test), so only a compile seen happening is stored.
    jitted = jax.jit(fresh(step))
    jitted.lower(fresh_state(), BATCH).compile()
    compiled = compile_cached(jitted, (fresh_state(), BATCH), tmp_path, {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0
    assert not list(tmp_path.glob("*.exe"))


def test_no_directory_means_no_store(tmp_path: Path) -> None:
    compiled = compile_cached(jax.jit(step), (fresh_state(), BATCH), None, {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0


TWO_RUNS = """
import functools, os, sys, jax, jax.numpy as jnp
from pathlib import Path
from jaxloop.loop import executables
from jaxloop.loop.compilation import enable_compilation_cache
from jaxloop.loop.executables import compile_cached, fingerprint
jax_cache, mode, exe = sys.argv[1:4]
enable_compilation_cache(jax_cache)
def f(x):
    return jnp.tanh(x)[:, None] * jnp.ones((3, 5)) + x.sum()
x = jnp.arange(3.0)
class Loaded:  # f's identity (the key's), but no way to trace it: the call must be loaded
    __wrapped__ = f
if mode == "jax":
    jax.jit(f).lower(x).compile()  # JAX's persistent cache now holds f
elif mode == "ours":
    compile_cached(jax.jit(f), (x,), exe, {})  # a miss here: JAX's cache holds f
    print(compile_cached(Loaded(), (x,), exe, {})(x).sum())
    entries = len(os.listdir(jax_cache))
    jax.jit(lambda x: 7 * x + 1).lower(x).compile()  # JAX's cache, switched off for the recompile, is on again
    print(len(os.listdir(jax_cache)) - entries)
elif mode == "store code-less":
    entry = Path(exe) / f"{fingerprint({}, (x,), jax.jit(f))}.exe"
    jax.jit(f).lower(x).compile()  # a fresh compile: JAX's cache now holds f
    again = jax.jit(functools.wraps(f)(lambda x: f(x))).lower(x).compile()  # answered by JAX's cache
    entry.parent.mkdir(exist_ok=True)
    assert executables._store(entry, again, (x,))  # stored as compile_cached never would: without its code
else:  # run the stored call
    try:
        compile_cached(Loaded(), (x,), exe, {})(x)
    except RuntimeError as e:
        print(str(e).replace(chr(10), " "))
    print(len(os.listdir(exe)))
"""


def two_runs(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    """A fresh process, as one run: `mode` of TWO_RUNS over tmp_path's JAX cache and executables."""
    return subprocess.run([sys.executable, "-c", TWO_RUNS, str(tmp_path / "jax"), mode, str(tmp_path / "exe")],
                          capture_output=True, text=True, timeout=120)


def test_a_call_jax_s_persistent_cache_holds_is_stored_from_a_fresh_compile(tmp_path: Path) -> None:
    # Stored from the executable JAX loads from its cache, the call would come back without its code and
    # fail when run ("Function wrapped_tanh not found", jax 0.10 XLA:CPU); fresh processes, as in two runs.
    assert two_runs(tmp_path, "jax").returncode == 0
    out = two_runs(tmp_path, "ours")
    assert out.returncode == 0, out.stderr[-2000:]
    x = jnp.arange(3.0)
    expected = float(jnp.sum(jnp.tanh(x)[:, None] * jnp.ones((3, 5)) + x.sum()))  # f's value, compiled here
    value, new_entries = out.stdout.split()[-2:]
    assert float(value) == pytest.approx(expected, rel=1e-6)  # float32 sums, order may differ
    assert int(new_entries) >= 1


def test_an_entry_that_loads_but_fails_on_its_first_run_is_deleted(tmp_path: Path) -> None:
    # Fresh processes, as two runs: the first stores the executable JAX's cache answers with (without its
    # code: what the guard in compile_cached prevents), the second loads it and runs it.
    assert two_runs(tmp_path, "store code-less").returncode == 0
    out = two_runs(tmp_path, "run")
    assert out.returncode == 0, out.stderr[-2000:]
    message, left = out.stdout.strip().splitlines()[-2:]
    assert "failed on its first run" in message and "not found" in message  # XLA's error, named
    assert left == "0"  # the entry is deleted: the next run compiles the call afresh


class FailingRun:
    """A stand-in for a loaded executable whose runs raise what XLA raises for an executable missing its code."""

    def __call__(self, *args: Any) -> Any:
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_tanh not found")


def test_a_failure_after_a_first_good_run_leaves_the_entry(tmp_path: Path) -> None:
    entry = tmp_path / "a.exe"
    entry.write_bytes(b"entry")
    call = executables.LoadedCall(lambda *args: args, entry)
    call(1)
    call.compiled = FailingRun()  # the same entry, now failing: not the entry's fault (it ran)
    with pytest.raises(jax.errors.JaxRuntimeError):
        call(1)
    assert entry.exists()


def test_arguments_of_the_wrong_type_leave_the_entry(tmp_path: Path) -> None:
    compile_cached(jax.jit(fresh(step)), (fresh_state(), BATCH), tmp_path, {})
    loaded = compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})
    with pytest.raises(TypeError):
        loaded(fresh_state(), jnp.ones((5, 3)))  # refused before running: the caller's mistake, not the entry's
    assert len(list(tmp_path.glob("*.exe"))) == 1
    assert float(loaded(fresh_state(), BATCH)[1]["loss"]) > 0


def _cfg(**fields: Any) -> Config:
    return replace(Config(preset="debug"), **fields)


@pytest.mark.parametrize("field", [
    dict(model=replace(Config(preset="debug").model, activation="relu")),
    dict(optim=replace(Config(preset="debug").optim, peak_lr=0.5)),
    dict(precision="bf16"),
    dict(steps=21),  # the schedule's length is a constant of the compiled optimizer
], ids=["model.activation", "optim.peak_lr", "precision", "steps"])
def test_a_config_field_the_computation_uses_changes_the_context(field: dict) -> None:
    assert compiled_context(_cfg(**field), "train x1") != compiled_context(_cfg(), "train x1")


@pytest.mark.parametrize("field", [
    dict(run_dir="elsewhere"), dict(seed=7), dict(resume="never"), dict(eval_every=3),
    dict(log=replace(Config(preset="debug").log, progress="plain")),
    dict(checkpoint=replace(Config(preset="debug").checkpoint, keep_last=9)),
], ids=["run_dir", "seed", "resume", "eval_every", "log.progress", "checkpoint.keep_last"])
def test_a_host_side_config_field_leaves_the_context_alone(field: dict) -> None:
    # so a resume or a seed sweep loads the calls an earlier run stored
    assert compiled_context(_cfg(**field), "train x1") == compiled_context(_cfg(), "train x1")


def _no_compile() -> None:
    raise AssertionError("a call of the second run was compiled instead of loaded")


def test_a_second_run_in_a_process_loads_every_call_and_compiles_none(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxloop.loop.compilation import enable_compilation_cache

    cfg = _cfg(compile_cache=str(tmp_path / "cache"), log=replace(Config(preset="debug").log, progress="off",
                                                                    report=False, tensorboard=False))
    try:
        first = run(replace(cfg, run_dir=str(tmp_path / "a")))
        stored = sorted(p.name for p in (tmp_path / "cache" / "jaxloop-executables").iterdir())
        loads: list[Path] = []
        load = executables._load
        monkeypatch.setattr(executables, "_load", lambda path, args: (loads.append(path), load(path, args))[1])
        monkeypatch.setattr(executables, "_persistent_cache_off", _no_compile)  # any miss here fails
        second = run(replace(cfg, run_dir=str(tmp_path / "b")))
    finally:
        enable_compilation_cache(Config().compile_cache)  # JAX's cache back where the other tests have it
    assert sorted(p.name for p in loads) == sorted(set(p.name for p in loads)) == stored  # each once, all of them
    assert second["state_digest"] == first["state_digest"]


def test_the_compiled_call_rule_is_its_own_not_the_resume_rule() -> None:
    """memory.remat: a resume may change it (the same math), yet it changes the compiled call, so a stored
    executable must not be reused for it; seed: a resume may not change it, yet no compiled call reads it.
    Mutant (NOT_COMPILED derived from RESUME_SAFE, as before): the first assertion fails, seen."""
    from jaxloop.core.config import resume_conflicts, to_dict

    base = _cfg()
    remat = _cfg(memory=replace(base.memory, remat="blocks"))
    assert resume_conflicts(to_dict(base), remat) == [], "memory.remat is resume-safe"
    assert compiled_context(remat, "train x1") != compiled_context(base, "train x1"), "but compiled"
    seeded = _cfg(seed=7)
    assert resume_conflicts(to_dict(base), seeded) != [], "seed is not resume-safe"
    assert compiled_context(seeded, "train x1") == compiled_context(base, "train x1"), "but not compiled"


class Planted:
    """A pickle payload: unpickling it calls builtins.exec, which creates the file `ran`."""

    def __init__(self, ran: Path) -> None:
        self.ran = ran

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.ran)!r}, 'w').close()",))


def test_a_planted_pickle_is_refused_not_executed_and_the_call_compiled_afresh(tmp_path: Path) -> None:
    # An entry is data (a format line, JSON, jax's executable bytes read by an unpickler that may name only
    # jax's classes and dtypes): neither a whole-file pickle (the former format) nor a payload in place of
    # the executable's bytes runs. Each is taken for an unreadable entry: compiled again and replaced.
    import pickle

    ran = tmp_path / "ran"
    args = (fresh_state(), BATCH)
    compile_cached(jax.jit(fresh(step)), args, tmp_path, {})
    (entry,) = tmp_path.glob("*.exe")
    header = entry.read_bytes().split(b"\n", 2)[:2]
    payload = pickle.dumps(Planted(ran))
    for planted in (payload, b"\n".join([*header, payload])):
        entry.write_bytes(planted)
        compiled = compile_cached(jax.jit(fresh(step)), args, tmp_path, {})
        assert not ran.exists(), "the planted pickle ran"
        assert float(compiled(*args)[1]["loss"]) > 0
        assert entry.read_bytes() != planted, "the planted entry is replaced by the fresh compile"
