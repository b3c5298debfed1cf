"""The demo's picture: where a training step's memory goes, per configuration and within the step.

Left: one stacked bar per configuration (parameters / gradients / optimizer state / activations /
other, at the step's peak). Right: the live bytes *within* one training step (forward -> backward ->
optimizer) for the baseline and the low-memory stack, so the reader sees where the saving happens.
Needs matplotlib (``pip install "lightning-lowmem[examples]"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from lightning_lowmem.memory import CATEGORIES, PHASES

COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "other": "#B0B0B0",
}
LABELS = {"optimizer_state": "optimizer state", "other": "other (inputs, temporaries)"}
MIB = 2**20


def _phase_positions(timeline: Sequence[tuple[str, int]]) -> list[float]:
    """x of each event: phase k's events spread evenly over [k, k + 1), so runs with different event
    counts line up phase by phase."""
    counts = {phase: sum(1 for p, _ in timeline if p == phase) for phase in PHASES}
    seen = dict.fromkeys(PHASES, 0)
    xs = []
    for phase, _ in timeline:
        index = PHASES.index(phase) if phase in PHASES else 0
        xs.append(index + (seen[phase] + 0.5) / max(counts[phase], 1))
        seen[phase] += 1
    return xs


def _bars(ax: Any, runs: Sequence[Any]) -> None:
    names = [run.label or run.name for run in runs]
    base = runs[0].peak_bytes or 1
    ax.set_xlim(0, max((run.peak_bytes or 0) for run in runs) / MIB * 1.35)
    for row, run in enumerate(runs):
        left = 0.0
        for category in CATEGORIES:
            width = run.breakdown.get(category, 0) / MIB
            ax.barh(
                row,
                width,
                left=left,
                color=COLORS[category],
                edgecolor="white",
                linewidth=0.5,
                label=LABELS.get(category, category) if row == 0 else None,
            )
            left += width
        peak = (run.peak_bytes or 0) / MIB
        ratio = "" if row == 0 else f"  ({run.peak_bytes / base:.2f}x)"
        ax.text(left + 0.01 * ax.get_xlim()[1], row, f"{peak:.1f} MiB{ratio}", va="center", fontsize=9)
    ax.set_yticks(range(len(runs)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the step's peak")
    ax.set_title("Where a training step's memory goes", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _timeline(ax: Any, runs: Sequence[Any]) -> None:
    colors = ["#4C72B0", "#C44E52", "#55A868", "#8172B2"]
    top = max(max(max(b for _, b in run.timeline), run.peak_bytes or 0) for run in runs) / MIB
    for index, phase in enumerate(PHASES):
        ax.axvspan(index, index + 1, color="#f2f2f2" if index % 2 == 0 else "white", zorder=0)
        ax.text(index + 0.5, top * 1.12, phase, ha="center", va="bottom", fontsize=10, color="#555555")
    for run, color in zip(runs, colors, strict=False):
        xs = _phase_positions(run.timeline)
        ys = [b / MIB for _, b in run.timeline]
        ax.plot(xs, ys, color=color, linewidth=1.8, label=run.label or run.name, zorder=3)
        ax.fill_between(xs, ys, color=color, alpha=0.12, zorder=2)
        if run is runs[0] and len(runs) > 1:  # the baseline's hill: what the stack does not keep
            top_x = xs[max(range(len(ys)), key=ys.__getitem__)]
            ax.annotate(
                "activations kept\nfor backward",
                (top_x, max(ys) * 0.6),
                xytext=(top_x - 0.45, max(ys) * 0.3),
                fontsize=8.5,
                color="#444444",
                ha="center",
                arrowprops=dict(arrowstyle="->", color="#888888"),
            )
        # the exact peak of the step (temporaries inside one op included) from the memory report
        peak = (run.peak_bytes or 0) / MIB
        ax.axhline(peak, color=color, linestyle=":", linewidth=1, zorder=1)
        ax.text(len(PHASES) - 0.02, peak, f"peak {peak:.1f} MiB", ha="right", va="bottom", fontsize=9, color=color)
    ax.set_xlim(0, len(PHASES))
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks([])
    ax.set_xlabel("one training step, event by event (module forwards, gradients, optimizer steps)", fontsize=9)
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title("Live memory within one training step", fontsize=11, pad=4)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=2, fontsize=9, frameon=False)


def plot_memory(runs: Sequence[Any], path: Path, title: str = "", traced: Sequence[Any] | None = None) -> Path | None:
    """Draw the breakdown bars of ``runs`` and the within-step timelines of ``traced`` (default: the
    first and the last run that has one: the baseline and the stack); returns ``path``, or ``None``
    when no run has figures.

    ``runs`` are ``DemoRun``-like: ``name``, ``label``, ``peak_bytes``, ``breakdown``, ``timeline``.
    """
    measured = [run for run in runs if run.peak_bytes and run.breakdown]
    if not measured:
        return None
    from lightning_lowmem._versions import optional_import

    optional_import("matplotlib", "the demo's plots", extra="examples").use("Agg")
    import matplotlib.pyplot as plt

    if traced is None:
        traced = [run for run in measured if run.timeline]
        traced = [traced[0], traced[-1]] if len(traced) > 1 else traced
    traced = [run for run in traced if run.timeline]
    fig, axes = plt.subplots(
        1,
        2 if traced else 1,
        figsize=(13, 4.8) if traced else (7, 4.8),
        gridspec_kw={"width_ratios": [1, 1.1]} if traced else None,
        squeeze=False,
    )
    _bars(axes[0][0], measured)
    axes[0][0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8, frameon=False)
    if traced:
        _timeline(axes[0][1], traced)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
