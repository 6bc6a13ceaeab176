"""Paged attention through FlashInfer's batch decode and batch prefill wrappers.

FlashInfer is optional: it is imported only when this backend is built, so `import pagedkv` never
needs it. One float workspace buffer is shared by every wrapper (a step uses exactly one, and
steps are ordered on the stream). `plan` hands FlashInfer the indptr and last-page lengths as
pinned host tensors (FlashInfer derives its schedule from them on the CPU and uploads them with
asynchronous copies) and the page indices as a device tensor, all through `PlanStaging`, and
passes `non_blocking=True`, so planning never waits for the device.

Both wrappers run FlashInfer's FA2 kernels (`backend="fa2"`): the tensor-core decode and the
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

import torch

from pagedkv.attention._plan import StepPlan
from pagedkv.attention._spec import AttentionSpec
from pagedkv.attention._staging import PlanStaging

# FA2 split-KV prefill with 64 query / 8 KV heads, head_dim 128 on 132+ SMs needs about
# 132-155 MiB of float workspace; 384 MiB leaves room for larger models.
DEFAULT_WORKSPACE_BYTES = 384 * 1024 * 1024
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# head_dims FlashInfer ships prebuilt kernels for; any other one is compiled with nvcc.
PREBUILT_HEAD_DIMS = (64, 128, 256)
KERNELS = "fa2"


def import_flashinfer() -> ModuleType:
    """Import FlashInfer or raise an `ImportError` that says how to get it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            "backend='flashinfer' needs FlashInfer: pip install 'pagedkv[flashinfer]' "
            "(see the README for installing it from wheels on a machine without network)"
        ) from exc


def check_spec(spec: AttentionSpec) -> None:
    """Raise `ValueError` unless FlashInfer has kernels for `spec`'s device and dtype."""
    if spec.device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs a CUDA device, got {spec.device}")
    if spec.dtype not in FLASHINFER_DTYPES:
        raise ValueError(f"backend='flashinfer' supports float16 and bfloat16, got {spec.dtype}")


class FlashInferBackend:
    """FlashInfer decode (tensor cores) for all-decode steps, paged prefill for the rest."""

    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, workspace_bytes: int, graph_max_pages: int = 0) -> None:
        check_spec(spec)
        self._fi = import_flashinfer()
        self._spec = spec
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=spec.device)
        self._decode: Any = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend=KERNELS
        )
        self._prefill: Any = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=KERNELS
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

            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=buf(batch + 1),
                paged_kv_indices_buffer=buf(self._graph_max_pages),
                paged_kv_last_page_len_buffer=buf(batch),
                backend=KERNELS,
            )
            self._graph_decode[batch] = wrapper
        return wrapper

    def plan(self, step: StepPlan, graph: bool) -> None:
        """Plan the decode or the prefill wrapper for this step (see the module docstring).

        With `graph`, `step` is a decode step already padded to a bucket size.
        """
        spec = self._spec
        pages = step.device_kv_indices
        host_pages = (step.kv_indices,) if pages is None else ()
        if step.is_decode:
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
                **self._common_kwargs(),
            )
        else:
            qo, indptr, last, *indices_host = self._staging.stage(
                (step.qo_indptr, step.kv_indptr, step.kv_last_page_len, *host_pages)
            )
            uploaded = self._staging.upload((qo, indptr, last, *indices_host))
            indices = uploaded[3] if pages is None else pages
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
                **self._common_kwargs(),
            )
        self._staging.finish()
        self._active = wrapper

    def _common_kwargs(self) -> dict[str, Any]:
        """Keyword arguments both wrappers' `plan` take (names checked against FlashInfer)."""
        spec = self._spec
        return {
            "pos_encoding_mode": "NONE",
            "logits_soft_cap": spec.logits_soft_cap,
            "sm_scale": spec.sm_scale,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.dtype,
            "non_blocking": True,
        }

    def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Run the planned wrapper on one layer's NHD cache tensor."""
        if self._active is None:
            raise RuntimeError("plan() must be called before run()")
        out: torch.Tensor = self._active.run(q, kv)
        return out
