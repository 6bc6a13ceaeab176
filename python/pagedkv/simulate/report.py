"""The comparison, or a sweep over request rates, as a terminal table or as JSON."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np

from pagedkv.simulate.metrics import MEMORY_PARTS, SystemMetrics
from pagedkv.simulate.simulation import SimulationResult
from pagedkv.simulate.sweep import RateRatio, Sustained, SweepResult
from pagedkv.simulate.trace import final_histories

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
    if any(key not in ("paged", "hybrid") for key in c.systems):
        model_line += f"; contiguous regions placed by {c.allocator} allocation"
    if c.model.has_state:
        model_line += " (the hybrid system's pages and state slots share it: see below)"
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
    if any(r.think is not None for r in result.trace):
        start = "starting at t=0" if last == 0 else f"starting over {last:.1f} s"
        arrivals = f"conversations {start}, each turn a think time after the previous one"
    out = [*_header(result, arrivals), "", *_aligned(columns, rows)]
    shared = any(r.prefix_id is not None or r.conversation is not None for r in result.trace)
    if result.config.width > 1 or shared:
        for key, m in zip(result.config.systems, result.systems, strict=True):
            if key in ("paged", "hybrid"):
                out.append(
                    f"{m.name}: sharing blocks (fork, prefix cache) saved "
                    f"{m.sharing_saving:.1%} of the memory its sequences would hold unshared"
                )
    if shared:
        out += ["", *_prefix_lines(result)]
    if result.config.model.is_hybrid or result.config.model.has_state:
        out += ["", *_hybrid_lines(result)]
    if result.config.model.has_state:
        out += ["", *_state_lines(result)]
    out += ["", *textwrap.wrap(LEGEND, width=100)]
    return "\n".join(out)


def _metrics(result: SimulationResult, key: str) -> SystemMetrics | None:
    if key not in result.config.systems:
        return None
    return result.systems[result.config.systems.index(key)]


def _hybrid_lines(result: SimulationResult) -> list[str]:
    """The groups, the exact-needs bound and the hybrid system's ratios."""
    model = result.config.model
    groups = result.config.groups()
    names = [
        a.kind.replace("_", " ")
        + (f" {a.window}" if a.window is not None else f" {a.chunk}" if a.chunk else "")
        for a in groups.attention
    ]
    kinds = ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names))
    page = groups.layers_per_group * result.config.block_size * model.layer_bytes_per_token
    out = [
        f"hybrid groups: {groups.num_groups} groups of {groups.layers_per_group} layers "
        f"({kinds}); {groups.padding_layers} padding slots; pages of {page / 2**20:.3g} MiB",
        f"prefill in chunks of {result.config.prefill_chunk} tokens in the hybrid system "
        f"(the {'full-attention' if model.has_state else 'uniform'} one holds every block of "
        "every layer anyway)",
    ]
    out += textwrap.wrap(
        "bound: the mean batch if every running sequence held exactly what its layers' "
        "queries can still read (full attention: every token; sliding window W: min(len, "
        "W + block) tokens; chunked C: the current chunk; a recurrent model: its state), with "
        "no pages and no padding: per step, running sequences x KV memory / their needs.",
        width=100,
    )
    hybrid, uniform = _metrics(result, "hybrid"), _metrics(result, "paged")
    if hybrid is not None:
        out.append(
            f"  hybrid: mean batch {hybrid.mean_seqs:.2f}, bound {hybrid.bound_seqs:.2f}: "
            f"{hybrid.mean_seqs / hybrid.bound_seqs:.1%} of the bound"
        )
    if hybrid is not None and uniform is not None and uniform.mean_seqs > 0:
        baseline = "full-attention" if model.has_state else "uniform"
        out.append(
            f"  hybrid / {baseline} paged mean batch, same KV memory: "
            f"{hybrid.mean_seqs / uniform.mean_seqs:.2f}x ({hybrid.mean_seqs:.2f} / "
            f"{uniform.mean_seqs:.2f})"
        )
    return out


