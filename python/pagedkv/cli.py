"""The `pagedkv` command line: `pagedkv simulate` compares paged and contiguous KV memory."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

if TYPE_CHECKING:
    from pagedkv.events import KVEventPublisher
    from pagedkv.simulate.simulation import SimulationConfig
    from pagedkv.simulate.trace import Request

T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _checked(
    convert: Callable[[str], T], ok: Callable[[T], bool], expected: str
) -> Callable[[str], T]:
    """An argparse type: `convert(text)`, refused with "expected ..." unless `ok` holds."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_seed = _checked(int, lambda v: v >= 0, "a non-negative integer")
_rate = _checked(float, lambda v: v > 0, "a positive rate or 'inf'")  # nan fails too
_fraction = _checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
_seconds = _checked(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
_finite_rate = _checked(float, lambda v: 0 < v < math.inf, "a positive finite rate")
_MAX_SWEEP_RATES = 200


def parse_rates(text: str) -> list[float]:
    """Ascending request rates from `START:STOP:STEP` (STOP included) or a list `1,2,4`."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"expected START:STOP:STEP, got {text!r}")
        start, stop, step = (_finite_rate(p) for p in parts)
        if stop < start:
            raise argparse.ArgumentTypeError(f"STOP is below START in {text!r}")
        count = math.floor((stop - start) / step + 1e-9) + 1
        if count > _MAX_SWEEP_RATES:
            raise argparse.ArgumentTypeError(
                f"{text!r} makes {count} rates, more than {_MAX_SWEEP_RATES}: raise STEP"
            )
        return [round(start + i * step, 12) for i in range(count)]
    rates = sorted({_finite_rate(p) for p in text.split(",") if p.strip()})
    if not rates:
        raise argparse.ArgumentTypeError("no rate given")
    if len(rates) > _MAX_SWEEP_RATES:
        raise argparse.ArgumentTypeError(f"more than {_MAX_SWEEP_RATES} rates")
    return rates


# Token slots one block manager addresses: slot ids are int32.
_MAX_SLOTS = 2**31 - 1

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a size such as `12GB`, `12 GiB`, `1.5e10` (GB = 10**9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 12GB or 12GiB, got {text!r}")
    number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"size {text!r} is too large")
    value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def _named(table: Mapping[str, T], what: str) -> Callable[[str], str]:
    """An argparse type that accepts a key of `table`, case-insensitively."""
    by_lower = {k.lower(): k for k in table}

    def parse(text: str) -> str:
        key = by_lower.get(text.lower())
        if key is None:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r} (choose from {', '.join(table)})"
            )
        return key

    return parse


def _systems(text: str) -> tuple[str, ...]:
    """Comma-separated system keys; SimulationConfig checks them."""
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _simulate_epilog() -> str:
    from pagedkv.simulate.metrics import MEMORY_PARTS
    from pagedkv.simulate.presets import CHAT_TRACES, GPUS, MODELS, TRACES, UNIFORM_TRACES
    from pagedkv.simulate.timing import (
        DECODE_BANDWIDTH_FRACTION,
        DECODE_BANDWIDTH_SOURCE,
        PREFILL_FLOP_FRACTION,
        PREFILL_FLOP_SOURCE,
    )

    lines = ["trace presets (synthetic, seeded, with these mean lengths in tokens):"]
    for t in TRACES.values():
        lines.append(
            f"  {t.name:<11} prompt {t.mean_prompt:g}, output {t.mean_output:g}: {t.source}"
        )
    lines.append("  Lengths are log-normal with coefficient of variation 1 (our assumption).")
    for u in UNIFORM_TRACES.values():
        lines += textwrap.wrap(
            f"{u.name}: prompts uniform in {u.prompt[0]}-{u.prompt[1]}, outputs "
            f"{u.output[0]}-{u.output[1]} tokens: {u.source}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    for c in CHAT_TRACES.values():
        lines += textwrap.wrap(
            f"{c.name}: sessions of {c.turns} turns (--num-requests counts turns); each "
            f"prompt is the previous prompt, its output and a new message (mean "
            f"{c.mean_message:g}, log-normal), output mean {c.mean_output:g}, think time mean "
            f"{c.think:g} s (exponential); --rate: sessions per second; {c.source}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    lines.append(
        "models (KV bytes per token at 16 bits, half with --kv-dtype fp8; weights; context):"
    )
    for m in MODELS.values():
        lines += textwrap.wrap(
            f"{m.name:<11} {m.kv_bytes_per_token:,} B/token"
            + (f" + {m.state_bytes:,} B of state per sequence" if m.has_state else "")
            + f", {m.num_params / 1e9:.2f}B params, {m.max_len} tokens: {m.source}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    lines.append("GPUs (memory, bandwidth, dense 16-bit FLOP/s):")
    for g in GPUS.values():
        lines.append(
            f"  {g.name:<11} {g.memory_bytes / 2**30:.1f} GiB, {g.bandwidth / 1e12:.3g} TB/s, "
            f"{g.flops / 1e12:g} TFLOP/s: {g.source}"
        )
    lines += [
        "",
        "systems, all over the same KV memory and the same FCFS continuous-batching scheduler:",
        "  hybrid  (models whose layers attend differently) pagedkv.HybridManager: one",
        "          group per kind of attention (pagedkv.groups), pages of equal bytes, a",
        "          window's blocks released as it slides; prompts prefilled in chunks",
        "  paged   pagedkv.BlockManager: blocks on demand, fork for samples and beams; for a",
        "          hybrid model, uniform paging: every layer treated as full attention; for",
        "          a recurrent model, the model with full attention in every layer",
        "For a recurrent model (Mamba, linear attention layers) the hybrid system also holds",
        "a state group: one state slot per live sequence and checkpoints of states after",
        "block-aligned prefixes (--state-memory, --checkpoint-interval); only hybrid and",
        "paged apply.",
        "  max     one contiguous region per sequence of the max length (Orca Max)",
        "  pow2    prompt + output rounded up to a power of two (Orca Pow2)",
        "  oracle  exactly prompt + output, as if known in advance (Orca Oracle)",
        "Contiguous regions lie in one address space, placed by a buddy allocator (the",
        "paper's Orca baselines; each region rounds up to a power of two) or first-fit.",
        "",
        "memory composition (vLLM paper, Fig. 2), shares of the KV memory averaged per step:",
        *(
            line
            for p in MEMORY_PARTS
            for line in textwrap.wrap(
                f"  {p.label:<9} {p.definition}", width=88, subsequent_indent=" " * 12
            )
        ),
        "Steps are measured until the last request is admitted (--include-drain: all).",
        "When the paged system cannot store a step's tokens it preempts the latest request,",
        "which is recomputed later (vLLM's policy); contiguous systems never need to.",
        "Step time: decode reads the weights and the batch's KV once, (weights + KV bytes) /",
        "(peak bandwidth x --decode-bandwidth-fraction); a windowed layer reads its window",
        "only. Prompt tokens add 2 x parameters FLOPs each / (peak FLOP/s x",
        "--prefill-flop-fraction). Several GPUs add up ideally.",
        "Decode throughput (tok/s): tokens generated per step over the step's decode time.",
        "Default fractions are published measurements (1.0 models ideal hardware):",
        *textwrap.wrap(
            f"decode {DECODE_BANDWIDTH_FRACTION:.3f}: {DECODE_BANDWIDTH_SOURCE}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        ),
        *textwrap.wrap(
            f"prefill {PREFILL_FLOP_FRACTION:.2f}: {PREFILL_FLOP_SOURCE}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        ),
        "",
        "--sweep-rate runs every system at every rate on the same seeded trace (the same",
        "lengths, Poisson arrivals at each rate) and prints normalized latency, the mean over",
        "requests of (finish - arrival) / output tokens (vLLM paper, Fig. 12), and the highest",
        "swept rate up to which each system's latency stays within --latency-bound.",
        "",
        "JSONL trace: one object per line with prompt_len, output_len (positive integers),",
        "optional prefix_id (requests with one id share that prefix) and prefix_len (default:",
        "the whole prompt), optional arrival (seconds; all lines or none).",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The `pagedkv` argument parser."""
    from pagedkv.simulate.presets import GPUS, MODELS
    from pagedkv.simulate.simulation import PREFILL_CHUNK, STATE_MEMORY_FRACTION
    from pagedkv.simulate.sweep import DEFAULT_LATENCY_BOUND
    from pagedkv.simulate.timing import DECODE_BANDWIDTH_FRACTION, PREFILL_FLOP_FRACTION

    parser = _Parser(prog="pagedkv", description="pagedkv: paged KV-cache memory for LLM serving")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="compare paged and contiguous KV memory on a request trace",
        description=(
            "Drive the real pagedkv.BlockManager through a request trace and compare it, on the "
            "same trace and KV memory, with contiguous allocation reserving the max length, the "
            "next power of two, or the true final length (an oracle)."
        ),
        epilog=_simulate_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument(
        "--trace",
        default="sharegpt",
        help="a preset (sharegpt, alpaca, azure-conv, azure-code, long-16k-32k, chat) or a "
        "JSONL file (default: sharegpt)",
    )
    sim.add_argument(
        "--num-requests",
        type=_positive_int,
        help="requests to draw from a preset (default 1000) or to take from a JSONL file "
        "(default: all)",
    )
    sim.add_argument("--seed", type=_seed, default=0, help="seed of the synthetic trace (0)")
    arrivals = sim.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrival rate in requests/s when the trace has no arrival times "
        "(default inf: all requests wait at t=0, the memory-bound regime)",
    )
    arrivals.add_argument(
        "--sweep-rate",
        type=parse_rates,
        metavar="START:STOP:STEP|R1,R2,...",
        help="run at each of these rates (req/s; STOP included) and print latency per output "
        "token against rate and the rate each system sustains, e.g. 0.25:3:0.25",
    )
    sim.add_argument(
        "--latency-bound",
        type=_seconds,
        metavar="SECONDS",
        help="with --sweep-rate: the normalized latency (s per output token) a system must "
        f"stay within to sustain a rate (default {DEFAULT_LATENCY_BOUND:g}: 5 tokens/s, "
        "about reading speed)",
    )
    sim.add_argument(
        "--model", type=_named(MODELS, "model"), default="OPT-13B", help="(default OPT-13B)"
    )
    sim.add_argument(
        "--gpu", type=_named(GPUS, "GPU"), default="A100-40GB", help="(default A100-40GB)"
    )
    sim.add_argument(
        "--gpus", type=_positive_int, default=1, help="GPUs with tensor parallelism (1)"
    )
    sim.add_argument(
        "--kv-memory",
        type=parse_size,
        help="KV memory, e.g. 12GB (default: 90%% of GPU memory minus the weights)",
    )
    sim.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="KV cache dtype: 16-bit or float8, half the bytes per token (default bf16)",
    )
    sim.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (16)")
    sim.add_argument(
        "--max-len", type=_positive_int, help="max sequence length (default: the model's)"
    )
    sim.add_argument(
        "-n", type=_positive_int, default=1, help="parallel samples per request, via fork (1)"
    )
    sim.add_argument(
        "--beam-width", type=_positive_int, default=1, help="beam search width, via fork (1)"
    )
    sim.add_argument(
        "--systems",
        type=_systems,
        default=None,
        help="comma-separated subset of hybrid,paged,max,pow2,oracle (default: all that "
        "apply; hybrid needs a model with windowed or recurrent layers)",
    )
    sim.add_argument(
        "--prefill-chunk",
        type=_positive_int,
        default=PREFILL_CHUNK,
        help=f"prompt tokens per forward pass in the hybrid system ({PREFILL_CHUNK})",
    )
    sim.add_argument(
        "--layers-per-group",
        type=_positive_int,
        help="layers per KV-cache group (page) in the hybrid system (default: the rule of "
        "pagedkv.groups.kv_groups)",
    )
    sim.add_argument(
        "--state-memory",
        type=_fraction,
        default=STATE_MEMORY_FRACTION,
        metavar="F",
        help="share of the memory for the state slots of a recurrent model's hybrid system "
        f"(working states and checkpoints; the pages get the rest) ({STATE_MEMORY_FRACTION:g})",
    )
    sim.add_argument(
        "--checkpoint-interval",
        type=int,
        metavar="TOKENS",
        help="tokens between a sequence's state checkpoints, a multiple of the block size; 0: "
        "at prompt ends and branch points only (default: the block size)",
    )
    sim.add_argument(
        "--allocator",
        choices=("buddy", "first-fit"),
        default="buddy",
        help="places contiguous regions: buddy (power-of-two blocks, as the paper's Orca "
        "baselines) or first-fit (exact sizes, no rounding) (default buddy)",
    )
    sim.add_argument(
        "--decode-bandwidth-fraction",
        type=_fraction,
        default=DECODE_BANDWIDTH_FRACTION,
        metavar="F",
        help="share of peak memory bandwidth that decode achieves "
        f"(default {DECODE_BANDWIDTH_FRACTION:.3f}, measured by gpt-fast; 1.0: ideal)",
    )
    sim.add_argument(
        "--prefill-flop-fraction",
        type=_fraction,
        default=PREFILL_FLOP_FRACTION,
        metavar="F",
        help="share of peak FLOP/s that prefill achieves "
        f"(default {PREFILL_FLOP_FRACTION:g}, Pope et al. 2023; 1.0: ideal)",
    )
    sim.add_argument(
        "--include-drain",
        action="store_true",
        help="also measure the steps after the last admission",
    )
    sim.add_argument("--json", action="store_true", help="print JSON instead of the table")
    sim.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="write a PNG plot: the memory composition, or with --sweep-rate latency and "
        "batch size against rate",
    )
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    events = sim.add_argument_group(
        "KV events (the paged system's, live, for KV-aware routers; needs pagedkv[events])"
    )
    events.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish on this ZeroMQ PUB endpoint, e.g. tcp://*:5557 (binds with *, ::, ipc:// "
        "or inproc://, connects otherwise)",
    )
    events.add_argument(
        "--kv-events-replay", metavar="ENDPOINT", help="ROUTER endpoint answering replay requests"
    )
    events.add_argument(
        "--kv-events-topic", metavar="T", default="", help="topic frame, e.g. kv@pod@model ('')"
    )
    events.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default="map",
        help="events as tagged maps (current vLLM) or tagged arrays (older vLLM, llm-d) (map)",
    )
    events.add_argument(
        "--kv-events-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for a first subscriber before simulating (0)",
    )
    return parser


