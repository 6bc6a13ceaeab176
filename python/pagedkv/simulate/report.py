"""The comparison as a terminal table or as JSON."""

from __future__ import annotations

import json
import math
import textwrap

from pagedkv.simulate.simulation import SimulationResult

LEGEND = (
    "tokens: KV of stored tokens; reserved: held for a request's future tokens; internal: "
    "held but never to be filled; external: held by no request (gaps, free or cached blocks). "
    "Shares of the KV memory, averaged per step until the last request was admitted "
    "(--include-drain counts the drain after it). tokens/held: token states over held memory. "
    "tok/s: estimated decode throughput, tokens generated per second when each step reads the "
    "weights and the batch's KV once at full memory bandwidth."
)


def _header(result: SimulationResult) -> list[str]:
    c = result.config
    trace = result.trace
    prompt = sum(r.prompt_len for r in trace) / len(trace)
    output = sum(r.output_len for r in trace) / len(trace)
    last = trace[-1].arrival
    arrivals = "all arriving at t=0" if last == 0 else f"arriving over {last:.1f} s"
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
    return [trace_line, model_line]


def format_table(result: SimulationResult) -> str:
    """A fixed-width table, one row per system, with the settings above and a legend below."""
    columns = ["system", "tokens", "reserved", "internal", "external", "tokens/held"]
    columns += ["mean seqs", "peak seqs", "tok/s", "preempted"]
    rows = []
    for m in result.systems:
        rows.append(
            [
                m.name,
                f"{m.token_share:.1%}",
                f"{m.reserved_share:.1%}",
                f"{m.internal_share:.1%}",
                f"{m.external_share:.1%}",
                f"{m.held_token_share:.1%}",
                f"{m.mean_seqs:.2f}",
                f"{m.peak_seqs}",
                f"{m.throughput:,.0f}",
                f"{m.preemptions}",
            ]
        )
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    out = [*_header(result), "", line(columns), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    if result.config.width > 1 or any(r.prefix_id is not None for r in result.trace):
        for key, m in zip(result.config.systems, result.systems, strict=True):
            if key == "paged":
                out.append(
                    f"{m.name}: sharing blocks (fork, prefix cache) saved "
                    f"{m.sharing_saving:.1%} of the memory its sequences would hold unshared"
                )
    out += ["", *textwrap.wrap(LEGEND, width=100)]
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


def format_json(result: SimulationResult) -> str:
    """The settings, trace summary and per-system metrics as indented JSON."""
    return json.dumps(_finite(result.as_dict()), indent=2)
