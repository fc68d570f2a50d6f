"""compare(): every check of a PyTorch module against its Flax translation, in one call, one report.

Per precision (fp64, then fp32; module precision.py pins the settings): the torch module's weights
are mapped onto the Flax model (weights.py; the mapping is decided once, from the first precision's
forward pass); then, dropout off throughout:

1. forward, eval mode: the root outputs and the losses; every paired layer (layers.py), the first
   diverging one named with its diagnoses (diagnose.py);
2. forward, train mode: the same, and the buffers after the step (BatchNorm running statistics);
3. gradients of one train-mode backward pass, tensor by tensor;
4. updates: jaxloop's optimizer against torch's on the same gradients, for each config of
   training.update_configs (clipping that acts among them);
5. optionally a trajectory of `trajectory` updates through jaxloop.make_train_step and a torch loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from jaxloop.parity import diagnose, evidence, layers, training, weights
from jaxloop.parity.flaxside import (
    FlaxModel,
    attention_dropout_off,
    batch_to_jax,
    flax_model,
    pin_dtype,
)
from jaxloop.parity.measures import (
    curve_rel_diff,
    rel_diff,
    scaled_diffs,
    whole_rel_diff,
    worst,
)
from jaxloop.parity.port import Batch, Port, flax_output_loss, torch_output_loss
from jaxloop.parity.port_report import Report, Row
from jaxloop.parity.precision import check_precisions, pinned, settings
from jaxloop.parity.tolerances import tolerance
from jaxloop.parity.torchside import (
    functional_dropout_off,
    prepared,
    require_torch,
    state_dict,
)

CHECKS = ("forward", "gradients", "update")
SCALE = (
    "; each tensor against max(its norm, its share of the whole tree's norm): a tensor whose exact value is "
    "zero (a key bias's gradient) is measured against the tree's scale, not its own rounding"
)


def compare(
    torch_module: Any,
    flax_module: Any,
    batch: Batch,
    torch_loss: Callable | None = None,
    flax_loss: Callable | None = None,
    *,
    precisions: Sequence[str] = ("fp64", "fp32"),
    trajectory: int = 0,
    batches: Callable[[int], Batch] | Sequence[Batch] | None = None,
    overrides: dict[str, Any] | None = None,
    rename: list[tuple[str, str]] | None = None,
    checks: Sequence[str] = CHECKS,
    update_steps: int = 3,
    tolerances: dict[tuple[str, str], float] | None = None,
    name: str = "",
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Check a Flax translation (Linen or NNX) of a PyTorch module; returns the Report (report.assert_ok()
    in a test). Losses default to 0.5 mean(model(batch["x"])^2). `checks`: "forward" (with the train-mode
    buffers; always), "gradients", "update". `trajectory`: updates of the optional trajectory check (0 =
    none), on `batches(u)` (or the example batch). Raises TorchMissing without torch, MappingError when
    the weights do not map, ModelError when a model rejects the batch. `progress(message)`: told as each stage
    begins (the command prints it: a check of minutes is not silent)."""
    require_torch()
    precisions = check_precisions(list(precisions))
    if "forward" not in checks or set(checks) - set(CHECKS):
        raise ValueError(f"checks={list(checks)!r} is not allowed: 'forward' and any of {CHECKS[1:]}")
    torch_loss = torch_loss or torch_output_loss
    flax_loss = flax_loss or flax_output_loss
    report = Report(name=name)
    runs: dict[str, training.Trajectory] = {}
    tell = progress or (lambda message: None)
    for p in precisions:
        with pinned(p), functional_dropout_off(), attention_dropout_off():
            report.settings = settings()
            module, note = pin_dtype(flax_module, p)
            if note:
                report.notes.append(f"[{p}] {note}")
            _one_precision(
                report,
                p,
                torch_module,
                module,
                batch,
                torch_loss,
                flax_loss,
                overrides,
                rename,
                checks,
                update_steps,
                trajectory,
                batches,
                runs,
                tolerances,
                tell,
            )
    return report


