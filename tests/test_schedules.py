"""jaxloop.schedule: every schedule's rates worked by hand on short runs, the per-update stepping through the
optimizer, the float32 table, and `python -m jaxloop.schedule` (the schedule explorer).

Rates below are exact in float64 (powers of two, or the same expression evaluated here) unless stated.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxloop.config.optimizers import SGDConfig
from jaxloop.config.run import Config, OptimConfig, validate
from jaxloop.config.schedules import SCHEDULES
from jaxloop.model.precision import get_policy
from jaxloop.schedule import main
from jaxloop.update.optimizer import make_optimizer
from jaxloop.update.schedules import make_schedule, rates


def _o(steps: int, schedule: str = "warmup_cosine", **fields) -> OptimConfig:
    """peak_lr 1 and schedule `schedule` with its `fields`; where it reads them, no warmup and end_lr 0, unless
    `fields` say otherwise."""
    cls = SCHEDULES[schedule]
    base = {k: v for k, v in dict(init_lr=0.0, end_lr=0.0, warmup_steps=0).items() if k in cls.field_names()}
    cfg = Config(steps=steps, optim=OptimConfig(lr_schedule=cls(**{**base, **fields}), peak_lr=1.0))
    return validate(cfg, check_paths=False).optim


def _rates(steps: int, **fields) -> list[float]:
    return [float(r) for r in rates(_o(steps, **fields), steps)]


def test_warmup_is_composed_in_front_and_the_schedule_counts_from_its_end():
    # warmup 2 from 0.5 (torch: SequentialLR(LinearLR(0.5), StepLR(step_size 2, gamma 0.5), [2])):
    # 0.5, 0.75, then StepLR's own count 0, 1 -> 1, 2, 3 -> 0.5, 4 -> 0.25
    assert _rates(7, schedule="step", step_size=2, gamma=0.5, warmup_steps=2, init_lr=0.5) == [
        0.5,
        0.75,
        1.0,
        1.0,
        0.5,
        0.5,
        0.25,
        0.25,
    ]


def test_constant_linear_and_polynomial():
    assert _rates(4, schedule="constant") == [1.0] * 5
    assert _rates(4, schedule="linear") == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert _rates(4, schedule="linear", end_lr=0.5) == [1.0, 0.875, 0.75, 0.625, 0.5]
    assert _rates(4, schedule="polynomial", power=2.0) == [1.0, 0.5625, 0.25, 0.0625, 0.0]


def test_step_multistep_and_exponential():
    assert _rates(5, schedule="multistep", milestones=(1, 3), gamma=0.5) == [1.0, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert _rates(3, schedule="exponential", gamma=0.5) == [1.0, 0.5, 0.25, 0.125]


def test_cosine_restarts_restart_at_t0_then_cycles_t_mult_times_longer():
    r = _rates(8, schedule="cosine_restarts", t_0=2, t_mult=2, end_lr=0.5)
    # cycle 1: updates 0, 1 (T_i 2); cycle 2: 2..5 (T_i 4); cycle 3 from 6 (T_i 8)
    assert r[0] == r[2] == r[6] == 1.0
    assert r[1] == 0.75  # halfway down a cycle of 2: 0.5 + 0.5 * cos^2(pi/4)
    assert r[4] == pytest.approx(0.75, abs=1e-16) and r[3] == pytest.approx(
        0.5 + 0.5 * math.cos(math.pi / 8) ** 2, rel=1e-15
    )


def test_one_cycle_phases_end_where_torch_puts_them():
    # steps 10, pct_start 0.3: the rise ends at update 0.3 * 10 - 1 = 2 (max_lr), the fall at 9 (the last rate)
    r = _rates(10, schedule="one_cycle", div_factor=4.0, final_div_factor=2.0)
    assert r[0] == 0.25 and r[2] == 1.0 and r[9] == 0.125 and r[10] == 0.125, "start, peak, end, held past steps"
    assert r[1] == pytest.approx(0.625, rel=1e-15), "halfway up the cosine"
    assert max(r) == r[2] and all(a > b for a, b in zip(r[2:9], r[3:10])), "falls after the peak"
    three = _rates(10, schedule="one_cycle", div_factor=4.0, final_div_factor=2.0, three_phase=True)
    # three phases end at 2 (up to max), 4 (back to max/div), 9 (down to the last rate)
    assert three[2] == 1.0 and three[4] == 0.25 and three[9] == 0.125
    linear = _rates(10, schedule="one_cycle", div_factor=4.0, final_div_factor=2.0, anneal_strategy="linear")
    assert linear[1] == 0.625 and linear[2] == 1.0 and linear[9] == 0.125


def test_wsd_is_stable_then_decays_over_its_last_updates():
    # Hugging Face's get_wsd_schedule: the decay's fraction is (v - stable) / decay_steps, so end_lr is
    # reached at update `steps` (held from there), the last trained update being one short of it
    r = _rates(10, schedule="wsd", decay_steps=4, decay_type="linear", warmup_steps=2)
    assert r == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    sqrt = _rates(10, schedule="wsd", decay_steps=4, decay_type="1-sqrt")
    assert sqrt[8] == pytest.approx(1 - math.sqrt(0.5), rel=1e-15) and sqrt[10] == 0.0
    cos = _rates(10, schedule="wsd", decay_steps=4, decay_type="cosine")
    assert cos[8] == pytest.approx(0.5, rel=1e-15) and cos[10] == 0.0


def test_inverse_sqrt_after_warmup():
    r = _rates(12, schedule="inverse_sqrt", warmup_steps=4)
    assert r[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert r[8] == 1 / math.sqrt(2.0) and r[12] == 1 / math.sqrt(3.0)  # timescale = warmup: sqrt(4 / (v + 4))


def test_plateau_starts_at_peak_lr():
    assert _rates(3, schedule="plateau") == [1.0] * 4


@pytest.mark.parametrize(
    "schedule,fields",
    [
        ("warmup_cosine", dict(warmup_steps=3, end_lr=0.01)),
        ("step", dict(step_size=2, gamma=0.5, warmup_steps=1)),
        ("one_cycle", dict()),
        ("wsd", dict(decay_steps=3, warmup_steps=2)),
        ("cosine_restarts", dict(t_0=3)),
    ],
)
def test_the_optimizer_applies_the_rate_of_each_update_once_per_k_micro_batches(schedule, fields):
    """SGD without momentum on a parameter whose gradient is 1: the emitted update is minus the rate. K = 3:
    nothing is applied mid-window, and update u applies rate(u)."""
    steps, k = 9, 3
    o = replace(
        _o(steps, schedule=schedule, **fields), optimizer=SGDConfig(weight_decay=0.0), clip_norm=0.0, accum_steps=k
    )
    tx = make_optimizer(o, steps, get_policy("fp32"))
    params, grads = {"w": jnp.zeros((1,), jnp.float32)}, {"w": jnp.ones((1,), jnp.float32)}
    state, applied, update = tx.init(params), [], jax.jit(tx.update)
    for _ in range((steps + 2) * k):
        updates, state = update(grads, state, params)
        applied.append(-float(updates["w"][0]))
    want = [float(np.float32(r)) for r in rates(o, steps)]
    want = want + [want[-1]]
    assert applied[k - 1 :: k] == want, "update u applies the float32 rounding of rate(u); held past steps"
    assert not any(np.delete(np.asarray(applied), np.s_[k - 1 :: k])), "nothing is applied mid-window"


def test_float32_rates_are_the_float64_table_rounded_once():
    o = _o(300, schedule="one_cycle", three_phase=True, pct_start=0.25)
    table = rates(o, 300)
    with jax.enable_x64(False):
        got = np.asarray(make_schedule(o, 300)(jnp.arange(310)))
    assert got.dtype == np.float32
    assert (got == np.concatenate([table, np.full(9, table[-1])]).astype(np.float32)).all()


@pytest.mark.parametrize("x64", [False, True])
def test_a_rate_read_outside_jit_is_the_rate_the_compiled_step_reads(x64):
    # the optimizer's init reads its first rate eagerly (on the host), every update reads it inside jit (on the
    # device): the same table, rounded once to the default float type, bit for bit, held past steps
    # mutant seen failing: the host path rounding through float16 (float32); through float32 (x64)
    o = _o(300, schedule="one_cycle", three_phase=True, pct_start=0.25)
    with jax.enable_x64(x64):
        at = make_schedule(o, 300)
        counts = jnp.arange(-2, 310)
        eager = np.stack([np.asarray(at(c)) for c in counts])
        jitted = np.asarray(jax.jit(jax.vmap(at))(counts))
    assert eager.dtype == jitted.dtype == (np.float64 if x64 else np.float32)
    assert eager.tobytes() == jitted.tobytes()


def test_an_optimizers_init_compiles_nothing_for_a_new_schedule_length():
    # every run's state is built eagerly; a device lookup of the first rate compiled a conversion and a slice per
    # table length (steps), two compiles of every test and run with a steps of its own
    # mutant seen failing: make_schedule's rate always looked up on the device
    params = {"w": jnp.zeros((3,), jnp.float32)}
    make_optimizer(_o(10), 10, get_policy("fp32")).init(params)  # the init's own eager ops, compiled once
    compiles = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        make_optimizer(_o(11), 11, get_policy("fp32")).init(params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


# ----------------------------------------------------------------------------- the explorer


def test_the_explorer_prints_the_rate_at_chosen_updates(capsys):
    rc = main(["--optim.schedule", "one_cycle", "--steps", "100", "--optim.peak_lr", "0.1", "--at", "0,29,99"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {int(line.split()[0]): float(line.split()[1]) for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {0: pytest.approx(0.004), 29: pytest.approx(0.1), 99: pytest.approx(4e-7)}
    assert out.startswith("one_cycle over 100 updates (peak_lr=0.1, pct_start=0.3")


def test_the_explorer_shows_phase_boundaries_by_default_and_plots(tmp_path, capsys):
    png = tmp_path / "lr.png"
    assert main(["--optim.schedule", "wsd", "--optim.decay_steps", "100", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    shown = [int(line.split()[0]) for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert {0, 49, 50, 400, 401, 499} <= set(shown), "warmup end and decay start (steps 500, warmup 50)"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_explorer_refuses_a_field_its_schedule_does_not_read(capsys):
    assert main(["--optim.schedule", "step", "--optim.step_size", "10", "--optim.t_0", "5"]) == 2
    assert "optim.t_0=5" in capsys.readouterr().err


def test_the_explorer_help_names_its_own_flags_and_the_train_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "--at" in out and "--plot" in out and "--optim.div-factor" in out.replace("_", "-")


def test_the_rate_table_costs_8_bytes_per_update_on_the_host():
    # config.MAX_STEPS's doc: a float64 rate per update (76 MiB at the bound). tracemalloc counts numpy's buffer;
    # the margin (1 MiB) is the iteration's own. Mutant seen failing: the table built from a list first (a Python
    # float and its pointer per update: 32 bytes, 6.4 MB here), as before issue 43.
    import tracemalloc

    steps = 200_000
    optim = _o(steps, schedule="linear")
    tracemalloc.start()
    try:
        table = rates(optim, steps)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table.dtype == np.float64 and table.shape == (steps + 1,)
    assert peak <= 8 * (steps + 1) + (1 << 20), peak
