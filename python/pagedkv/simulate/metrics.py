"""Memory composition per step and the per-system summary averaged over the measured window.

The four parts of the KV memory (`MEMORY_PARTS`) follow Figure 2 of the vLLM paper (Kwon et
al., SOSP 2023), counted in token slots of the KV memory (one slot holds one token's K and V
for every layer). Reports, the plot and `--help` all describe them from `MEMORY_PARTS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class MemoryPart:
    """One of the four parts the KV memory's slots fall into at each step."""

    key: str  # the field of `Composition` and `StepLog`; `SystemMetrics` has `<key>_share`
    label: str  # short, for table columns
    title: str  # long, for the plot's legend
    definition: str


MEMORY_PARTS = (
    MemoryPart(
        "token",
        "tokens",
        "token states",
        "slots holding a stored token's KV (a slot shared by several sequences counts once)",
    ),
    MemoryPart(
        "reserved",
        "reserved",
        "reserved",
        "empty slots held by a running request that its future tokens will fill",
    ),
    MemoryPart(
        "internal",
        "internal",
        "internal fragmentation",
        "empty slots held that the request will never fill (a reservation beyond the final "
        "length, a buddy block's rounding, the tail of a last block past the final token)",
    ),
    MemoryPart(
        "external",
        "external",
        "external fragmentation / unused",
        "slots held by no running request (gaps between contiguous regions, free or cached blocks)",
    ),
)


@dataclass(frozen=True)
class Composition:
    """Where the KV memory's slots are at one step; the four parts sum to the capacity."""

    token: int
    reserved: int
    internal: int
    external: int
    logical: int  # slots the live sequences would hold with no sharing at all

    @property
    def held(self) -> int:
        """Slots held by running requests."""
        return self.token + self.reserved + self.internal

    @property
    def capacity(self) -> int:
        """All slots of the KV memory."""
        return self.held + self.external


@dataclass(frozen=True)
class PrefixReuse:
    """Prompt tokens a paged system's admissions asked for, served, and could have served."""

    query_tokens: int
    hit_tokens: int  # served from the prefix cache
    full_group_tokens: int  # its full-attention layers alone had cached (every hit needs them)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def full_group_rate(self) -> float:
        """Share of prompt tokens the full-attention layers alone had cached."""
        return self.full_group_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The counts and rates, for JSON."""
        return {
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "full_group_tokens": self.full_group_tokens,
            "hit_rate": self.hit_rate,
            "full_group_rate": self.full_group_rate,
        }


@dataclass(frozen=True)
class StateUse:
    """The state group of a hybrid recurrent model: its slots, its checkpoint policy and what
    its checkpoints held, served and cost over a run (`pagedkv.StateStats` at the end)."""

    num_slots: int
    slot_bytes: int
    max_checkpoints: int
    checkpoint_interval: int  # 0: prompt ends and branch points only
    checkpoints_per_sequence: int
    mean_checkpoints: float  # held after each step, mean over every step
    peak_checkpoints: int
    saved: int  # checkpoints committed
    skipped: int  # saves given up for want of a slot
    evictions: int  # checkpoints evicted (LRU) for another slot
    dropped: int  # interval checkpoints freed beyond a sequence's cap
    decode_saves: int  # saves planned by decode steps (interval checkpoints)
    decode_tokens: int  # tokens those steps stored
    hit_copies: int  # copies of a checkpoint into a working slot (admissions that hit)
    allowed_tokens: int  # prompt tokens the checkpoints alone could serve
    hit_tokens: int  # prompt tokens served (every group, the state group included)

    @property
    def saves_per_decode_token(self) -> float:
        """State copies into checkpoints per token decoded."""
        return self.decode_saves / self.decode_tokens if self.decode_tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The counts, for JSON."""
        out: dict[str, float | int] = dict(self.__dict__)
        out["saves_per_decode_token"] = self.saves_per_decode_token
        return out


@dataclass
class StepLog:
    """Per-step records of one system's run, appended by the engine."""

    time: list[float] = field(default_factory=list)  # simulated seconds at the step's end
    decode_seconds: list[float] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)
    needed: list[float] = field(default_factory=list)  # slots the running sequences need
    seqs: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    loaded: list[bool] = field(default_factory=list)  # a request waited for admission

    def record(
        self,
        comp: Composition,
        *,
        time: float,
        decode_seconds: float,
        needed: float,
        seqs: int,
        requests: int,
        generated: int,
        loaded: bool,
    ) -> None:
        """Append one step."""
        self.needed.append(needed)
        self.time.append(time)
        self.decode_seconds.append(decode_seconds)
        self.token.append(comp.token)
        self.reserved.append(comp.reserved)
        self.internal.append(comp.internal)
        self.external.append(comp.external)
        self.logical.append(comp.logical)
        self.seqs.append(seqs)
        self.requests.append(requests)
        self.generated.append(generated)
        self.loaded.append(loaded)

    def window(self, include_drain: bool) -> int:
        """Number of leading steps measured: all, or up to the last step a request waited."""
        if include_drain:
            return len(self.loaded)
        return 1 + max((i for i, waited in enumerate(self.loaded) if waited), default=-1)