def _run_simulate(args: argparse.Namespace) -> int:
    from pagedkv.simulate.progress import ProgressBar
    from pagedkv.simulate.report import format_json, format_sweep_table, format_table
    from pagedkv.simulate.simulation import SimulationResult, simulate
    from pagedkv.simulate.sweep import DEFAULT_LATENCY_BOUND, SweepResult, sweep

    _check_plot_path(args.plot)
    sweeping = args.sweep_rate is not None
    if args.latency_bound is not None and not sweeping:
        raise _UsageError("--latency-bound goes with --sweep-rate")
    if sweeping and args.kv_events is not None:
        raise _UsageError("--kv-events publishes one run's events: it cannot go with --sweep-rate")
    config = _simulation_config(args)
    trace_at, name, num_requests = _trace_source(args, config.max_len, sweeping)
    rates = args.sweep_rate if sweeping else [args.rate]
    publisher = _kv_event_publisher(args, config)
    # One bar over every run: each finished request of each system at each rate counts once.
    bar = ProgressBar(
        "",
        len(rates) * len(config.systems) * num_requests,
        sys.stderr,
        enabled=not args.quiet and sys.stderr.isatty(),
    )

    def progress(label: str) -> Callable[[int], None]:
        bar.label = label
        return bar.update

    result: SimulationResult | SweepResult
    try:
        if sweeping:
            bound = args.latency_bound or DEFAULT_LATENCY_BOUND
            result = sweep(
                trace_at, rates, config, trace_name=name, latency_bound=bound, on_finish=progress
            )
        else:
            sink = publisher.publish_from if publisher is not None else None
            result = simulate(
                trace_at(args.rate), config, trace_name=name, on_finish=progress, event_sink=sink
            )
    finally:
        bar.close()
        if publisher is not None:
            publisher.close()
            print(
                f"kv events: {publisher.sent} batches sent on {publisher.endpoint}, "
                f"{publisher.dropped} dropped",
                file=sys.stderr,
            )
    if args.json:
        print(format_json(result))
    else:
        print(
            format_table(result)
            if isinstance(result, SimulationResult)
            else format_sweep_table(result)
        )
    if args.plot is not None:
        from pagedkv.simulate.plot import write_plot

        try:
            write_plot(result, args.plot)
        except OSError as exc:
            raise _UsageError(f"cannot write plot {str(args.plot)!r}: {exc.strerror}") from None
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _check_plot_path(plot: Path | None) -> None:
    """Refuse a plot that cannot be written before a long run, not after it."""
    if plot is None:
        return
    if plot.suffix.lower() != ".png":
        raise _UsageError(f"--plot writes PNG: give a .png file name, got {str(plot)!r}")
    if not plot.parent.is_dir():
        raise _UsageError(f"cannot write plot {str(plot)!r}: no directory {str(plot.parent)!r}")
    if importlib.util.find_spec("matplotlib") is None:
        raise _UsageError("--plot needs matplotlib: pip install 'pagedkv[sim]'")


