"""Paged attention in Triton: the GPU backend that needs nothing beyond torch's own wheels.

`plan` turns a step into device arrays (CSR page table, KV lengths, and the tiles the kernel's
programs take, see `_triton_kernel`) through `PlanStaging`, so it never syncs the device; `run`
is one kernel launch per layer. For CUDA graphs, a decode step padded to a bucket size is planned
into that bucket's fixed buffers instead, so a captured launch reads the latest plan.
On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`): slow, but exactly the
kernel code, which is how CI tests it without a GPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from pagedkv._device import compute_capability, triton_interpreter
from pagedkv.attention._plan import IntArray, StepPlan
from pagedkv.attention._spec import AttentionSpec
from pagedkv.attention._staging import PlanStaging

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# An MLA latent row is K and V at once; its rope part has tiles of its own.
MAX_LATENT_DIM, MAX_ROPE_DIM = 512, 128
# float8 conversions need compute capability 8.9+ (Ada, Hopper and later).
FP8_CAPABILITY = (8, 9)
BLOCK_M_DECODE = 16
# Key positions per loop step and prefill rows per program for rows (head_dim padded to a power
# of two) of up to 256 bytes; wider rows take proportionally fewer (at least 16), so a program's
# tiles stay within the shared memory of every sm80+ GPU (about 100 KiB on sm86/sm89).
BLOCK_N, BLOCK_M_PREFILL = 64, 64
ROW_BYTES = 256


def import_triton_kernel() -> ModuleType:
    """Import the kernel module or raise an `ImportError` that says how to get Triton."""
    try:
        return importlib.import_module("pagedkv.attention._triton_kernel")
    except ImportError as exc:
        raise ImportError(
            "backend='triton' needs Triton, which ships with torch's CUDA wheels "
            "(or pip install triton)"
        ) from exc


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the kernel cannot run `spec`'s layout and dtypes (None when it can)."""
    if spec.dtype not in TRITON_DTYPES:
        return "Triton takes float16, bfloat16 and float32 queries"
    if spec.kv_dtype != spec.dtype and not spec.kv_fp8:
        return "Triton reads KV of the query dtype, or float8"
    layout = spec.layout
    if layout.is_mla and (spec.head_dim > MAX_LATENT_DIM or layout.rope_dim > MAX_ROPE_DIM):
        return f"Triton's MLA takes latents up to {MAX_LATENT_DIM} and rope parts up to 128"
    if not layout.is_mla and spec.head_dim > MAX_HEAD_DIM:
        return f"Triton supports head_dim <= {MAX_HEAD_DIM}"
    if spec.kv_fp8 and spec.device.type == "cuda":
        major, minor = compute_capability(spec.device)
        if (major, minor) < FP8_CAPABILITY:
            return f"Triton converts float8 on compute capability 8.9+, the GPU has {major}.{minor}"
    return None


def tile_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """`(BLOCK_D, BLOCK_N, prefill BLOCK_M)` of the kernel for this head_dim and dtype."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    shrink = max(1, block_d * dtype.itemsize // ROW_BYTES)
    return block_d, max(16, BLOCK_N // shrink), max(16, BLOCK_M_PREFILL // shrink)


def tiles(q_lens: np.ndarray, group: int, block_m: int) -> tuple[IntArray, IntArray]:
    """`(tile_seq, tile_row)`: each program's sequence and first row (`row = token * group + g`)."""
    per_seq = (q_lens * group + block_m - 1) // block_m
    seq = np.repeat(np.arange(q_lens.shape[0]), per_seq)
    first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    row = (np.arange(seq.shape[0]) - first) * block_m
    return seq.astype(np.int32), row.astype(np.int32)


