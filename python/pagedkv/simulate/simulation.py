"""One comparison: the paged system and the contiguous baselines on the same trace and memory."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv import StateConfig
from pagedkv.groups import KVGroups
from pagedkv.simulate.address_space import ALLOCATORS
from pagedkv.simulate.contiguous import (
    ContiguousSystem,
    ReservationPolicy,
    reserve_max,
    reserve_oracle,
    reserve_pow2,
)
from pagedkv.simulate.engine import KVSystem, run
from pagedkv.simulate.errors import ConfigError
from pagedkv.simulate.hybrid import HybridPagedSystem
from pagedkv.simulate.metrics import SystemMetrics
from pagedkv.simulate.paged import EventSink, PagedBase, PagedSystem
from pagedkv.simulate.presets import GpuPreset, ModelPreset
from pagedkv.simulate.timing import (
    DECODE_BANDWIDTH_FRACTION,
    PREFILL_FLOP_FRACTION,
    StepTimeModel,
)
from pagedkv.simulate.trace import Request, next_turns

# Prompt tokens per forward pass of the hybrid system: it allocates and plans a prompt in
# chunks (`allocate`, then `append` + `plan`), so a windowed group holds at most about a chunk
# and a window of it at any time. The size is our choice (--prefill-chunk).
PREFILL_CHUNK = 2048

# Share of the memory a recurrent model's hybrid system gives its state slots (working
# states and checkpoints); the pages get the rest. Our choice (--state-memory): a state of
# Qwen3-Next-80B is as large as about 1,600 tokens of its KV, a chat turn's length, so
# halves give each running sequence room for its KV and its state with checkpoints beside.
STATE_MEMORY_FRACTION = 0.5

# System key -> the label shown in reports.
SYSTEMS: dict[str, str] = {
    "hybrid": "hybrid paged (pagedkv)",
    "paged": "paged (pagedkv)",
    "max": "contiguous max",
    "pow2": "contiguous pow2",
    "oracle": "contiguous oracle",
}
_POLICIES: dict[str, ReservationPolicy] = {
    "max": reserve_max,
    "pow2": reserve_pow2,
    "oracle": reserve_oracle,
}


@dataclass(frozen=True)
class SimulationConfig:
    """Everything a comparison depends on besides the trace."""

    model: ModelPreset
    gpu: GpuPreset
    kv_memory: int  # bytes of KV memory, the same for every system
    block_size: int = 16
    max_len: int = 0  # 0: the model's context length
    n: int = 1  # parallel samples per request
    beam_width: int = 1
    num_gpus: int = 1
    seed: int = 0
    include_drain: bool = False
    watermark: float = 0.01
    systems: tuple[str, ...] = ("paged", "max", "pow2", "oracle")
    prefill_chunk: int = PREFILL_CHUNK  # the hybrid system's prompt tokens per forward pass
    layers_per_group: int | None = None  # the hybrid system's; None: `pagedkv.groups`' rule
    state_memory: float = STATE_MEMORY_FRACTION  # share of kv_memory for state slots
    checkpoint_interval: int | None = None  # tokens between state checkpoints; None: a block
    checkpoints_per_sequence: int = 1  # interval checkpoints a sequence keeps
    allocator: str = "buddy"  # places contiguous regions: "buddy" (the paper's) or "first-fit"
    bandwidth_fraction: float = DECODE_BANDWIDTH_FRACTION  # of peak bandwidth, in decode
    flop_fraction: float = PREFILL_FLOP_FRACTION  # of peak FLOP/s, in prefill
    timing: StepTimeModel = field(init=False, repr=False, compare=False)  # from the above

    def __post_init__(self) -> None:
        if self.max_len == 0:
            object.__setattr__(self, "max_len", self.model.max_len)
        checks = [
            (self.kv_memory > 0, f"KV memory must be positive, got {self.kv_memory} bytes"),
            (self.block_size >= 1, f"block size must be positive, got {self.block_size}"),
            (self.max_len >= 2, f"max length must be at least 2, got {self.max_len}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.beam_width >= 1, f"beam width must be at least 1, got {self.beam_width}"),
            (
                self.n == 1 or self.beam_width == 1,
                "choose parallel sampling (n) or beam search, not both",
            ),
            (self.num_gpus >= 1, f"number of GPUs must be at least 1, got {self.num_gpus}"),
            (self.seed >= 0, f"seed must not be negative, got {self.seed}"),
            (0 <= self.watermark < 1, f"watermark must be in [0, 1), got {self.watermark}"),
            (len(self.systems) > 0, "no system to simulate"),
            (
                self.prefill_chunk >= 1,
                f"prefill chunk must be positive, got {self.prefill_chunk}",
            ),
            (
                self.layers_per_group is None or self.layers_per_group >= 1,
                f"layers per group must be positive, got {self.layers_per_group}",
            ),
            (
                0 < self.state_memory < 1,
                f"state memory must be a fraction in (0, 1), got {self.state_memory}",
            ),
            (
                self.interval >= 0 and self.interval % max(1, self.block_size) == 0,
                f"checkpoint interval must be a multiple of the block size {self.block_size}, "
                f"got {self.interval}",
            ),
            (
                self.checkpoints_per_sequence >= 1,
                f"checkpoints per sequence must be positive, got {self.checkpoints_per_sequence}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.allocator not in ALLOCATORS:
            raise ConfigError(
                f"unknown allocator {self.allocator!r} (choose from {', '.join(ALLOCATORS)})"
            )
        for key in self.systems:
            if key not in SYSTEMS:
                raise ConfigError(f"unknown system {key!r} (choose from {', '.join(SYSTEMS)})")
            if self.model.has_state and key in _POLICIES:
                raise ConfigError(
                    f"{self.model.name} keeps recurrent states, which the contiguous system "
                    f"{key!r} does not model (choose from hybrid, paged)"
                )
        if self.model.has_state and "hybrid" in self.systems and self.num_state_slots < 1:
            raise ConfigError(
                f"the state memory ({self.state_memory:g} of {self.kv_memory} bytes) holds no "
                f"recurrent state of {self.model.name} ({self.model.state_bytes} bytes per "
                "sequence); add KV memory or raise --state-memory"
            )
        # Built once here, so that its efficiency checks run with the others.
        object.__setattr__(self, "timing", self.timing_of(self.model))
        if self.num_blocks < 1:
            raise ConfigError(
                f"KV memory of {self.kv_memory} bytes holds no block of {self.block_size} "
                f"tokens ({self.model.kv_bytes_per_token} bytes each)"
            )
        if "max" in self.systems and self.width * self.max_len > self.capacity:
            raise ConfigError(
                f"KV memory holds {self.capacity} token slots, fewer than one max-length "
                f"request ({self.width} x {self.max_len}); lower --max-len or add memory"
            )

    def timing_of(self, model: ModelPreset) -> StepTimeModel:
        """The step-time model of `model` on the configured GPUs."""
        return StepTimeModel.for_hardware(
            model,
            self.gpu,
            self.num_gpus,
            bandwidth_fraction=self.bandwidth_fraction,
            flop_fraction=self.flop_fraction,
        )

    def groups(self) -> KVGroups:
        """The hybrid system's KV-cache groups."""
        return self.model.groups(self.layers_per_group)

    @property
    def interval(self) -> int:
        """Tokens between a sequence's state checkpoints (0: prompt ends and branch points).

        The default, a block, checkpoints every running sequence's last block boundary, so
        a next turn finds a checkpoint exactly where its KV hit ends (a hit needs one there),
        at one state copy per block of decode on top of the state a step reads and writes.
        """
        if self.checkpoint_interval is None:
            return self.block_size
        return self.checkpoint_interval

    @property
    def num_state_slots(self) -> int:
        """State slots of the hybrid system: `state_memory` of the memory over a state's bytes
        (0 for a model without recurrent layers)."""
        if not self.model.has_state:
            return 0
        return int(self.state_memory * self.kv_memory) // self.model.state_bytes

    def state_config(self) -> StateConfig | None:
        """The hybrid system's state group: `num_state_slots` slots, any that no live sequence
        holds free to keep a checkpoint (the core's default), checkpoints every `interval`
        tokens, the last `checkpoints_per_sequence` of them kept per sequence (None without a
        slot)."""
        if self.num_state_slots < 1:
            return None
        return StateConfig(
            self.num_state_slots,
            checkpoint_interval=self.interval,
            checkpoints_per_sequence=self.checkpoints_per_sequence,
        )

    def system_model(self, key: str) -> ModelPreset:
        """The model system `key` runs: for a recurrent model, the paged system runs it with
        full attention everywhere (`ModelPreset.full_attention_everywhere`)."""
        if key == "paged" and self.model.has_state:
            return self.model.full_attention_everywhere()
        return self.model

    @property
    def width(self) -> int:
        """Sequences per request."""
        return max(self.n, self.beam_width)

    @property
    def num_blocks(self) -> int:
        """Blocks the KV memory holds."""
        return self.kv_memory // (self.model.kv_bytes_per_token * self.block_size)

    @property
    def capacity(self) -> int:
        """Token slots of the KV memory, the same for every system (whole blocks)."""
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict[str, object]:
        """The settings, for JSON."""
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "num_gpus": self.num_gpus,
            "kv_memory_bytes": self.kv_memory,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "capacity_slots": self.capacity,
            "max_len": self.max_len,
            "n": self.n,
            "beam_width": self.beam_width,
            "seed": self.seed,
            "include_drain": self.include_drain,
            "watermark": self.watermark,
            "allocator": self.allocator,
            "prefill_chunk": self.prefill_chunk,
            "layers_per_group": self.groups().layers_per_group,
            **(
                {
                    "state_bytes": self.model.state_bytes,
                    "state_memory": self.state_memory,
                    "state_slots": self.num_state_slots,
                    "checkpoint_interval": self.interval,
                    "checkpoints_per_sequence": self.checkpoints_per_sequence,
                }
                if self.model.has_state
                else {}
            ),
            "decode_bandwidth_fraction": self.bandwidth_fraction,
            "prefill_flop_fraction": self.flop_fraction,
        }