def _one_precision(
    report: Report,
    p: str,
    torch_module: Any,
    flax_module: Any,
    batch: Batch,
    torch_loss: Callable,
    flax_loss: Callable,
    overrides: dict | None,
    rename: list | None,
    checks: Sequence[str],
    update_steps: int,
    trajectory: int,
    batches: Any,
    runs: dict[str, training.Trajectory],
    tolerances: dict | None,
    tell: Callable[[str], None],
) -> None:
    """Every check in precision p (module doc); the mapping is made in the first precision checked."""
    tell(f"[{p}] the forward pass, layer by layer (eval and train mode)...")
    tm = prepared(torch_module, p)
    fm = flax_model(flax_module, flax_loss, batch_to_jax(batch, p))
    tcap = layers.capture_torch(tm, torch_loss, batch, False, p)
    if report.mapping is None:
        report.mapping = _mapping(tm, fm, tcap, flax_loss, batch, p, overrides, rename)
        report.notes += report.mapping.notes
    mapping = report.mapping
    fm = fm.with_leaves(mapping.to_flax(state_dict(tm)), p)
    _forward(report, "eval", mapping, fm, tcap, layers.capture_flax(fm, flax_loss, batch, False, p), p, tolerances)
    tcap_t = layers.capture_torch(prepared(torch_module, p), torch_loss, batch, True, p)
    fcap_t = layers.capture_flax(fm, flax_loss, batch, True, p)
    _forward(report, "train", mapping, fm, tcap_t, fcap_t, p, tolerances)
    _buffers(report, mapping, fm, tcap, tcap_t, fcap_t, p, tolerances)
    if "gradients" not in checks and "update" not in checks and trajectory == 0:
        return
    tell(f"[{p}] the gradients...")
    fgrads = _gradients(
        report,
        mapping,
        fm,
        prepared(torch_module, p),
        torch_loss,
        flax_loss,
        batch,
        p,
        tolerances,
        row="gradients" in checks,
    )
    grad_norm = float(math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in fgrads.values())))
    if "update" in checks:
        t = tolerance("update", p, tolerances)
        tell(f"[{p}] the optimizers: {len(training.update_configs(grad_norm))} configs x {update_steps} updates...")
        for r in training.updates(tm, fm, mapping, fgrads, p, training.update_configs(grad_norm), update_steps):
            clipping = {"acting": "; clipping acted", "idle": "; note: clipping did not act", "": ""}[r.clipping]
            report.rows.append(
                Row(f"update x{update_steps}: {r.label}", p, r.diff, t.value, t.reason + clipping, r.where)
            )
    if trajectory > 0:
        tell(f"[{p}] the trajectory: {trajectory} updates on each side...")
        runs[p] = training.trajectory(
            tm,
            fm,
            mapping,
            torch_loss,
            flax_loss,
            batches,
            batch,
            training.trajectory_config(grad_norm),
            trajectory,
            p,
            lambda u: tell(f"[{p}] the trajectory: update {u}/{trajectory}"),
        )
        _trajectory(report, runs[p], p, trajectory, runs, tolerances)


def check(port: Port, **kwargs: Any) -> Report:
    """compare() of a Port (what a factory for `python -m jaxloop.parity` returns)."""
    return compare(
        port.torch_module,
        port.flax_module,
        port.batch,
        port.torch_loss,
        port.flax_loss,
        batches=kwargs.pop("batches", port.batches),
        overrides=kwargs.pop("overrides", port.overrides),
        rename=kwargs.pop("rename", port.rename),
        name=kwargs.pop("name", port.name),
        **kwargs,
    )


def map_weights(
    torch_module: Any,
    flax_module: Any,
    batch: Batch,
    torch_loss: Callable | None = None,
    flax_loss: Callable | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    rename: list[tuple[str, str]] | None = None,
) -> weights.Mapping:
    """The weight mapping alone (the example batch gives the execution order); jaxloop.parity.flax_variables
    and load_into_torch move weights with it either way."""
    require_torch()
    torch_loss, flax_loss = torch_loss or torch_output_loss, flax_loss or flax_output_loss
    with pinned("fp32"):
        tm = prepared(torch_module, "fp32")
        fm = flax_model(flax_module, flax_loss, batch_to_jax(batch, "fp32"))
        tcap = layers.capture_torch(tm, torch_loss, batch, False, "fp32")
        return _mapping(tm, fm, tcap, flax_loss, batch, "fp32", overrides, rename)


def _mapping(
    tm: Any,
    fm: FlaxModel,
    tcap: layers.Capture,
    flax_loss: Callable,
    batch: Batch,
    p: str,
    overrides: dict | None,
    rename: list | None,
) -> weights.Mapping:
    """The mapping, with execution order from one forward pass of each side (the Flax one only traced)."""
    fcap = layers.capture_flax(fm, flax_loss, batch, False, p, trace_only=True)
    tslots, tied, dropped = weights.torch_slots(tm)
    leaves = fm.leaves()
    fslots = weights.flax_slots(fm.kinds(), {k: tuple(v.shape) for k, v in leaves.items()}, fm.kind)
    weights.set_orders(tslots, fslots, tcap.order(), {n: (c.start, c.type, c.module) for n, c in fcap.calls.items()})
    decide = evidence.layout_by_output(tcap, state_dict(tm), fm.kind, p)
    return weights.map_slots(tslots, fslots, tied, dropped, overrides, rename, decide)


