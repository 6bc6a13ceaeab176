"""Paged attention through FlashInfer's batch decode and batch prefill wrappers.

FlashInfer is optional: it is imported only when this backend is built, so `import pagedkv` never
needs it. One float workspace buffer is shared by every wrapper (a step uses exactly one, and
steps are ordered on the stream). `plan` hands FlashInfer the indptr and last-page lengths as
pinned host tensors (FlashInfer derives its schedule from them on the CPU and uploads them with
asynchronous copies) and the page indices as a device tensor, all through `PlanStaging`, and
passes `non_blocking=True`, so planning never waits for the device.

The cache's layout is FlashInfer's `kv_layout` (NHD or HND); an MLA cache is planned into
`BatchMLAPagedAttentionWrapper` (packed query and latent rows, CSR metadata) for decode and
prefill alike. Float8 caches pass their layer's scales to `run` (`k_scale` / `v_scale`, or the
MLA wrapper's `ckv_scale` / `kpe_scale`). A sliding window is the wrappers' `window_left`
(`window - 1`, keys relative to the plan's first page like the other backends' masks); FlashInfer
has no chunked-local mask, and its MLA wrapper no window.

Attention sinks run on `BatchAttentionWithAttentionSinkWrapper`, FlashInfer's paged prefill
wrapper built with its attention-sink variant (a JIT module per dtype, head_dim and whether a
window is used), for decode and prefill steps alike: `run` takes the `[num_qo_heads]` float32
sink logits and `sm_scale` after the cache. The variant has no logits soft cap and applies no K
scale, so sinks run on float16/bfloat16 KV without a soft cap only.

All wrappers run FlashInfer's FA2 kernels (`backend="fa2"`): the tensor-core decode and the
prefill then share one compiled module per dtype, head_dim and soft-cap setting, so a machine
that JIT-compiles builds the fewest kernels, and no path silently moves to another kernel family.

CUDA graphs: decode steps padded to a batch-size bucket use one more decode wrapper per bucket,
built with `use_cuda_graph=True` and fixed indptr / indices / last-page buffers, so a `run`
captured in a graph reads whatever the latest `plan` for that bucket wrote.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pagedkv._core import Attention
from pagedkv._device import compute_capability
from pagedkv.attention._plan import StepPlan
from pagedkv.attention._spec import AttentionSpec
from pagedkv.attention._staging import PlanStaging

# FA2 split-KV prefill with 64 query / 8 KV heads, head_dim 128 on 132+ SMs needs about
# 132-155 MiB of float workspace; 384 MiB leaves room for larger models.
DEFAULT_WORKSPACE_BYTES = 384 * 1024 * 1024
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# head_dims FlashInfer ships prebuilt kernels for; any other one is compiled with nvcc.
PREBUILT_HEAD_DIMS = (64, 128, 256)
# Its prebuilt attention-sink modules are gpt-oss's alone.
PREBUILT_SINK_HEAD_DIMS = (64,)
KERNELS = "fa2"
# The one float8 MLA FlashInfer runs: (KV dtype, query dtype, latent width, rope width).
MLA_FP8 = (torch.float8_e4m3fn, torch.bfloat16, 512, 64)


def import_flashinfer() -> ModuleType:
    """Import FlashInfer or raise an `ImportError` that says how to get it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            "backend='flashinfer' needs FlashInfer: pip install 'pagedkv[flashinfer]' "
            "(see the README for installing it from wheels on a machine without network)"
        ) from exc


def unsupported_attention(attention: Attention, mla: bool) -> str | None:
    """Why these wrappers cannot run `attention` (None when they can)."""
    if attention.kind == "chunked_local":
        return "FlashInfer's paged wrappers have no chunked-local attention"
    if attention.kind == "sliding_window" and mla:
        return "FlashInfer's MLA has no sliding window"
    return None