def default_systems(model: ModelPreset) -> tuple[str, ...]:
    """Every system that applies to `model`: the hybrid one only where layers attend apart
    or keep recurrent states; for the latter no contiguous one (they hold no states)."""
    if model.has_state:
        return ("hybrid", "paged")
    return tuple(key for key in SYSTEMS if key != "hybrid" or model.is_hybrid)


def system_label(key: str, model: ModelPreset) -> str:
    """The report label of system `key`; for a hybrid model the plain paged system is the
    uniform one (every layer treated as full attention)."""
    if key == "paged" and model.has_state:
        return "full-attention paged (pagedkv)"
    if key == "paged" and model.is_hybrid:
        return "uniform paged (pagedkv)"
    return SYSTEMS[key]


def trace_summary(trace: Sequence[Request], name: str) -> dict[str, object]:
    """The trace's name, size and mean lengths, for JSON."""
    return {
        "name": name,
        "requests": len(trace),
        "mean_prompt_len": float(np.mean([r.prompt_len for r in trace])),
        "mean_output_len": float(np.mean([r.output_len for r in trace])),
    }


@dataclass(frozen=True)
class SimulationResult:
    """The metrics of every system, with what they were measured on."""

    trace_name: str
    trace: Sequence[Request] = field(repr=False)
    config: SimulationConfig
    systems: list[SystemMetrics]

    def as_dict(self) -> dict[str, object]:
        """Settings, trace summary and per-system scalars, for JSON."""
        return {
            "trace": trace_summary(self.trace, self.trace_name),
            "config": self.config.as_dict(),
            "systems": [m.as_dict() for m in self.systems],
        }


