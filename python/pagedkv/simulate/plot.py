"""The comparison as a PNG: memory composition per system and token states over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and no GUI backend to pick up

import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt

from pagedkv.simulate.simulation import SimulationResult

_PARTS = (
    ("token states", "token_share", "#2a9d8f"),
    ("reserved", "reserved_share", "#e9c46a"),
    ("internal fragmentation", "internal_share", "#f4a261"),
    ("external fragmentation / unused", "external_share", "#adb5bd"),
)
_POINTS = 300  # per line: each point is the mean of a run of steps, so the curves stay legible


def _binned(series: npt.NDArray[np.int64] | npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Means of up to _POINTS consecutive runs of steps."""
    bins = np.array_split(series.astype(np.float64), min(_POINTS, len(series)))
    return np.array([b.mean() for b in bins])


def write_plot(result: SimulationResult, path: Path) -> None:
    """Save the figure to `path` (PNG)."""
    systems = result.systems
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(1, 1.3))
    y = np.arange(len(systems))[::-1]
    left = np.zeros(len(systems))
    for label, attr, color in _PARTS:
        share = np.array([100 * getattr(m, attr) for m in systems])
        bars.barh(y, share, left=left, color=color, label=label)
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
    c = result.config
    fig.suptitle(
        f"{result.trace_name}, {c.model.name}, {c.kv_memory / 1e9:.1f} GB KV memory, "
        f"block {c.block_size}"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)