def unsupported(spec: AttentionSpec) -> str | None:
    """Why FlashInfer has no kernel for `spec`'s layout, dtypes, attention and sinks (None when
    it has one)."""
    if spec.attention is not None:
        why = unsupported_attention(spec.attention, spec.layout.is_mla)
        if why is not None:
            return why
    if spec.dtype not in FLASHINFER_DTYPES:
        return "FlashInfer takes float16 and bfloat16 queries"
    if spec.kv_dtype != spec.dtype and not spec.kv_fp8:
        return "FlashInfer reads KV of the query dtype, or float8"
    if spec.sinks:
        if spec.layout.is_mla:
            return "FlashInfer's MLA takes no attention sinks"
        if spec.kv_fp8:
            return "FlashInfer's attention-sink wrapper has no float8 KV scales"
        if spec.logits_soft_cap is not None:
            return "FlashInfer's attention-sink wrapper has no logits soft cap"
    layout = spec.layout
    if not layout.is_mla:
        return None
    if spec.head_dim % 128 or layout.rope_dim % 64:
        return "FlashInfer's MLA needs a latent width divisible by 128, a rope part by 64"
    if spec.logits_soft_cap is not None:
        return "FlashInfer's MLA has no logits soft cap"
    if spec.kv_fp8:
        if (spec.kv_dtype, spec.dtype, spec.head_dim, layout.rope_dim) != MLA_FP8:
            return "FlashInfer's float8 MLA takes e4m3 KV, bfloat16 queries, latent 512, rope 64"
        major, minor = compute_capability(spec.device)
        if major != 9:
            return (
                f"FlashInfer's float8 MLA needs compute capability 9.x, the GPU has {major}.{minor}"
            )
    return None


def check_spec(spec: AttentionSpec) -> None:
    """Raise `ValueError` unless FlashInfer has kernels for `spec`'s device, layout and dtypes."""
    if spec.device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs a CUDA device, got {spec.device}")
    why = unsupported(spec)
    if why is not None:
        raise ValueError(f"backend='flashinfer' cannot run the {spec.describe()}: {why}")


