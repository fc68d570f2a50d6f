"""jaxloop.executables: compiled calls stored by a key computed before tracing, loaded without tracing."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jaxloop import executables
from jaxloop.executables import compile_cached, fingerprint


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


class NoTracing:
    """A jitted function's stand-in that fails if anything lowers (traces) it."""

    def lower(self, *args: Any) -> Any:
        raise AssertionError("traced and lowered again instead of loading the stored call")


BATCH = jnp.ones((4, 3))


def test_a_stored_call_is_loaded_without_tracing_and_computes_the_same_bits(tmp_path: Path) -> None:
    compiled = compile_cached(jax.jit(step, donate_argnums=0), (fresh_state(), BATCH), tmp_path, {"call": "train"})
    assert len(list(tmp_path.glob("*.exe"))) == 1
    loaded = compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {"call": "train"})
    (a, ma), (b, mb) = compiled(fresh_state(), BATCH), loaded(fresh_state(), BATCH)
    assert jax.tree.structure(a) == jax.tree.structure(b)  # the state comes back as a State, metrics as a dict
    for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb))):
        np.testing.assert_array_equal(x, y)  # the same executable: bit for bit


def test_a_loaded_call_still_donates_its_state(tmp_path: Path) -> None:
    compile_cached(jax.jit(step, donate_argnums=0), (fresh_state(), BATCH), tmp_path, {})
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


def test_the_key_changes_when_a_source_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fake_steps"
    package.mkdir()
    (package / "__init__.py").write_text("def loss(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("fake_steps")
    monkeypatch.setattr(executables, "SOURCE_PACKAGES", ("fake_steps",))
    before = _key()
    (package / "__init__.py").write_text("def loss(x):\n    return x * 3\n")
    assert _key() != before
    sys.modules.pop("fake_steps")


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path: Path) -> None:
    compile_cached(jax.jit(step), (fresh_state(), BATCH), tmp_path, {})
    (entry,) = tmp_path.glob("*.exe")
    entry.write_bytes(b"not an executable")
    compiled = compile_cached(jax.jit(step), (fresh_state(), BATCH), tmp_path, {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0
    compile_cached(NoTracing(), (fresh_state(), BATCH), tmp_path, {})  # replaced by a readable entry


def test_outputs_whose_structure_cannot_be_stored_are_compiled_every_time(tmp_path: Path) -> None:
    # The output is a State built inside the step (not the first argument's tree): its function-valued
    # static field cannot be pickled, so the call is not stored, and still compiles and runs.
    def make(batch: jax.Array) -> State:
        return State(w=batch, count=jnp.zeros((), jnp.int32), rule=lambda w, g: w)

    compiled = compile_cached(jax.jit(make), (BATCH,), tmp_path, {})
    np.testing.assert_array_equal(compiled(BATCH).w, BATCH)
    assert not list(tmp_path.glob("*.exe"))


def test_no_directory_means_no_store(tmp_path: Path) -> None:
    compiled = compile_cached(jax.jit(step), (fresh_state(), BATCH), None, {})
    assert float(compiled(fresh_state(), BATCH)[1]["loss"]) > 0


WARM_JAX_CACHE = """
import sys, jax, jax.numpy as jnp
from jaxloop.compilation import enable_compilation_cache
from jaxloop.executables import compile_cached
enable_compilation_cache(sys.argv[1])
def f(x):
    return jnp.tanh(x)[:, None] * jnp.ones((3, 5)) + x.sum()
x = jnp.arange(3.0)
if sys.argv[2] == "jax":
    jax.jit(f).lower(x).compile()  # JAX's persistent cache now holds f
else:
    compile_cached(jax.jit(f), (x,), sys.argv[3], {})  # a miss here: JAX's cache holds f
    print(compile_cached(None, (x,), sys.argv[3], {})(x).sum())  # loaded back (None: cannot be traced)
"""


def test_a_call_jax_s_persistent_cache_holds_is_stored_from_a_fresh_compile(tmp_path: Path) -> None:
    # Stored from the executable JAX loads from its cache, the call would come back without its code and
    # fail when run ("Function wrapped_tanh not found", jax 0.10 XLA:CPU); fresh processes, as in two runs.
    def child(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WARM_JAX_CACHE, str(tmp_path / "jax"), *argv],
                              capture_output=True, text=True, timeout=120)

    assert child("jax").returncode == 0
    out = child("ours", str(tmp_path / "exe"))
    assert out.returncode == 0, out.stderr[-2000:]
    x = jnp.arange(3.0)
    expected = float(jnp.sum(jnp.tanh(x)[:, None] * jnp.ones((3, 5)) + x.sum()))  # f's value, compiled here
    assert float(out.stdout.split()[-1]) == pytest.approx(expected, rel=1e-6)  # float32 sums, order may differ
