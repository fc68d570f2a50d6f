"""The port check's report: one row per check (measured difference, tolerance and why, pass/fail), the
weight mapping, the first diverging layer with its diagnoses; as text, markdown and plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from jaxloop.parity.layers import Divergence, LayerDiff
from jaxloop.parity.weights import Mapping


@dataclass
class Row:
    check: str
    precision: str
    measured: float
    tolerance: float
    reason: str
    where: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.measured <= self.tolerance)  # NaN fails


@dataclass
class Report:
    name: str = ""
    rows: list[Row] = field(default_factory=list)
    mapping: Mapping | None = None
    divergences: dict[str, Divergence] = field(default_factory=dict)
    """'fp64 eval' -> the first diverging layer of that forward pass."""
    notes: list[str] = field(default_factory=list)
    layers: dict[str, list[LayerDiff]] = field(default_factory=dict)
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)
    """precision -> {torch_losses, flax_losses, param_diffs} of the trajectory."""
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def table(self) -> str:
        head = ("check", "prec", "measured", "tolerance", "ok", "worst at", "why this tolerance")
        rows = [head] + [
            (r.check, r.precision, _num(r.measured), _num(r.tolerance), "yes" if r.passed else "NO", r.where, r.reason)
            for r in self.rows
        ]
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(head) - 1)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 18)
        return "\n".join(lines)

    def summary(self) -> str:
        n, bad = len(self.rows), len(self.failures())
        return f"{self.name + ': ' if self.name else ''}{n - bad} of {n} checks within tolerance" + (
            "" if bad == 0 else f"; {bad} failed"
        )

    def text(self, mapping: bool = True) -> str:
        parts = []
        if mapping and self.mapping is not None:
            parts += ["weight mapping (torch state_dict -> Flax):", self.mapping.table(), ""]
        parts += [self.table(), ""]
        for key, div in self.divergences.items():
            parts += [f"[{key}] {div.describe()}", ""]
        parts += [f"note: {n}" for n in self.notes]
        parts.append(self.summary())
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.text(mapping=False)

    def assert_ok(self) -> None:
        """Raise AssertionError naming every failed check and the first diverging layer (for a test)."""
        if self.ok:
            return
        lines = [
            f"{r.check} ({r.precision}): {_num(r.measured)} > {_num(r.tolerance)}"
            + (f" at {r.where}" if r.where else "")
            for r in self.failures()
        ] or ["no checks ran"]
        lines += [f"[{k}] {d.describe()}" for k, d in self.divergences.items()]
        raise AssertionError("the port differs:\n" + "\n".join(lines))

    def markdown(self) -> str:
        out = [f"# Port check{': ' + self.name if self.name else ''}", "", self.summary() + ".", ""]
        if self.settings:
            out += ["Settings while checking: " + "; ".join(f"{k}: {v}" for k, v in self.settings.items()) + ".", ""]
        out += [
            "| check | precision | measured | tolerance | ok | worst at | why this tolerance |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            out.append(
                f"| {r.check} | {r.precision} | {_num(r.measured)} | {_num(r.tolerance)} | "
                f"{'yes' if r.passed else '**NO**'} | {r.where} | {r.reason} |"
            )
        for key, div in self.divergences.items():
            out += ["", f"## First divergence ({key})", "", "```", div.describe(), "```"]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.mapping is not None:
            out += ["", "## Weight mapping", "", "```", self.mapping.table(), "```"]
        return "\n".join(out) + "\n"

    def write_markdown(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.markdown())
        return path

    def plot(self, directory: str | Path) -> list[Path]:
        """PNGs: the relative difference of every paired layer's output (execution order, log scale, the
        tolerance dashed), and the trajectory's losses with their relative difference per update."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        if self.layers:
            fig, ax = plt.subplots(figsize=(9, 4))
            for key, diffs in self.layers.items():
                ys = [max(d.out_diff, 1e-18) if not math.isnan(d.out_diff) else 1e3 for d in diffs]
                ax.semilogy(range(len(ys)), ys, marker="o", ms=3, label=key)
                precision, mode = key.split()
                tol = next(
                    (
                        r.tolerance
                        for r in self.rows
                        if r.check.startswith(f"forward ({mode}): every paired layer") and r.precision == precision
                    ),
                    None,
                )
                if tol is not None and mode == "eval":
                    ax.axhline(tol, ls="--", lw=0.8, color=ax.lines[-1].get_color(), label=f"tolerance {precision}")
            ax.set_xlabel("paired module, in torch's completion order")
            # the default locator (an AutoLocator) is a MaxNLocator; matplotlib's stub types it as a plain Locator
            cast(MaxNLocator, ax.xaxis.get_major_locator()).set_params(integer=True)
            ax.set_ylabel("relative difference of the output")
            ax.set_title("Flax port against torch, layer by layer")
            ax.legend()
            fig.tight_layout()
            written.append(directory / "layers.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
        if self.curves:
            fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
            for p, c in self.curves.items():
                a.plot(c["torch_losses"], label=f"torch {p}")
                a.plot(c["flax_losses"], ls="--", label=f"jaxloop {p}")
                b.semilogy(np.maximum(c["param_diffs"], 1e-18), label=f"params {p}")
                t, f = np.asarray(c["torch_losses"]), np.asarray(c["flax_losses"])
                b.semilogy(np.maximum(np.abs(f - t) / np.abs(t), 1e-18), ls="--", label=f"loss {p}")
            a.set_xlabel("update")
            a.set_ylabel("loss")
            a.legend()
            b.set_xlabel("update")
            b.set_ylabel("relative difference")
            b.legend()
            fig.tight_layout()
            written.append(directory / "trajectory.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
        return written


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"