def _state_lines(result: SimulationResult) -> list[str]:
    """The state group's split of the memory, its checkpoint policy and counters, and the
    hybrid system's prefix hit rate against the model with full attention everywhere."""
    c = result.config
    model = c.model
    slots = c.num_state_slots
    config = c.state_config()
    budget = config.max_checkpoints if config is not None else 0
    state_memory = slots * model.state_bytes
    full = c.system_model("paged")
    out = textwrap.wrap(
        f"state group: {model.num_state_layers} recurrent layers, {model.state_bytes / 2**20:.4g}"
        f" MiB of state per sequence (= {model.state_token_slots:,.0f} token slots of KV); "
        f"{slots} state slots take {state_memory / 1e9:.2f} GB ({c.state_memory:g} of the "
        f"memory, --state-memory), the pages the rest; each live sequence holds one, "
        f"checkpoints at most {budget} (any slot no live sequence holds; admissions evict "
        f"them); checkpoints at prompt ends, branch points and "
        + (f"every {c.interval} tokens" if c.interval else "no interval")
        + f" (the last {c.checkpoints_per_sequence} of a sequence kept, branch points aside)",
        width=100,
    )
    out.append(
        f"full-attention paged: the same model with its {model.num_state_layers} recurrent "
        f"layers as full attention ({full.kv_bytes_per_token / 1024:g} KiB KV per token) in "
        "the same memory"
    )
    hybrid, paged = _metrics(result, "hybrid"), _metrics(result, "paged")
    state = hybrid.state if hybrid is not None else None
    if state is not None:
        out += [
            f"  checkpoints held: mean {state.mean_checkpoints:.1f}, peak "
            f"{state.peak_checkpoints} of {state.max_checkpoints}; saved {state.saved:,}, "
            f"evicted {state.evictions:,}, dropped {state.dropped:,}, skipped {state.skipped:,}",
            f"  state copies: {state.decode_saves:,} checkpoint saves in decode, "
            f"{state.saves_per_decode_token:.4f} per decode token; {state.hit_copies:,} hits "
            "copied a checkpoint into a working slot",
            f"  prompt tokens the checkpoints alone could serve {state.allowed_tokens:,}; "
            f"served by every group {state.hit_tokens:,}",
        ]
    if hybrid is not None and hybrid.prefix is not None:
        p = hybrid.prefix
        group = p.hit_tokens / p.full_group_tokens if p.full_group_tokens else 1.0
        out.append(
            f"  hybrid hits / its full-attention layers' cached prefixes: {group:.1%} "
            f"({p.hit_rate:.1%} / {p.full_group_rate:.1%} of prompt tokens)"
        )
        if paged is not None and paged.prefix is not None and paged.prefix.hit_tokens:
            rate = paged.prefix.hit_rate
            out.append(
                f"  hybrid hit rate / full attention everywhere: {p.hit_rate / rate:.1%} "
                f"({p.hit_rate:.1%} / {rate:.1%} of prompt tokens)"
            )
    return out


def _prefix_lines(result: SimulationResult) -> list[str]:
    """Prefix hits of the paged systems, against what their full-attention layers had."""
    out = []
    histories = final_histories(result.trace)
    if histories:
        c = result.config
        lengths = np.asarray(histories, dtype=np.int64)
        needed = c.model.needed_slots(lengths, c.block_size)
        out.append(
            f"conversations' histories at their last turn: {int(lengths.sum()):,} tokens in "
            f"{len(histories)} conversations; the KV memory holds {c.capacity / needed:.2f}x "
            f"their exact needs ({c.capacity / lengths.sum():.2f}x their tokens in every layer)"
        )
    for m in result.systems:
        if m.prefix is None:
            continue
        p = m.prefix
        ratio = p.hit_tokens / p.full_group_tokens if p.full_group_tokens else 1.0
        out.append(
            f"{m.name}: prefix hits {p.hit_rate:.1%} of prompt tokens; its full-attention "
            f"layers alone had {p.full_group_rate:.1%} cached: hits are {ratio:.1%} of that"
        )
    return out


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