def _module_leaves(mapping: weights.Mapping, fm: FlaxModel, flax_module: str) -> dict[str, str]:
    prefix = "params/" if fm.kind == "linen" else ""
    out = {}
    for name in fm.kinds():
        parts = name[len(prefix) :].split("/") if name.startswith(prefix) else name.split("/")[1:]
        if "/".join(parts[:-1]) == flax_module:
            out[parts[-1]] = name
    return out


def _forward(
    report: Report,
    mode: str,
    mapping: weights.Mapping,
    fm: FlaxModel,
    tcap: layers.Capture,
    fcap: layers.Capture,
    p: str,
    tolerances: dict | None,
) -> None:
    t = tolerance("forward", p, tolerances)
    pairs = layers.pair_modules(mapping, tcap, fcap)
    diffs = layers.compare_layers(pairs, tcap, fcap)
    root = next((d for d in diffs if d.torch == "" and d.flax == ""), None)
    if root is None and "" in tcap.calls and "" in fcap.calls:  # outputs that do not correspond
        root = layers.compare_layers([("", "")], tcap, fcap)[0]
    if root is not None:
        report.rows.append(Row(f"forward ({mode}): model output", p, root.out_diff, t.value, t.reason, root.note))
    report.rows.append(Row(f"forward ({mode}): loss", p, _rel(fcap.loss, tcap.loss), t.value, t.reason))
    if diffs:
        value, where = max(
            ((d.out_diff, d.torch or "(root)") for d in diffs), key=lambda x: math.inf if math.isnan(x[0]) else x[0]
        )
        report.rows.append(
            Row(
                f"forward ({mode}): every paired layer ({len(diffs)})",
                p,
                value,
                t.value,
                t.reason,
                where if value > t.value or math.isnan(value) else "",
            )
        )
    report.layers[f"{p} {mode}"] = diffs
    div = layers.first_divergence(diffs, t.value)
    if div is not None:
        flax_leaves = fm.leaves()
        div.diagnoses = diagnose.diagnose(
            div, tcap, fcap, flax_leaves, _module_leaves(mapping, fm, div.layer.flax), p, diffs
        )
        report.divergences[f"{p} {mode}"] = div


def _buffers(
    report: Report,
    mapping: weights.Mapping,
    fm: FlaxModel,
    tcap_before: layers.Capture,
    tcap: layers.Capture,
    fcap: layers.Capture,
    p: str,
    tolerances: dict | None,
) -> None:
    kinds = fm.kinds()
    buffers = [k for k, v in kinds.items() if v == "buffer"]
    if not buffers:
        return
    t = tolerance("buffers", p, tolerances)
    flax_after = replace(fm, model_state=fcap.state).leaves()
    torch_after = mapping.to_flax(tcap.state)
    diffs = scaled_diffs({k: flax_after[k] for k in buffers}, {k: torch_after[k] for k in buffers})
    value, where = worst(diffs)
    report.rows.append(
        Row("buffers after one train-mode step", p, value, t.value, t.reason, where if not value <= t.value else "")
    )
    if value <= t.value:
        return
    torch_before = mapping.to_flax(tcap_before.state)
    for e in mapping.entries:  # the first BatchNorm whose statistics differ, explained
        if e.flax in diffs and not diffs[e.flax] <= t.value:
            stats = {
                leaf.split("/")[-1]: leaf for leaf in buffers if leaf.rsplit("/", 1)[0] == e.flax.rsplit("/", 1)[0]
            }
            tc = tcap.calls.get(e.torch_module)
            fcall = fcap.calls.get(e.flax_module)
            both = layers.align(tc.input if tc else None, fcall.input if fcall else None)
            if both is not None and not layers.difference(*both) <= t.value:
                report.notes.append(
                    f"[{p}] buffers of torch {e.torch_module} / Flax {e.flax_module} differ: its "
                    f"train-mode input already differs ({layers.difference(*both):.1e}; see the first "
                    "divergence)"
                )
                return
            found = diagnose.batch_norm_update(
                tc.module if tc else None,
                fcall.module if fcall else None,
                tc.input if tc else None,
                {k: torch_before[v] for k, v in stats.items()},
                {k: torch_after[v] for k, v in stats.items()},
                {k: flax_after[v] for k, v in stats.items()},
                p,
            )
            report.notes.append(
                f"[{p}] buffers of torch {e.torch_module} / Flax {e.flax_module} differ"
                + ("".join(f"; diagnosis: {d}" for d in found) if found else "")
            )
            return