class FlashInferBackend:
    """FlashInfer decode (tensor cores) for all-decode steps, paged prefill for the rest; the
    MLA wrapper for every step of an MLA cache."""

    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, workspace_bytes: int, graph_max_pages: int = 0) -> None:
        check_spec(spec)
        self._fi = import_flashinfer()
        self._spec = spec
        self._mla = spec.layout.is_mla
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=spec.device)
        # Sink wrappers by (windowed, graph batch size or None), built at their first plan.
        self._sink_wrappers: dict[tuple[bool, int | None], Any] = {}
        if self._mla:
            self._eager: Any = self._fi.BatchMLAPagedAttentionWrapper(
                self._workspace, backend=KERNELS
            )
        elif not spec.sinks:
            layout = spec.layout.name
            self._decode: Any = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, layout, use_tensor_cores=True, backend=KERNELS
            )
            self._prefill: Any = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, layout, backend=KERNELS
            )
        self._graph_max_pages = graph_max_pages
        self._graph_decode: dict[int, Any] = {}
        self._staging = PlanStaging(spec.device)
        self._active: Any = None

    def _graph_wrapper(self, batch: int) -> Any:
        """The decode wrapper with fixed buffers for padded batch size `batch`."""
        wrapper = self._graph_decode.get(batch)
        if wrapper is None:
            dev = self._spec.device

            def buf(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=dev)

            if self._mla:
                wrapper = self._fi.BatchMLAPagedAttentionWrapper(
                    self._workspace,
                    use_cuda_graph=True,
                    qo_indptr=buf(batch + 1),
                    kv_indptr=buf(batch + 1),
                    kv_indices=buf(self._graph_max_pages),
                    kv_len_arr=buf(batch),
                    backend=KERNELS,
                )
            else:
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    self._spec.layout.name,
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=buf(batch + 1),
                    paged_kv_indices_buffer=buf(self._graph_max_pages),
                    paged_kv_last_page_len_buffer=buf(batch),
                    backend=KERNELS,
                )
            self._graph_decode[batch] = wrapper
        return wrapper

    def _sink_wrapper(self, windowed: bool, graph_batch: int | None) -> Any:
        """The attention-sink wrapper with or without a window, with fixed buffers for padded
        batch size `graph_batch` (None: eager)."""
        key = (windowed, graph_batch)
        wrapper = self._sink_wrappers.get(key)
        if wrapper is None:
            spec = self._spec
            graph: dict[str, Any] = {}
            if graph_batch is not None:

                def buf(n: int) -> torch.Tensor:
                    return torch.zeros(n, dtype=torch.int32, device=spec.device)

                graph = {
                    "use_cuda_graph": True,
                    "qo_indptr_buf": buf(graph_batch + 1),
                    "paged_kv_indptr_buf": buf(graph_batch + 1),
                    "paged_kv_indices_buf": buf(self._graph_max_pages),
                    "paged_kv_last_page_len_buf": buf(graph_batch),
                }
            wrapper = self._fi.BatchAttentionWithAttentionSinkWrapper(
                self._workspace,
                spec.layout.name,
                backend=KERNELS,
                q_data_type=spec.dtype,
                kv_data_type=spec.kv_dtype,
                head_dim_qk=spec.head_dim,
                head_dim_vo=spec.head_dim,
                window_left=0 if windowed else -1,  # selects the module; plan sets the window
                **graph,
            )
            self._sink_wrappers[key] = wrapper
        return wrapper

    def plan(self, step: StepPlan, graph: bool) -> None:
        """Plan the decode, prefill or MLA wrapper for this step (see the module docstring).

        With `graph`, `step` is a decode step already padded to a bucket size.
        """
        spec = self._spec
        why = unsupported_attention(step.attention, self._mla)
        if why is not None:
            raise ValueError(
                f"plan.attention is {step.attention!r}: backend='flashinfer' cannot run it: {why}"
            )
        pages = step.device_kv_indices
        host_pages = (step.kv_indices,) if pages is None else ()
        if self._mla:
            kv_lens = step.kv_lens.astype(np.int32)
            qo, indptr, lens, *indices_host = self._staging.stage(
                (step.qo_indptr, step.kv_indptr, kv_lens, *host_pages)
            )
            uploaded = self._staging.upload((qo, indptr, lens, *indices_host))
            indices = uploaded[3] if pages is None else pages
            wrapper = self._graph_wrapper(step.batch_size) if graph else self._eager
            fp8 = {"scale_mode": "kv-per-tensor"} if spec.kv_fp8 else {}
            wrapper.plan(
                metadata=self._fi.mla.MLAPlanMetadata.csr(qo, indptr, indices, lens),
                num_heads=spec.num_qo_heads,
                head_dim_ckv=spec.head_dim,
                head_dim_kpe=spec.layout.rope_dim,
                page_size=spec.block_size,
                causal=True,
                sm_scale=spec.sm_scale,
                q_data_type=spec.dtype,
                kv_data_type=spec.kv_dtype,
                **fp8,
            )
        elif step.is_decode and not spec.sinks:
            indptr, last, *indices_host = self._staging.stage(
                (step.kv_indptr, step.kv_last_page_len, *host_pages)
            )
            uploaded = self._staging.upload((indptr, last, *indices_host))
            indices = uploaded[2] if pages is None else pages
            wrapper = self._graph_wrapper(step.batch_size) if graph else self._decode
            wrapper.plan(
                indptr,
                indices,
                last,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                **self._common_kwargs(step),
            )
        else:
            qo, indptr, last, *indices_host = self._staging.stage(
                (step.qo_indptr, step.kv_indptr, step.kv_last_page_len, *host_pages)
            )
            uploaded = self._staging.upload((qo, indptr, last, *indices_host))
            indices = uploaded[3] if pages is None else pages
            if spec.sinks:
                windowed = step.attention.window_left >= 0
                wrapper = self._sink_wrapper(windowed, step.batch_size if graph else None)
            else:
                wrapper = self._prefill
            wrapper.plan(
                qo,
                indptr,
                indices,
                last,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                causal=True,
                **self._common_kwargs(step),
            )
        self._staging.finish()
        self._active = wrapper

    def _common_kwargs(self, step: StepPlan) -> dict[str, Any]:
        """Keyword arguments both wrappers' `plan` take (names checked against FlashInfer)."""
        spec = self._spec
        return {
            "pos_encoding_mode": "NONE",
            "window_left": step.attention.window_left,
            "logits_soft_cap": spec.logits_soft_cap,
            "sm_scale": spec.sm_scale,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.kv_dtype,
            "non_blocking": True,
        }

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        scales: tuple[float, float] | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the planned wrapper on one layer's cache tensor, with its float8 scales."""
        if self._active is None:
            raise RuntimeError("plan() must be called before run()")
        out: torch.Tensor
        if self._spec.sinks:
            if sinks is None:  # PagedAttention checks `sinks` against the spec
                raise ValueError("sinks: this backend was built with sinks=True; pass them")
            # The variant's extra tensor and scalar, after the cache: float32 sinks, sm_scale.
            out = self._active.run(q, kv, sinks.float(), self._spec.sm_scale)
        elif self._mla:
            fp8 = {} if scales is None else {"ckv_scale": scales[0], "kpe_scale": scales[1]}
            out = self._active.run(query=q, kv_cache=kv, **fp8)
        else:
            fp8 = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
            out = self._active.run(q, kv, **fp8)
        return out