def _simulation_config(args: argparse.Namespace) -> SimulationConfig:
    """The settings the arguments give, with the defaults that depend on model and GPU."""
    from pagedkv.simulate.presets import GPUS, MODELS, default_kv_memory
    from pagedkv.simulate.simulation import SimulationConfig, default_systems

    model = MODELS[args.model]
    if args.kv_dtype == "fp8":
        model = dataclasses.replace(model, kv_dtype_bytes=1)
    gpu = GPUS[args.gpu]
    kv_memory = args.kv_memory
    if kv_memory is None:
        kv_memory = default_kv_memory(model, gpu, args.gpus)
    systems = args.systems if args.systems is not None else default_systems(model)
    slots = kv_memory // model.kv_bytes_per_token
    if "hybrid" in systems:  # a page holds `layers_per_group` layers' slots
        per_group = model.groups(args.layers_per_group).layers_per_group
        slots = max(slots, kv_memory // (model.layer_bytes_per_token * per_group))
    if slots > _MAX_SLOTS and ("paged" in systems or "hybrid" in systems):
        raise _UsageError(
            f"KV memory of {kv_memory} bytes holds {slots} token slots of {model.name}; the "
            f"block manager addresses at most {_MAX_SLOTS} (int32 slots): lower --kv-memory"
        )
    return SimulationConfig(
        model=model,
        gpu=gpu,
        kv_memory=kv_memory,
        block_size=args.block_size,
        max_len=args.max_len if args.max_len is not None else model.max_len,
        n=args.n,
        beam_width=args.beam_width,
        num_gpus=args.gpus,
        seed=args.seed,
        include_drain=args.include_drain,
        systems=systems,
        allocator=args.allocator,
        bandwidth_fraction=args.decode_bandwidth_fraction,
        flop_fraction=args.prefill_flop_fraction,
        prefill_chunk=args.prefill_chunk,
        layers_per_group=args.layers_per_group,
        state_memory=args.state_memory,
        checkpoint_interval=args.checkpoint_interval,
    )


def _trace_source(
    args: argparse.Namespace, max_len: int, sweeping: bool
) -> tuple[Callable[[float], list[Request]], str, int]:
    """The trace at a given arrival rate, its name, and its number of requests."""
    from pagedkv.simulate.presets import CHAT_TRACES, TRACES, UNIFORM_TRACES
    from pagedkv.simulate.trace import (
        chat_trace,
        load_jsonl,
        synthetic_trace,
        uniform_trace,
        with_poisson_arrivals,
    )

    name = args.trace.lower()
    count = args.num_requests or 1000
    draw: Callable[[float], list[Request]] | None = None
    if name in TRACES:
        preset = TRACES[name]

        def draw(rate: float) -> list[Request]:
            return synthetic_trace(preset, count, max_len=max_len, rate=rate, seed=args.seed)

    elif name in UNIFORM_TRACES:
        uniform = UNIFORM_TRACES[name]

        def draw(rate: float) -> list[Request]:
            return uniform_trace(uniform, count, max_len=max_len, rate=rate, seed=args.seed)

    elif name in CHAT_TRACES:
        chat = CHAT_TRACES[name]

        def draw(rate: float) -> list[Request]:
            return chat_trace(chat, count, max_len=max_len, rate=rate, seed=args.seed)

    if draw is not None:
        return draw, name, count
    if not (name.endswith(".jsonl") or Path(args.trace).exists()):
        presets = ", ".join([*TRACES, *UNIFORM_TRACES, *CHAT_TRACES])
        raise _UsageError(
            f"unknown trace {args.trace!r}: not a preset ({presets}) nor a .jsonl file"
        )
    # In file order; arrivals all 0 unless the file gives them.
    base = load_jsonl(Path(args.trace), max_len=max_len, rate=math.inf, seed=args.seed)
    if sweeping and any(r.arrival > 0 for r in base):
        raise _UsageError(
            f"{args.trace} gives arrival times: --sweep-rate draws its own, give a trace "
            "without them"
        )
    has_arrivals = any(r.arrival > 0 for r in base)
    end = args.num_requests or len(base)

    def from_file(rate: float) -> list[Request]:
        trace = base if has_arrivals else with_poisson_arrivals(base, rate, args.seed)
        return trace[:end]

    return from_file, args.trace, min(end, len(base))


def _kv_event_publisher(
    args: argparse.Namespace, config: SimulationConfig
) -> KVEventPublisher | None:
    """The publisher `--kv-events` asks for (None without it), its first subscriber awaited."""
    if args.kv_events is None:
        if args.kv_events_replay is not None or args.kv_events_topic:
            raise _UsageError("--kv-events-replay and --kv-events-topic need --kv-events")
        return None
    if "paged" not in config.systems:
        raise _UsageError(
            "--kv-events publishes the paged system's events: include it in --systems"
        )
    if importlib.util.find_spec("zmq") is None or importlib.util.find_spec("msgpack") is None:
        raise _UsageError("--kv-events needs pyzmq and msgpack: pip install 'pagedkv[events]'")
    if not args.kv_events_wait >= 0:
        raise _UsageError(f"--kv-events-wait must not be negative, got {args.kv_events_wait}")
    from pagedkv.events import KVEventPublisher

    try:
        publisher = KVEventPublisher(
            args.kv_events,
            block_size=config.block_size,
            topic=args.kv_events_topic,
            replay_endpoint=args.kv_events_replay,
            encoding=args.kv_events_encoding,
            batch_interval=0,  # one batch per simulated step, however fast steps run
        )
    except OSError as exc:
        raise _UsageError(str(exc)) from None
    if args.kv_events_wait > 0 and not publisher.wait_for_subscribers(1, args.kv_events_wait):
        print(
            f"kv events: no subscriber after {args.kv_events_wait:g} s, going on", file=sys.stderr
        )
    return publisher


class _UsageError(Exception):
    """Bad input found after parsing; reported in one line."""


def main(argv: list[str] | None = None) -> int:
    """Run the `pagedkv` command line; return the exit status."""
    from pagedkv.simulate.errors import ConfigError, SimulationError, TraceError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by _Parser.error
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _run_simulate(args)
    except (_UsageError, ConfigError, TraceError, SimulationError) as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader (e.g. `head`) left early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