def build_system(
    key: str,
    trace: Sequence[Request],
    config: SimulationConfig,
    event_sink: EventSink | None = None,
) -> KVSystem:
    """A fresh system `key` over the configured KV memory (`event_sink`: see PagedSystem)."""
    name = system_label(key, config.model)
    if key == "paged":
        model = config.system_model(key)
        return PagedSystem(
            config.kv_memory // (model.kv_bytes_per_token * config.block_size),
            config.block_size,
            trace,
            beam=config.beam_width > 1,
            seed=config.seed,
            watermark=config.watermark,
            name=name,
            event_sink=event_sink,
        )
    if key == "hybrid":
        return HybridPagedSystem(
            config.model,
            config.kv_memory,
            config.block_size,
            trace,
            beam=config.beam_width > 1,
            seed=config.seed,
            watermark=config.watermark,
            prefill_chunk=config.prefill_chunk,
            layers_per_group=config.layers_per_group,
            state=config.state_config(),
            name=name,
        )
    space = ALLOCATORS[config.allocator](config.capacity)
    return ContiguousSystem(name, space, _POLICIES[key], config.max_len)


def simulate(
    trace: Sequence[Request],
    config: SimulationConfig,
    *,
    trace_name: str = "trace",
    on_finish: Callable[[str], Callable[[int], None] | None] | None = None,
    event_sink: EventSink | None = None,
) -> SimulationResult:
    """Run every configured system through `trace` (sorted by arrival).

    `on_finish(label)` may return a callback told how many requests finish at each step
    (for a progress bar). `event_sink`, if given, gets the paged system's KV events after
    each step (`pagedkv simulate --kv-events`).
    """
    if any(a.arrival > b.arrival for a, b in itertools.pairwise(trace)):
        raise ConfigError("the trace must be sorted by arrival time")
    too_long = [i for i, r in enumerate(trace) if r.final_len > config.max_len]
    if too_long:
        r = trace[too_long[0]]
        raise ConfigError(
            f"request {too_long[0]} has {r.final_len} tokens, over the max length {config.max_len}"
        )
    next_turns(trace)  # checks the conversations' think times
    if config.width > 1 and any(r.conversation is not None for r in trace):
        raise ConfigError("a conversation trace runs one sequence per request (no -n or beams)")
    results = []
    for key in config.systems:
        system = build_system(key, trace, config, event_sink)
        model = config.system_model(key)
        metrics = run(
            system,
            trace,
            width=config.width,
            timing=config.timing if model is config.model else config.timing_of(model),
            include_drain=config.include_drain,
            on_finish=on_finish(system.name) if on_finish is not None else None,
            need=functools.partial(model.needed_slots, block_size=config.block_size),
        )
        if isinstance(system, PagedBase):
            metrics = dataclasses.replace(metrics, prefix=system.prefix_reuse)
        if isinstance(system, HybridPagedSystem):
            metrics = dataclasses.replace(metrics, state=system.state_use)
        results.append(metrics)
    return SimulationResult(trace_name, trace, config, results)