@dataclass
class _DeviceStep:
    """One step's arrays on the device, as the kernel reads them."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    tile_seq: torch.Tensor
    tile_row: torch.Tensor
    block_m: int
    window: int | None = None
    chunk: int | None = None

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])


class _GraphBuffers:
    """Fixed device arrays for decode steps padded to `batch` sequences."""

    def __init__(self, spec: AttentionSpec, batch: int, max_pages: int) -> None:
        dev = spec.device
        seq, row = tiles(np.ones(batch, np.int64), spec.group_size, BLOCK_M_DECODE)
        self.step = _DeviceStep(
            qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            kv_indptr=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            kv_lens=torch.ones(batch, dtype=torch.int32, device=dev),
            tile_seq=torch.from_numpy(seq).to(dev),
            tile_row=torch.from_numpy(row).to(dev),
            block_m=BLOCK_M_DECODE,
        )


class TritonBackend:
    """Paged decode and prefill with `_triton_kernel`, on CUDA (or the CPU interpreter)."""

    name = "triton"

    def __init__(self, spec: AttentionSpec, graph_max_pages: int = 0) -> None:
        if spec.device.type != "cuda" and not triton_interpreter():
            raise ValueError(
                f"backend='triton' needs a CUDA device, got {spec.device} "
                "(set TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)"
            )
        why = unsupported(spec)
        if why is not None:
            raise ValueError(f"backend='triton' cannot run the {spec.describe()}: {why}")
        self._kernel = import_triton_kernel().paged_attention_kernel
        self._spec = spec
        self._staging = PlanStaging(spec.device)
        self._graph_max_pages = graph_max_pages
        self._graphs: dict[int, _GraphBuffers] = {}
        self._step: _DeviceStep | None = None
        self._block_d, self._block_n, self._block_m_prefill = tile_sizes(spec.head_dim, spec.dtype)
        self._dot_fp32 = triton_interpreter() and spec.dtype == torch.bfloat16
        exact = spec.dtype == torch.float32 or self._dot_fp32
        self._precision = "ieee" if exact else "tf32"

    def plan(self, step: StepPlan, graph: bool) -> None:
        """Upload this step's arrays (into the bucket's fixed buffers with `graph`)."""
        kv_lens = step.kv_lens.astype(np.int32)
        if graph:
            bufs = self._graphs.get(step.batch_size)
            if bufs is None:
                bufs = _GraphBuffers(self._spec, step.batch_size, self._graph_max_pages)
                self._graphs[step.batch_size] = bufs
            dst = bufs.step
            pairs = [(step.kv_indptr, dst.kv_indptr), (kv_lens, dst.kv_lens)]
            pages = step.device_kv_indices
            if pages is None:
                pairs.append((step.kv_indices, dst.kv_indices))
            else:
                dst.kv_indices[: step.nnz].copy_(pages)
            host = self._staging.stage([array for array, _ in pairs])
            for h, (_, d) in zip(host, pairs, strict=True):
                d[: h.shape[0]].copy_(h, non_blocking=True)
            dst.window, dst.chunk = step.window, step.chunk
            self._step = dst
        else:
            block_m = BLOCK_M_DECODE if step.is_decode else self._block_m_prefill
            seq, row = tiles(step.q_lens, self._spec.group_size, block_m)
            pages = step.device_kv_indices
            host_pages = (step.kv_indices,) if pages is None else ()
            arrays = (step.qo_indptr, step.kv_indptr, kv_lens, seq, row, *host_pages)
            qo, indptr, lens, tseq, trow, *uploaded = self._staging.upload(
                self._staging.stage(arrays)
            )
            indices = uploaded[0] if pages is None else pages
            self._step = _DeviceStep(
                qo, indptr, indices, lens, tseq, trow, block_m, step.window, step.chunk
            )
        self._staging.finish()

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        scales: tuple[float, float] | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One kernel launch over the paged layer `kv` for the planned step; `scales` are the
        layer's float8 scales (None for other dtypes), `sinks` the `[qo_heads]` sink logits."""
        st = self._step
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        spec = self._spec
        mla = spec.layout.is_mla
        out = q.new_empty(q.shape[0], spec.num_qo_heads, spec.head_dim)
        # (block, K/V, slot, head) strides of the layer in its layout; MLA's V is its K.
        if mla:
            strides = (kv.stride(0), 0, kv.stride(1), 0)
        elif spec.layout.name == "HND":
            strides = (kv.stride(0), kv.stride(1), kv.stride(3), kv.stride(2))
        else:
            strides = (kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3))
        first, second = scales or (1.0, 1.0)
        # MLA: the latent's scale serves K and V, the rope part's its own (see the kernel).
        v_scale, pe_scale = (first, second) if mla else (second, 1.0)
        cap = spec.logits_soft_cap
        self._kernel[(st.num_tiles, spec.num_kv_heads)](
            q,
            kv,
            out,
            st.qo_indptr,
            st.kv_indptr,
            st.kv_indices,
            st.kv_lens,
            st.tile_seq,
            st.tile_row,
            q if sinks is None else sinks,  # never read without sinks
            st.window or 0,
            st.chunk or 0,
            spec.sm_scale * first,
            spec.sm_scale * pe_scale,
            v_scale,
            cap if cap is not None else 1.0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *strides,
            PAGE=spec.block_size,
            GROUP=spec.group_size,
            HEAD_DIM=spec.head_dim,
            ROPE_DIM=spec.layout.rope_dim,
            BLOCK_D=self._block_d,
            BLOCK_R=max(16, 1 << (spec.layout.rope_dim - 1).bit_length()),
            MLA=mla,
            BLOCK_M=st.block_m,
            BLOCK_N=self._block_n,
            HAS_CAP=cap is not None,
            HAS_WINDOW=st.window is not None,
            HAS_CHUNK=st.chunk is not None,
            HAS_SINKS=sinks is not None,
            PRECISION=self._precision,
            DOT_FP32=self._dot_fp32,
            num_warps=4,
        )
        return out