@dataclass(frozen=True)
class SystemMetrics:
    """One system's results, averaged per step over the measured window."""

    name: str
    capacity: int
    token_share: float
    reserved_share: float
    internal_share: float
    external_share: float
    held_token_share: float  # token states / held slots, summed over the window
    mean_seqs: float
    peak_seqs: int
    mean_requests: float
    throughput: float  # generated tokens per second of decode time
    preemptions: int
    sharing_saving: float  # 1 - held / logical slots, summed over the window
    mean_latency_per_token: float  # (finish - arrival) / output_len, mean over requests
    steps: int
    window_steps: int
    decode_seconds: float  # decode time of the window's steps
    bound_seqs: float  # mean batch if each sequence held exactly its needs (see summarize)
    series_time: npt.NDArray[np.float64] = field(repr=False, compare=False)  # step ends (s)
    series_token: npt.NDArray[np.int64] = field(repr=False, compare=False)  # slots per step
    series_held: npt.NDArray[np.int64] = field(repr=False, compare=False)
    prefix: PrefixReuse | None = None  # paged systems: prompt tokens served from the cache
    state: StateUse | None = None  # the hybrid system of a recurrent model: its state group

    def share(self, part: MemoryPart) -> float:
        """The mean share of the KV memory in `part`."""
        share: float = getattr(self, f"{part.key}_share")
        return share

    def as_dict(self) -> dict[str, object]:
        """The scalar results, for JSON."""
        return {
            "name": self.name,
            "capacity_slots": self.capacity,
            "token_share": self.token_share,
            "reserved_share": self.reserved_share,
            "internal_share": self.internal_share,
            "external_share": self.external_share,
            "held_token_share": self.held_token_share,
            "mean_seqs": self.mean_seqs,
            "peak_seqs": self.peak_seqs,
            "mean_requests": self.mean_requests,
            "throughput_tokens_per_s": self.throughput,
            "preemptions": self.preemptions,
            "sharing_saving": self.sharing_saving,
            "mean_latency_per_token_s": self.mean_latency_per_token,
            "steps": self.steps,
            "window_steps": self.window_steps,
            "decode_seconds": self.decode_seconds,
            "bound_seqs": self.bound_seqs,
            **({"prefix": self.prefix.as_dict()} if self.prefix is not None else {}),
            **({"state": self.state.as_dict()} if self.state is not None else {}),
        }


def summarize(
    name: str,
    capacity: int,
    log: StepLog,
    *,
    include_drain: bool,
    preemptions: int,
    latencies: list[float],
) -> SystemMetrics:
    """Average `log` over its measured window (see `StepLog.window`).

    `bound_seqs` is the mean over steps of the batch the whole capacity would hold if each
    running sequence held exactly the slots it needs (`StepLog.needed`): seqs x capacity /
    needed.
    """
    n = log.window(include_drain)
    if n == 0:
        raise ValueError(f"{name}: no step to measure (empty trace?)")
    slots = {p.key: np.asarray(getattr(log, p.key)[:n], dtype=np.float64) for p in MEMORY_PARTS}
    token = slots["token"]
    held = token + slots["reserved"] + slots["internal"]
    logical = float(np.sum(log.logical[:n]))
    seconds = float(np.sum(log.decode_seconds[:n]))
    return SystemMetrics(
        name=name,
        capacity=capacity,
        token_share=float(slots["token"].mean()) / capacity,
        reserved_share=float(slots["reserved"].mean()) / capacity,
        internal_share=float(slots["internal"].mean()) / capacity,
        external_share=float(slots["external"].mean()) / capacity,
        held_token_share=float(token.sum() / held.sum()) if held.sum() > 0 else 0.0,
        mean_seqs=float(np.mean(log.seqs[:n])),
        peak_seqs=int(np.max(log.seqs[:n])),
        mean_requests=float(np.mean(log.requests[:n])),
        throughput=float(np.sum(log.generated[:n])) / seconds if seconds > 0 else 0.0,
        preemptions=preemptions,
        sharing_saving=1.0 - float(held.sum()) / logical if logical > 0 else 0.0,
        mean_latency_per_token=float(np.mean(latencies)) if latencies else 0.0,
        steps=len(log.token),
        window_steps=n,
        decode_seconds=seconds,
        bound_seqs=float(np.mean(np.asarray(log.seqs[:n]) * capacity / np.asarray(log.needed[:n]))),
        series_time=np.asarray(log.time, dtype=np.float64),
        series_token=np.asarray(log.token, dtype=np.int64),
        series_held=np.asarray(log.token, dtype=np.int64)
        + np.asarray(log.reserved, dtype=np.int64)
        + np.asarray(log.internal, dtype=np.int64),
    )
