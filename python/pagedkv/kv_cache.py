"""Paged K/V tensors: one tensor per layer, in one of FlashInfer's layouts (`kv_layout`).

Layer `l` is `[num_blocks, *page_shape]`: NHD `[num_blocks, 2, block_size, num_kv_heads,
head_dim]` (K at index 0 of dimension 1, V at 1), HND `[num_blocks, 2, num_kv_heads, block_size,
head_dim]`, or MLA `[num_blocks, block_size, head_dim + rope_dim]` (latent, then its rope part).
Token slot `s` lives in block `s // block_size` at offset `s % block_size` (the `slot_mapping`
of a `Plan`). float8 caches (e4m3, e5m2) store `x / scale` with one K and one V scale per layer
(for MLA: latent and rope) and are read as `stored * scale`. The cache only moves bytes; which
block holds what is the `BlockManager`'s business, and the block pairs it returns are applied
here:

>>> import numpy as np
>>> cache = KVCache(2, 8, 4, 1, 2, dtype=torch.float32)
>>> cache.copy_blocks(np.array([[0, 5]], dtype=np.int32))  # copy-on-write pair (src, dst)
>>> cache.layer(0).shape
torch.Size([8, 2, 4, 1, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pagedkv._device import resolve_device, upload_ints
from pagedkv.kv_layout import KVLayout, Layout

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What `write` takes for a float8 cache (it quantizes): the dtypes models compute in.
FP8_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class HasSlotMapping(Protocol):
    """Anything with a `slot_mapping` and the `block_size` it is for (a `pagedkv.Plan`)."""

    @property
    def slot_mapping(self) -> npt.NDArray[Any]:
        """`[tokens]` slot of each new token: `block * block_size + offset`."""

    @property
    def block_size(self) -> int:
        """Token slots per block of the manager that made the plan."""


Slots = HasSlotMapping | npt.NDArray[Any] | torch.Tensor


class SlotIndex:
    """A step's slots on the cache's device: their blocks and offsets, and the NHD rows.

    Seen as rows of `[num_kv_heads, head_dim]`, block `b` of an NHD layer holds its K tokens in
    rows `2 * b * block_size ..` and its V tokens in the `block_size` rows after them. A slot of
    -1 marks a token whose KV is cached already (a state group recomputing its state over a KV
    hit): `slots` are the others', `kept` their token indices (None when every token writes).
    """

    def __init__(
        self,
        slots: torch.Tensor,
        block_size: int,
        kept: torch.Tensor | None = None,
        num_tokens: int | None = None,
    ) -> None:
        self.slots = slots
        self.block_size = block_size
        self.kept = kept
        self.num_tokens = slots.shape[0] if num_tokens is None else num_tokens
        self.block = torch.div(slots, block_size, rounding_mode="floor")
        self.offset = slots - self.block * block_size
        self.k_rows = self.block * block_size + slots  # 2 * block * bs + slot % bs
        self.v_rows = self.k_rows + block_size


def check_block_size(plan: object, block_size: int, consumer: str) -> None:
    """Raise `ValueError` unless `plan` carries `block_size`: its slots and pages mean other
    positions under another block size, so using it would be silently wrong."""
    planned = getattr(plan, "block_size", None)
    if not isinstance(planned, int):
        raise ValueError(f"the plan has no int block_size; {consumer} has block_size={block_size}")
    if planned != block_size:
        raise ValueError(
            f"the plan has block_size={planned} but {consumer} has block_size={block_size}"
        )


def _pairs(name: str, pairs: npt.NDArray[Any], src_blocks: int, dst_blocks: int) -> np.ndarray:
    """Validate an `[n, 2]` array of block pairs and return it as int64."""
    arr = np.asarray(pairs)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name} must have shape [n, 2], got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size:
        for col, (side, limit) in enumerate((("source", src_blocks), ("destination", dst_blocks))):
            lo, hi = int(arr[:, col].min()), int(arr[:, col].max())
            if lo < 0 or hi >= limit:
                raise ValueError(
                    f"{name}: {side} block ids must lie in [0, {limit}), got [{lo}, {hi}]"
                )
    return arr


class KVCache:
    """The K/V of `num_blocks` blocks for every layer, on one device.

    `layout` is `"NHD"` (default), `"HND"` or `"MLA"` (then `num_kv_heads` is 1, `head_dim` the
    latent width and `rope_dim` its rope part, e.g. 512 and 64). `dtype` is any float dtype,
    float8 (`torch.float8_e4m3fn`, `torch.float8_e5m2`) included; a float8 cache takes `scales`,
    `[num_layers, 2]` positive finite numbers (K and V, or latent and rope, per layer; ones by
    default), fixed for the cache's life so captured CUDA graphs stay valid. `pin_memory=True`
    pins a CPU cache so swaps to and from the GPU move faster.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        *,
        layout: Layout = "NHD",
        rope_dim: int = 0,
        scales: npt.ArrayLike | None = None,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        self.kv_layout = KVLayout(layout, num_kv_heads, head_dim, rope_dim)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.dtype = dtype
        self._scales = _check_scales(scales, num_layers, dtype)
        self.device = resolve_device(device)
        if pin_memory and self.device.type != "cpu":
            raise ValueError("pin_memory=True only applies to a CPU cache")
        self.page_shape = self.kv_layout.page_shape(block_size)
        shape = (num_blocks, *self.page_shape)
        # Zeroed rather than empty: a bug that reads an unwritten slot then shows up as a wrong
        # number, never as a NaN that a masked softmax might hide.
        self._layers = tuple(
            torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
            for _ in range(num_layers)
        )

    @property
    def layout(self) -> Layout:
        """`"NHD"`, `"HND"` or `"MLA"`."""
        return self.kv_layout.name

    @property
    def is_fp8(self) -> bool:
        """True when the cache stores float8 with scales."""
        return self.dtype in FP8_DTYPES

    def scales(self, layer: int) -> tuple[float, float] | None:
        """`(k_scale, v_scale)` of `layer` (MLA: latent and rope), or None unless float8."""
        self.layer(layer)  # range check
        return self._scales[layer] if self._scales else None

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers."""
        return self.kv_layout.bytes_per_token(self.num_layers, self.dtype.itemsize)

    @property
    def num_slots(self) -> int:
        """Token slots per layer: `num_blocks * block_size`."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers."""
        return sum(t.numel() * t.element_size() for t in self._layers)

    def layer(self, layer: int) -> torch.Tensor:
        """The tensor of `layer`, `[num_blocks, *page_shape]` (see the module docstring)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return self._layers[layer]

    def slot_tensor(self, slots: Slots | SlotIndex) -> SlotIndex:
        """Slots prepared for `write` on this cache's device; validated when given on the host.

        Call it once per step and pass the result to every layer's `write`: the conversion, the
        upload (pinned, without a device sync) and the row arithmetic then happen once per
        step. A device tensor is taken as is: checking its values would cost a device sync.
        """
        if isinstance(slots, SlotIndex):
            if slots.slots.device != self.device or slots.block_size != self.block_size:
                raise ValueError("these slots were prepared for another cache")
            return slots
        if isinstance(slots, torch.Tensor):
            if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    "slots must be a 1-D int32/int64 tensor, "
                    f"got {slots.dtype} {tuple(slots.shape)}"
                )
            if slots.device.type == "cpu":
                return self.slot_tensor(slots.numpy())
            if slots.device != self.device:
                raise ValueError(f"slots are on {slots.device}, the cache on {self.device}")
            return SlotIndex(slots.to(torch.int64), self.block_size)
        if isinstance(slots, np.ndarray):
            arr = slots
        elif hasattr(slots, "slot_mapping"):
            check_block_size(slots, self.block_size, "this KVCache")
            arr = np.asarray(slots.slot_mapping)
        else:
            raise ValueError(
                "slots must be a Plan, a numpy integer array or a tensor from slot_tensor, "
                f"got {type(slots).__name__}"
            )
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"slot_mapping must be a 1-D integer array, got {arr.dtype} {arr.shape}"
            )
        if arr.size and (int(arr.min()) < -1 or int(arr.max()) >= self.num_slots):
            raise ValueError(
                f"slot_mapping values must lie in [0, {self.num_slots}) (or be -1: cached), "
                f"got [{int(arr.min())}, {int(arr.max())}]"
            )
        arr = arr.astype(np.int64)
        if not arr.size or int(arr.min()) >= 0:
            return SlotIndex(upload_ints(arr, self.device), self.block_size)
        kept = np.flatnonzero(arr >= 0)
        return SlotIndex(
            upload_ints(arr[kept], self.device),
            self.block_size,
            kept=upload_ints(kept, self.device),
            num_tokens=arr.size,
        )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: Slots | SlotIndex) -> None:
        """Store new tokens' `k` and `v` (`[tokens, num_kv_heads, head_dim]`) at their slots.

        `slots` is a `Plan` (its `slot_mapping` is used), a numpy array, or what `slot_tensor`
        returned (the fast path: K and V are then one indexed store each). A float8 cache takes
        float16/bfloat16/float32 and quantizes with the layer's scales. MLA caches use
        `write_latent`.
        """
        if self.kv_layout.is_mla:
            raise ValueError("this cache has the MLA layout: store tokens with write_latent")
        expected = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != expected:
                raise ValueError(
                    f"{name} must have shape [tokens, {expected[0]}, {expected[1]}], "
                    f"got {tuple(t.shape)}"
                )
        index = self._write_index(slots, k, v)
        if index.kept is not None:
            k, v = k.index_select(0, index.kept), v.index_select(0, index.kept)
        k_scale, v_scale = self._scales[layer] if self._scales else (1.0, 1.0)
        k, v = self._stored(k, k_scale), self._stored(v, v_scale)
        t = _raw(self.layer(layer))
        if self.layout == "HND":
            t[index.block, 0, :, index.offset] = k
            t[index.block, 1, :, index.offset] = v
            return
        # The layer as rows of [heads, dim]: block b's K rows, then its V rows.
        rows = t.view(-1, *t.shape[-2:])
        rows.index_copy_(0, index.k_rows, k)
        rows.index_copy_(0, index.v_rows, v)

    def write_latent(
        self, layer: int, latent: torch.Tensor, rope: torch.Tensor, slots: Slots | SlotIndex
    ) -> None:
        """Store new tokens' MLA `latent` (`[tokens, head_dim]`) and `rope` part
        (`[tokens, rope_dim]`) at their slots; as `write` otherwise."""
        if not self.kv_layout.is_mla:
            raise ValueError(f"write_latent needs the MLA layout; this cache is {self.layout}")
        for name, t, width in (("latent", latent, self.head_dim), ("rope", rope, self.rope_dim)):
            if t.dim() != 2 or t.shape[1] != width:
                raise ValueError(f"{name} must have shape [tokens, {width}], got {tuple(t.shape)}")
        index = self._write_index(slots, latent, rope)
        if index.kept is not None:
            latent, rope = latent.index_select(0, index.kept), rope.index_select(0, index.kept)
        latent_scale, rope_scale = self._scales[layer] if self._scales else (1.0, 1.0)
        row = torch.cat([self._stored(latent, latent_scale), self._stored(rope, rope_scale)], 1)
        rows = _raw(self.layer(layer)).view(-1, row.shape[1])
        rows.index_copy_(0, index.slots, row)

    def _write_index(self, slots: Slots | SlotIndex, a: torch.Tensor, b: torch.Tensor) -> SlotIndex:
        """The slots of a write of `a` and `b`, once their dtypes, devices and lengths check."""
        for t in (a, b):
            fits = t.dtype in FP8_INPUT_DTYPES if self.is_fp8 else t.dtype == self.dtype
            if not fits or t.device != self.device:
                want = "float16/bfloat16/float32" if self.is_fp8 else str(self.dtype)
                raise ValueError(
                    f"got {t.dtype} on {t.device}; this {self.dtype} cache on {self.device} "
                    f"takes {want} there"
                )
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"{a.shape[0]} tokens in one part but {b.shape[0]} in the other")
        index = self.slot_tensor(slots)
        if index.num_tokens != a.shape[0]:
            raise ValueError(f"{index.num_tokens} slots for {a.shape[0]} tokens")
        return index

    def _stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """`x` as the cache stores it: quantized to float8 (saturating) and viewed as bytes, or
        as it is."""
        if not self.is_fp8:
            return x
        limit = torch.finfo(self.dtype).max
        q = (x.float() / scale).clamp_(-limit, limit).to(self.dtype)
        return q.view(torch.uint8)

    def copy_blocks(self, pairs: npt.NDArray[Any]) -> None:
        """Apply copy-on-write pairs `(src, dst)` (a plan's `copies`), in order.

        Apply them before writing the step's new K/V. Pairs are copied all at once when no
        destination is read or written by another pair, and one by one otherwise, so a chain
        such as `(a, b), (b, c)` has the effect of applying the pairs in order.
        """
        arr = _pairs("copy pairs", pairs, self.num_blocks, self.num_blocks)
        if arr.shape[0] == 0:
            return
        src, dst = arr[:, 0], arr[:, 1]
        independent = np.unique(dst).size == dst.size and not np.isin(dst, src).any()
        # One upload for all pairs, pinned and asynchronous: no device sync per step or pair.
        ids = upload_ints(arr, self.device)
        groups = [ids] if independent else [ids[i : i + 1] for i in range(arr.shape[0])]
        for group in groups:
            s, d = group[:, 0], group[:, 1]
            for t in map(_raw, self._layers):
                t[d] = t[s]

    def read_blocks(
        self, block_ids: npt.NDArray[Any], out: torch.Tensor | None = None
    ) -> HostBlocks:
        """Copy blocks to host memory: `[n, layers, *page_shape]`.

        `out`, when given, is that host tensor (each `out[i]` contiguous; blocks may lie apart,
        say behind room for a header); pin it for an async copy from CUDA. On CUDA the copy is
        enqueued on the current stream and this returns at once, without a device sync; the
        result is `ready()` once the copy landed. Work enqueued later (say, a step that
        overwrites a block) cannot change what it reads.
        """
        ids = self._block_ids(block_ids)
        shape = (ids.size, self.num_layers, *self.page_shape)
        cuda = self.device.type == "cuda"
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, pin_memory=cuda)
        elif (
            tuple(out.shape) != shape
            or out.dtype != self.dtype
            or out.device.type != "cpu"
            or not all(out[i].is_contiguous() for i in range(ids.size))
        ):
            raise ValueError(
                f"out must be a host {self.dtype} tensor {shape} with contiguous blocks, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if ids.size:
            # On CUDA, gathered on the device first: contiguous device-to-host copies stay
            # async (a strided host target would force a sync).
            if cuda:
                idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
                staging = torch.empty(shape, dtype=self.dtype, device=self.device)
                for layer, t in enumerate(self._layers):
                    torch.index_select(_raw(t), 0, idx, out=_raw(staging[:, layer]))
                if out.is_contiguous():
                    out.copy_(staging, non_blocking=True)
                else:
                    for i in range(ids.size):
                        out[i].copy_(staging[i], non_blocking=True)
            else:
                # One contiguous copy per block and layer, straight into `out`: twice as fast
                # on CPU as a gather per layer followed by a strided copy.
                cache_layers = self._host_layer_bytes()
                for row, block in zip(out, ids.tolist(), strict=True):
                    row_layers = _as_bytes(row).reshape(self.num_layers, -1)
                    for dst, src in zip(row_layers, cache_layers, strict=True):
                        np.copyto(dst, src[block])
        done = Transfer(torch.cuda.current_stream(self.device).record_event() if cuda else None)
        return HostBlocks(out, done)

    def write_blocks(self, block_ids: npt.NDArray[Any], host: torch.Tensor) -> None:
        """Fill blocks from `host`, shaped as `read_blocks` returns, enqueued on this device.

        Do not modify `host` afterwards until the current stream has passed the copy.
        """
        ids = self._block_ids(block_ids)
        shape = (ids.size, self.num_layers, *self.page_shape)
        if tuple(host.shape) != shape or host.dtype != self.dtype:
            raise ValueError(
                f"host blocks must be {self.dtype} {shape}, got {host.dtype} {tuple(host.shape)}"
            )
        if np.unique(ids).size != ids.size:
            raise ValueError("write_blocks: a block id appears twice")
        if not ids.size:
            return
        if self.device.type == "cpu":
            self._scatter_host(ids, [_as_bytes(block) for block in host])
            return
        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
        src = host.to(self.device, non_blocking=True)
        for layer, t in enumerate(self._layers):
            _raw(t).index_copy_(0, idx, _raw(src[:, layer]))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers, as `read_blocks` lays it out."""
        return self.block_size * self.bytes_per_token

    def write_block_bytes(
        self, block_ids: npt.NDArray[Any], blocks: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """Fill blocks from raw bytes: `blocks[i]` holds block `block_ids[i]` laid out as a
        `read_blocks` row (`block_nbytes` bytes), say a value fetched from a store.

        On CPU each block is copied straight into the cache; on CUDA they are staged in pinned
        memory and moved with one async transfer. `blocks` may be reused once this returns.
        """
        ids = self._block_ids(block_ids)
        if len(blocks) != ids.size:
            raise ValueError(f"{ids.size} block ids for {len(blocks)} blocks")
        views = [np.frombuffer(b, dtype=np.uint8) for b in blocks]
        for i, view in enumerate(views):
            if view.size != self.block_nbytes:
                raise ValueError(
                    f"block {i} has {view.size} bytes; a block of this cache has "
                    f"{self.block_nbytes}"
                )
        if np.unique(ids).size != ids.size:
            raise ValueError("write_block_bytes: a block id appears twice")
        if not ids.size:
            return
        if self.device.type == "cpu":
            self._scatter_host(ids, views)
            return
        staging = torch.empty((ids.size, self.block_nbytes), dtype=torch.uint8, pin_memory=True)
        for row, view in zip(staging.numpy(), views, strict=True):
            np.copyto(row, view)
        shape = (ids.size, self.num_layers, *self.page_shape)
        self.write_blocks(ids, staging.view(self.dtype).view(shape))

    def _host_layer_bytes(self) -> list[npt.NDArray[np.uint8]]:
        """Each layer of a CPU cache as a writable uint8 array `[num_blocks, layer block bytes]`."""
        return [_as_bytes(t).reshape(self.num_blocks, -1) for t in self._layers]

    def _scatter_host(
        self, ids: npt.NDArray[np.int64], blocks: list[npt.NDArray[np.uint8]]
    ) -> None:
        """Copy each block's bytes (all layers) into a CPU cache, one contiguous copy per layer."""
        layers = self._host_layer_bytes()
        for block, data in zip(ids.tolist(), blocks, strict=True):
            for layer, src in zip(layers, data.reshape(self.num_layers, -1), strict=True):
                np.copyto(layer[block], src)

    def _block_ids(self, block_ids: npt.NDArray[Any]) -> np.ndarray:
        """`block_ids` validated as a 1-D int64 array of this cache's blocks."""
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"block ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        ids = ids.astype(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(
                f"block ids must lie in [0, {self.num_blocks}), "
                f"got [{int(ids.min())}, {int(ids.max())}]"
            )
        return ids

    def block_format(self) -> tuple[object, ...]:
        """What two caches must share for their blocks' bytes to mean the same KV: layers,
        block size, layout, dtype and scales."""
        return (self.num_layers, self.block_size, self.kv_layout, self.dtype, self._scales)

    def swap_out(self, cpu_cache: KVCache, pairs: npt.NDArray[Any]) -> Transfer:
        """Copy this cache's blocks to `cpu_cache` by the `(gpu, cpu)` pairs of `swap_out`.

        The copies are enqueued without a device sync (asynchronous when `cpu_cache` is
        pinned). Later work on the current stream, including the writes that reuse the GPU
        blocks after `confirm_swap_out` and a later `swap_in` of the CPU blocks, runs after
        them, so the engine may confirm at once; code that reads the CPU blocks on the host or
        from another stream waits on the returned `Transfer` first.
        """
        return _copy_between(self, cpu_cache, pairs, "swap_out pairs")

    def swap_in(self, cpu_cache: KVCache, pairs: npt.NDArray[Any]) -> Transfer:
        """Copy `cpu_cache`'s blocks into this cache by the `(cpu, gpu)` pairs of `swap_in`.

        Enqueued like `swap_out`: the next forward pass on the current stream reads them after
        the copies, so `confirm_swap_in` may follow at once. Until the returned `Transfer` is
        done the CPU blocks are still being read: keep host code from rewriting them.
        """
        return _copy_between(cpu_cache, self, pairs, "swap_in pairs")


class Transfer:
    """Block copies enqueued on the current CUDA stream (or already done on the CPU)."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        """True once every copy has landed."""
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block the host until every copy has landed."""
        if self.event is not None:
            self.event.synchronize()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (indexed copies have no float8 kernels on every device), any
    other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _check_scales(
    scales: npt.ArrayLike | None, num_layers: int, dtype: torch.dtype
) -> tuple[tuple[float, float], ...]:
    """Per-layer `(k, v)` scales of a float8 cache (ones by default); `()` for other dtypes."""
    if dtype not in FP8_DTYPES:
        if scales is not None:
            raise ValueError(f"scales apply to float8 caches only, this cache is {dtype}")
        return ()
    arr = np.ones((num_layers, 2)) if scales is None else np.asarray(scales, dtype=np.float64)
    if arr.shape != (num_layers, 2):
        raise ValueError(
            f"scales must have shape [num_layers, 2] = [{num_layers}, 2], got {list(arr.shape)}"
        )
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError("scales must be positive and finite")
    return tuple((float(k), float(v)) for k, v in arr)


def _as_bytes(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A host tensor's bytes as a flat numpy array (any dtype, bf16 too): a writable view of
    `t` when `t` is contiguous, else a copy."""
    return t.view(torch.uint8).numpy().reshape(-1)


class HostBlocks:
    """Blocks copied to host memory by `KVCache.read_blocks`, maybe still in flight."""

    def __init__(self, data: torch.Tensor, transfer: Transfer) -> None:
        self.data = data
        self.transfer = transfer

    def ready(self) -> torch.Tensor:
        """`data`, once the copy has landed (waits for it and the work enqueued before it)."""
        self.transfer.wait()
        return self.data


def _copy_between(src: KVCache, dst: KVCache, pairs: npt.NDArray[Any], name: str) -> Transfer:
    """Copy whole blocks `src[p[0]] -> dst[p[1]]` for every pair `p`, every layer.

    Pairs are sorted and merged into runs of consecutive blocks on both sides; each run is one
    copy per layer straight between the two caches (a block is contiguous in each), enqueued
    with `non_blocking=True`, and one event is recorded after the last layer.
    """
    same, other = src.block_format(), dst.block_format()
    if same != other:
        raise ValueError(f"caches differ in their block format: {same} vs {other}")
    if src is dst:
        raise ValueError(f"{name}: source and destination are the same cache; use copy_blocks")
    arr = _pairs(name, pairs, src.num_blocks, dst.num_blocks)
    if np.unique(arr[:, 1]).size != arr.shape[0]:
        raise ValueError(f"{name}: a destination block appears twice")
    runs = _runs(arr)
    for layer in range(src.num_layers):
        s_t, d_t = src.layer(layer), dst.layer(layer)
        for s0, d0, n in runs:
            d_t[d0 : d0 + n].copy_(s_t[s0 : s0 + n], non_blocking=True)
    cuda = next((c.device for c in (src, dst) if c.device.type == "cuda"), None)
    if cuda is None or not runs:
        return Transfer(None)
    return Transfer(torch.cuda.current_stream(cuda).record_event())


def _runs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """`(src, dst, n)` runs covering `pairs`: `src + i -> dst + i` for `i < n`."""
    if pairs.shape[0] == 0:
        return []
    p = pairs[np.argsort(pairs[:, 1], kind="stable")]
    breaks = np.flatnonzero((np.diff(p[:, 0]) != 1) | (np.diff(p[:, 1]) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [p.shape[0]]]))
    return [(int(p[i, 0]), int(p[i, 1]), int(n)) for i, n in zip(starts, lengths, strict=True)]
