"""The comparison, or a sweep over request rates, as a terminal table or as JSON."""

from __future__ import annotations

import json
import math
import textwrap

from pagedkv.simulate.metrics import MEMORY_PARTS
from pagedkv.simulate.simulation import SimulationResult
from pagedkv.simulate.sweep import RateRatio, Sustained, SweepResult

LEGEND = (
    "; ".join(f"{p.label}: {p.definition}" for p in MEMORY_PARTS)
    + ". Shares of the KV memory, averaged per step until the last request was admitted "
    "(--include-drain counts the drain after it). tokens/held: token states over held memory. "
    "tok/s: estimated decode throughput, tokens generated per second when each step reads the "
    "weights and the batch's KV once at the achieved memory bandwidth."
)


def _header(result: SimulationResult, arrivals: str) -> list[str]:
    """The trace, model, memory and step-time lines above a table."""
    c = result.config
    trace = result.trace
    prompt = sum(r.prompt_len for r in trace) / len(trace)
    output = sum(r.output_len for r in trace) / len(trace)
    width = ""
    if c.n > 1:
        width = f", n={c.n} parallel samples"
    elif c.beam_width > 1:
        width = f", beam width {c.beam_width}"
    trace_line = (
        f"trace {result.trace_name}: {len(trace)} requests, mean prompt {prompt:.1f}, "
        f"mean output {output:.1f} tokens, {arrivals}{width}"
    )
    model_line = (
        f"model {c.model.name} ({c.model.kv_bytes_per_token / 1024:g} KiB KV per token) on "
        f"{c.num_gpus} x {c.gpu.name}; KV memory {c.kv_memory / 1e9:.2f} GB = "
        f"{c.capacity:,} token slots ({c.num_blocks:,} blocks of {c.block_size}); "
        f"max length {c.max_len}"
    )
    if any(key != "paged" for key in c.systems):
        model_line += f"; contiguous regions placed by {c.allocator} allocation"
    t = c.timing
    timing_line = (
        f"step time: decode reads at {t.bandwidth_fraction:.1%} of {t.bandwidth / 1e12:.4g} TB/s, "
        f"prefill computes at {t.flop_fraction:.1%} of {t.flops / 1e12:g} TFLOP/s"
    )
    return [trace_line, model_line, timing_line]


def _aligned(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A header, a rule and the rows: the first column left-aligned, the others right."""
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    return [line(columns), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_table(result: SimulationResult) -> str:
    """A fixed-width table, one row per system, with the settings above and a legend below."""
    columns = ["system", *(p.label for p in MEMORY_PARTS), "tokens/held"]
    columns += ["mean seqs", "peak seqs", "tok/s", "preempted"]
    rows = []
    for m in result.systems:
        rows.append(
            [
                m.name,
                *(f"{m.share(p):.1%}" for p in MEMORY_PARTS),
                f"{m.held_token_share:.1%}",
                f"{m.mean_seqs:.2f}",
                f"{m.peak_seqs}",
                f"{m.throughput:,.0f}",
                f"{m.preemptions}",
            ]
        )
    last = result.trace[-1].arrival
    arrivals = "all arriving at t=0" if last == 0 else f"arriving over {last:.1f} s"
    out = [*_header(result, arrivals), "", *_aligned(columns, rows)]
    if result.config.width > 1 or any(r.prefix_id is not None for r in result.trace):
        for key, m in zip(result.config.systems, result.systems, strict=True):
            if key == "paged":
                out.append(
                    f"{m.name}: sharing blocks (fork, prefix cache) saved "
                    f"{m.sharing_saving:.1%} of the memory its sequences would hold unshared"
                )
    out += ["", *textwrap.wrap(LEGEND, width=100)]
    return "\n".join(out)


def _sustained(s: Sustained) -> str:
    if s.rate is None:
        return "none"
    return f">= {s.rate:g}" if s.censored else f"{s.rate:g}"


def _ratio(r: RateRatio) -> str:
    if r.ratio is None:
        return f"{r.system} / {r.baseline}: undefined (a system is over the bound at every rate)"
    return f"{r.system} / {r.baseline}: {'>= ' if r.at_least else ''}{r.ratio:.2f}x"


def format_sweep_table(result: SweepResult) -> str:
    """Latency and mean batch per rate and system, then sustainable rates and their ratios."""
    names = result.names
    latency_rows = [
        [f"{rate:g}", *(f"{p.systems[i].mean_latency_per_token:.3f}" for i in range(len(names)))]
        for rate, p in zip(result.rates, result.points, strict=True)
    ]
    batch_rows = [
        [f"{rate:g}", *(f"{p.systems[i].mean_seqs:.2f}" for i in range(len(names)))]
        for rate, p in zip(result.rates, result.points, strict=True)
    ]
    arrivals = f"Poisson arrivals at {len(result.rates)} rates (seed {result.config.seed})"
    bound = result.latency_bound
    out = [*_header(result.points[0], arrivals), ""]
    out += ["normalized latency (s per output token, mean over requests)"]
    out += _aligned(["req/s", *names], latency_rows)
    out += ["", "mean batch (running sequences per step)"]
    out += _aligned(["req/s", *names], batch_rows)
    out += ["", f"sustainable rate (req/s) with latency within {bound:g} s/token:"]
    out += [f"  {name}: {_sustained(result.sustained(i))}" for i, name in enumerate(names)]
    ratios = result.ratios()
    if ratios:
        out += ["ratios of sustainable rates (as fine as the grid of rates):"]
        out += [f"  {_ratio(r)}" for r in ratios]
    return "\n".join(out)


def _finite(value: object) -> object:
    """JSON has no inf or nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def format_json(result: SimulationResult | SweepResult) -> str:
    """The settings, trace summary and per-system metrics (per rate for a sweep) as JSON."""
    return json.dumps(_finite(result.as_dict()), indent=2)