def _gradients(
    report: Report,
    mapping: weights.Mapping,
    fm: FlaxModel,
    tm: Any,
    torch_loss: Callable,
    flax_loss: Callable,
    batch: Batch,
    p: str,
    tolerances: dict | None,
    row: bool = True,
) -> dict[str, np.ndarray]:
    """The gradients row; returns the Flax gradients (the updates check applies them)."""
    t = tolerance("gradients", p, tolerances)
    _, tgrads = training.torch_param_grads(tm, torch_loss, batch, p)
    _, fgrads = training.flax_param_grads(fm, flax_loss, batch, p)
    mapped = training.to_flax_params(mapping, tgrads)
    value, where = worst(scaled_diffs(fgrads, mapped))
    if row:
        report.rows.append(Row("gradients, every tensor", p, value, t.value, t.reason + SCALE, where))
        report.rows.append(
            Row(
                "gradients, whole tree",
                p,
                whole_rel_diff(fgrads, mapped),
                t.value,
                t.reason + "; every tensor as one vector",
            )
        )
    return fgrads


def _trajectory(
    report: Report,
    tr: training.Trajectory,
    p: str,
    n: int,
    runs: dict[str, training.Trajectory],
    tolerances: dict | None,
) -> None:
    t = tolerance("trajectory", p, tolerances)
    value, reason = t.value, t.reason
    measured = p == "fp32" and "fp64" in runs and (tolerances is None or ("trajectory", "fp32") not in tolerances)
    if measured:
        # the measured bound: a framework's own float32-to-float64 gap over the same run, times 4
        own = max(
            curve_rel_diff(tr.torch_losses, runs["fp64"].torch_losses),
            curve_rel_diff(tr.flax_losses, runs["fp64"].flax_losses),
        )
        value = max(4 * own, 1e-6)
        reason = (
            f"4 x the larger own float32-vs-float64 gap of the loss curve ({own:.1e}, both frameworks "
            "measured in this check): float32 rounding compounds alike in both"
        )
    report.rows.append(
        Row(
            f"trajectory ({n} updates): loss of every update",
            p,
            curve_rel_diff(tr.flax_losses, tr.torch_losses),
            value,
            reason,
        )
    )
    pv, pr = t.value, t.reason
    if measured:
        own = max(_own_param_gap(tr, runs["fp64"], "torch"), _own_param_gap(tr, runs["fp64"], "flax"))
        pv = max(4 * own, 1e-6)
        pr = f"4 x the larger own float32-vs-float64 gap of the params ({own:.1e}), as for the loss"
    report.rows.append(
        Row(
            f"trajectory ({n} updates): params after every update",
            p,
            float(np.max(tr.param_diffs)),
            pv,
            pr + SCALE,
            tr.worst_tensor,
        )
    )
    report.rows.append(
        Row(
            f"trajectory ({n} updates): params after every update, whole tree",
            p,
            float(np.max(tr.whole_diffs)),
            pv,
            pr + "; every tensor as one vector",
        )
    )
    if measured:  # the measured bound must follow the model's chaos, not a Flax side of its own
        torch_own, flax_own = (
            max(
                curve_rel_diff(getattr(tr, f"{side}_losses"), getattr(runs["fp64"], f"{side}_losses")),
                _own_param_gap(tr, runs["fp64"], side),
            )
            for side in ("torch", "flax")
        )
        floor = tolerance("trajectory", "fp32").value / 4
        report.rows.append(
            Row(
                f"trajectory ({n} updates): Flax's own float32-vs-float64 gap",
                p,
                flax_own,
                max(floor, OWN_GAP_RATIO * torch_own),
                OWN_GAP_REASON.format(floor=floor, ratio=OWN_GAP_RATIO, torch=torch_own),
            )
        )
    if tr.buffer_diff is not None:
        report.rows.append(Row(f"trajectory ({n} updates): buffers at the end", p, tr.buffer_diff, pv, pr))
    report.curves[p] = {"torch_losses": tr.torch_losses, "flax_losses": tr.flax_losses, "param_diffs": tr.param_diffs}


# How far the Flax side's own float32 run may depart from its float64 run, against torch's departure: float32
# rounding compounds alike in both frameworks, so their own gaps are alike in a correct port (docs/porting.md
# measures them at 30, 100 and 300 updates), however chaotic the model's training is.
OWN_GAP_RATIO = 4
OWN_GAP_REASON = (
    "the bounds above are measured, so the Flax side's own float32-vs-float64 gap must itself be "
    "explained: at most {floor:g} or {ratio} x torch's own gap ({torch:.1e}), the model's and optimizer's "
    "float32 chaos, alike in both frameworks; a Flax side that departs alone (a layer computing below "
    "float32) would widen the bound to pass anything. The float64 trajectory judges the port either way"
)


def _own_param_gap(a: training.Trajectory, b: training.Trajectory, side: str) -> float:
    x, y = (a.torch_params, b.torch_params) if side == "torch" else (a.flax_params, b.flax_params)
    return worst(scaled_diffs(x, y))[0]


def _rel(a: float, b: float) -> float:
    return rel_diff(np.asarray([a]), np.asarray([b]))
