"""Plots as PNG: a comparison's memory composition and token states over time, or a sweep's
latency and batch size against request rate (the vLLM paper's Fig. 12)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and no GUI backend to pick up

import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt
from matplotlib.figure import Figure

from pagedkv.simulate.metrics import MEMORY_PARTS
from pagedkv.simulate.simulation import SimulationResult
from pagedkv.simulate.sweep import SweepResult

_COLORS = ("#2a9d8f", "#e9c46a", "#f4a261", "#adb5bd")  # one per memory part, in order
_POINTS = 300  # per line: each point is the mean of a run of steps, so the curves stay legible


def _binned(series: npt.NDArray[np.int64] | npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Means of up to _POINTS consecutive runs of steps."""
    bins = np.array_split(series.astype(np.float64), min(_POINTS, len(series)))
    return np.array([b.mean() for b in bins])


def write_plot(result: SimulationResult | SweepResult, path: Path) -> None:
    """Save the figure for `result` to `path` (PNG)."""
    fig = _memory_figure(result) if isinstance(result, SimulationResult) else _sweep_figure(result)
    try:
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)


def _title(result: SimulationResult) -> str:
    c = result.config
    return (
        f"{result.trace_name}, {c.model.name}, {c.kv_memory / 1e9:.1f} GB KV memory, "
        f"block {c.block_size}"
    )


def _memory_figure(result: SimulationResult) -> Figure:
    """Composition bars per system, and token states and held memory over time."""
    systems = result.systems
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(1, 1.3))
    y = np.arange(len(systems))[::-1]
    left = np.zeros(len(systems))
    for part, color in zip(MEMORY_PARTS, _COLORS, strict=True):
        share = np.array([100 * m.share(part) for m in systems])
        bars.barh(y, share, left=left, color=color, label=part.title)
        left += share
    bars.set_yticks(y, [m.name for m in systems])
    bars.set_xlim(0, 100)
    bars.set_xlabel("share of KV memory (%), mean per step")
    bars.set_title("Where the KV memory goes")
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small")

    capacity = result.config.capacity
    for m in systems:
        t = _binned(m.series_time)
        (line,) = lines.plot(t, 100 * _binned(m.series_token) / capacity, label=m.name)
        lines.plot(t, 100 * _binned(m.series_held) / capacity, color=line.get_color(), ls=":")
    lines.set_ylim(0, 105)
    lines.set_xlabel("simulated time (s)")
    lines.set_ylabel("% of KV memory")
    lines.set_title("Token states (solid) and held memory (dotted), binned means")
    lines.legend(fontsize="small")
    fig.suptitle(_title(result))
    fig.tight_layout()
    return fig


def _sweep_figure(result: SweepResult) -> Figure:
    """Normalized latency against rate (clipped, as in Fig. 12), and mean batch against rate."""
    fig, (latency, batch) = plt.subplots(1, 2, figsize=(13, 4.8))
    bound = result.latency_bound
    top = 0.0
    for i, name in enumerate(result.names):
        values = result.latencies(i)
        latency.plot(result.rates, values, marker="o", ms=3, label=name)
        batch.plot(result.rates, result.mean_seqs(i), marker="o", ms=3, label=name)
        top = max(top, *values)
    latency.axhline(bound, color="black", ls="--", lw=0.8, label=f"bound {bound:g} s/token")
    latency.set_ylim(0, min(top * 1.05, 5 * bound))  # past the knee, latency only climbs
    latency.set_xlabel("request rate (req/s)")
    latency.set_ylabel("normalized latency (s/token)")
    latency.set_title("Latency per output token (mean over requests)")
    latency.legend(fontsize="small")
    batch.set_xlabel("request rate (req/s)")
    batch.set_ylabel("running sequences per step (mean)")
    batch.set_title("Batch size")
    batch.legend(fontsize="small")
    t = result.config.timing
    fig.suptitle(
        f"{_title(result.points[0])}; decode at {t.bandwidth_fraction:.0%} of peak bandwidth"
    )
    fig.tight_layout()
    return fig
