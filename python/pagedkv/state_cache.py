"""The recurrent states of a hybrid model's state group, on one device.

A `HybridManager(..., state=StateConfig(num_slots))` hands each sequence a state *slot*; the
engine keeps, per recurrent layer, one tensor per state kind (a Mamba or Gated DeltaNet layer
has a convolution state and an SSM / recurrent state) with a row per slot. `StateCache` holds
those tensors and turns group 0's plan into tensor operations:

```python
cache = StateCache(num_layers, num_slots, [(conv_dim, kernel - 1), (heads, dk, dv)], device=dev)
plans = mgr.plan(seq_ids, query_lens)
cache.apply(plans[0])                          # the plan's state copies, then its resets
for layer in range(num_layers):
    for seg in state_segments(plans[0]):       # each row's query, cut where it saves
        conv, ssm = cache.states(layer, seg.slot)
        ...                                    # run tokens seg.start:seg.end, update in place
        for slot in seg.save_to:                 # checkpoints and draft states
            cache.copy(layer, seg.slot, slot)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "StateCache",
    "StatePlan",
    "StateSegment",
    "split_memory",
    "state_segments",
    "state_shapes",
]


class StatePlan(Protocol):
    """What a `Plan` or `Batch` of group 0 carries for the state group."""

    @property
    def qo_indptr(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_slots(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_copies(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_resets(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_saves(self) -> npt.NDArray[np.int32]: ...


@dataclass(frozen=True)
class StateSegment:
    """Packed query tokens `start:end` of batch row `row`, run on state `slot`; after them the
    state is saved into each slot of `save_to` (a checkpoint once the pass is committed, or a
    draft state a rollback may return to)."""

    row: int
    start: int
    end: int
    slot: int
    save_to: tuple[int, ...] = ()


def state_segments(plan: StatePlan) -> list[StateSegment]:
    """Each row's query tokens in plan order, cut after every save offset of `state_saves`.

    A row without saves is one segment; a row saving after its first `t` of `q` query tokens
    is two (`t < q`) or one that saves (`t == q`); saves at one offset are one segment's
    `save_to`. Raises `ValueError` for saves that name no row or an offset outside the row's
    query.
    """
    indptr = np.asarray(plan.qo_indptr, dtype=np.int64)
    slots = np.asarray(plan.state_slots, dtype=np.int64)
    rows = len(indptr) - 1
    if slots.shape != (rows,):
        raise ValueError(f"state_slots must have shape [{rows}] (one per row), got {slots.shape}")
    saves = _array("state_saves", plan.state_saves, 3)
    by_row: dict[int, dict[int, list[int]]] = {}
    for row, tokens, slot in saves.tolist():
        if not 0 <= row < rows:
            raise ValueError(f"state_saves names row {row} of a batch of {rows}")
        q = int(indptr[row + 1] - indptr[row])
        if not 0 < tokens <= q:
            raise ValueError(f"state_saves offset {tokens} is outside row {row}'s {q} queries")
        by_row.setdefault(row, {}).setdefault(tokens, []).append(slot)
    segments: list[StateSegment] = []
    for row in range(rows):
        start, end, slot = int(indptr[row]), int(indptr[row + 1]), int(slots[row])
        cut = start
        for tokens, save_to in sorted(by_row.get(row, {}).items()):
            segments.append(StateSegment(row, cut, start + tokens, slot, tuple(save_to)))
            cut = start + tokens
        if cut < end:
            segments.append(StateSegment(row, cut, end, slot))
    return segments


def _array(name: str, values: npt.ArrayLike, width: int | None) -> npt.NDArray[np.int64]:
    arr = np.asarray(values, dtype=np.int64)
    if width is None:
        if arr.ndim != 1:
            raise ValueError(f"{name} must have shape [n], got {arr.shape}")
    elif arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(f"{name} must have shape [n, {width}], got {arr.shape}")
    return arr


class StateCache:
    """Per layer, one tensor `[num_slots, *shape]` for each of `shapes` (the state kinds of one
    recurrent layer), zero-initialised; `dtypes` gives one dtype for all kinds or one each."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        shapes: Sequence[Sequence[int]],
        dtypes: torch.dtype | Sequence[torch.dtype] = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not shapes:
            raise ValueError("shapes must name at least one state per layer")
        kinds = [tuple(int(d) for d in shape) for shape in shapes]
        for i, shape in enumerate(kinds):
            if not shape or any(d < 1 for d in shape):
                raise ValueError(f"state {i} has shape {shape}: every state needs a size >= 1")
        types = [dtypes] * len(kinds) if isinstance(dtypes, torch.dtype) else list(dtypes)
        if len(types) != len(kinds):
            raise ValueError(f"{len(types)} dtypes for {len(kinds)} states")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.shapes: list[tuple[int, ...]] = kinds
        self.dtypes: list[torch.dtype] = types
        self.device = torch.device(device)
        self.tensors: list[list[torch.Tensor]] = [
            [
                torch.zeros(num_slots, *s, dtype=t, device=self.device)
                for s, t in zip(kinds, types, strict=True)
            ]
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' state tensors."""
        return sum(t.numel() * t.element_size() for layer in self.tensors for t in layer)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot across all layers: the state a sequence or checkpoint costs."""
        return self.nbytes // self.num_slots

    def layer(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s state tensors, `[num_slots, *shape]` each (for a batched kernel)."""
        self._check_layer(layer)
        return self.tensors[layer]

    def states(self, layer: int, slot: int) -> list[torch.Tensor]:
        """Views of slot `slot`'s states in layer `layer`; writing them updates the cache."""
        self._check_layer(layer)
        self._check_slot("slot", slot)
        return [t[slot] for t in self.tensors[layer]]

    def copy(self, layer: int, src: int, dst: int) -> None:
        """Copy slot `src`'s states in layer `layer` into slot `dst` (a plan's save)."""
        self._check_layer(layer)
        self._check_slot("src", src)
        self._check_slot("dst", dst)
        if src != dst:
            for t in self.tensors[layer]:
                t[dst].copy_(t[src])

    def apply(self, plan: StatePlan) -> None:
        """Apply `plan`'s `state_copies` in order, then zero its `state_resets`, in every layer:
        before the plan's forward pass, as the manager requires."""
        copies = _array("state_copies", plan.state_copies, 2)
        resets = _array("state_resets", plan.state_resets, None)
        self._check_slots("state_copies", copies)
        self._check_slots("state_resets", resets)
        if len(copies):
            src, dst = copies[:, 0], copies[:, 1]
            # One gather-scatter unless a pair reads a slot an earlier pair writes (a chain),
            # or two pairs write one slot: then pair by pair, in order.
            ordered = bool(np.isin(src, dst).any()) or len(np.unique(dst)) < len(dst)
            src_t = torch.from_numpy(src).to(self.device)
            dst_t = torch.from_numpy(dst).to(self.device)
            for layer in self.tensors:
                for t in layer:
                    if ordered:
                        for s, d in copies.tolist():
                            t[d].copy_(t[s])
                    else:
                        t.index_copy_(0, dst_t, t.index_select(0, src_t))
        if len(resets):
            index = torch.from_numpy(resets).to(self.device)
            for layer in self.tensors:
                for t in layer:
                    t.index_fill_(0, index, 0)

    def swap(self, other: StateCache, pairs: npt.NDArray[Any]) -> None:
        """Copy slots into `other` (the CPU pool of a swap-out, or back): `pairs` is the
        `[n, 2]` `(ours, theirs)` state entry a manager's `swap_out` / `swap_in` returns last,
        in every layer and state kind. The two caches must hold the same layers and states."""
        if (other.num_layers, other.shapes, other.dtypes) != (
            self.num_layers,
            self.shapes,
            self.dtypes,
        ):
            raise ValueError("swap: the two caches hold different layers or states")
        arr = _array("pairs", pairs, 2)
        self._check_slots("pairs (source)", arr[:, 0])
        other._check_slots("pairs (destination)", arr[:, 1])
        if not len(arr):
            return
        src = torch.from_numpy(arr[:, 0].copy()).to(self.device)
        dst = torch.from_numpy(arr[:, 1].copy()).to(other.device)
        for ours, theirs in zip(self.tensors, other.tensors, strict=True):
            for t, u in zip(ours, theirs, strict=True):
                u.index_copy_(0, dst, t.index_select(0, src).to(other.device))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range for {self.num_layers} layers")

    def _check_slot(self, name: str, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{name} slot {slot} is out of range for {self.num_slots} slots")

    def _check_slots(self, name: str, slots: npt.NDArray[np.int64]) -> None:
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = int(slots[(slots < 0) | (slots >= self.num_slots)][0])
            raise ValueError(f"{name} names slot {bad}, out of range for {self.num_slots} slots")


def split_memory(
    memory_bytes: int, page_bytes: int, slot_bytes: int, state_fraction: float = 0.5
) -> tuple[int, int]:
    """The KV pages and state slots `memory_bytes` hold when `state_fraction` of it goes to
    recurrent states: `(num_blocks, num_slots)`, for `HybridManager(num_blocks, ...,
    state=StateConfig(num_slots))`. `page_bytes` is one page of the KV groups (a block of
    tokens of `layers_per_group` layers), `slot_bytes` one sequence's state over every
    recurrent layer (`StateCache.slot_nbytes`). Raises `ValueError` naming the argument when a
    size is not positive, the fraction is not in (0, 1), or either share holds nothing."""
    for name, value in (
        ("memory_bytes", memory_bytes),
        ("page_bytes", page_bytes),
        ("slot_bytes", slot_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 < state_fraction < 1:
        raise ValueError(f"state_fraction must be in (0, 1), got {state_fraction}")
    state_bytes = int(memory_bytes * state_fraction)
    num_slots = state_bytes // slot_bytes
    num_blocks = (memory_bytes - num_slots * slot_bytes) // page_bytes
    if num_slots < 1:
        raise ValueError(
            f"slot_bytes ({slot_bytes}) is beyond the state's share of the memory "
            f"({state_fraction:g} of {memory_bytes} bytes)"
        )
    if num_blocks < 1:
        raise ValueError(
            f"page_bytes ({page_bytes}) is beyond the KV's share of the memory "
            f"({memory_bytes - num_slots * slot_bytes} of {memory_bytes} bytes)"
        )
    return num_blocks, num_slots


def state_shapes(config: Any) -> tuple[list[int], list[tuple[int, ...]]]:
    """The recurrent layers of a `transformers` hybrid config and one such layer's state
    shapes, `(layer_indices, [conv_shape, recurrent_shape])`, for Gated DeltaNet (Qwen3-Next)
    and Mamba2 (Bamba, GraniteMoeHybrid, Falcon-H1, NemotronH) layers: those `layer_types`
    lists as `linear_attention` (or `hybrid`: Falcon-H1's attention and Mamba side by side).

    The convolution state keeps the last `kernel - 1` inputs of the layer's causal
    convolution, `[conv_dim, kernel - 1]`; the recurrent state is `[heads, k_dim, v_dim]`
    (Gated DeltaNet) or `[heads, head_dim, d_state]` (Mamba2). Raises `ValueError` for a
    config without such layers.
    """
    layer_types = list(getattr(config, "layer_types", None) or [])
    layers = [i for i, t in enumerate(layer_types) if t in ("linear_attention", "hybrid")]
    if layers and hasattr(config, "mamba_d_state"):  # Bamba, GraniteMoeHybrid, Falcon-H1
        inner = getattr(config, "mamba_d_ssm", None) or int(
            config.mamba_expand * config.hidden_size
        )
        conv_dim = inner + 2 * config.mamba_n_groups * config.mamba_d_state
        ssm = (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)
        return layers, [(conv_dim, config.mamba_d_conv - 1), ssm]
    if layers and hasattr(config, "mamba_num_heads"):  # NemotronH
        heads, head_dim, d_state = (
            config.mamba_num_heads,
            config.mamba_head_dim,
            config.ssm_state_size,
        )
        conv_dim = heads * head_dim + 2 * config.n_groups * d_state
        return layers, [(conv_dim, config.conv_kernel - 1), (heads, head_dim, d_state)]
    if layers and hasattr(config, "linear_key_head_dim"):  # Qwen3-Next
        k_dim = config.linear_key_head_dim * config.linear_num_key_heads
        v_dim = config.linear_value_head_dim * config.linear_num_value_heads
        conv = (2 * k_dim + v_dim, config.linear_conv_kernel_dim - 1)
        heads = config.linear_num_value_heads
        return layers, [conv, (heads, config.linear_key_head_dim, config.linear_value_head_dim)]
    raise ValueError(
        f"no recurrent layers known in a {type(config).__name__}: pass the state shapes"
    )
