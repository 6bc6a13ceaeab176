"""Paged attention through FlashInfer's batch decode and batch prefill wrappers.

FlashInfer is optional: it is imported only when this backend is built, so `import pagedkv` never
needs it. One float workspace buffer is shared by both wrappers (a step uses exactly one of them,
and steps are ordered on the stream). `plan` hands FlashInfer the indptr and last-page lengths as
host tensors, so FlashInfer's own planning reads them without a device sync, and the page indices
as a device tensor uploaded through `_IndexRing`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pagedkv.attention._plan import IntArray, StepPlan
from pagedkv.attention._spec import AttentionSpec

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer() -> ModuleType:
    """Import FlashInfer or raise an `ImportError` that says how to get it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            "backend='flashinfer' needs FlashInfer: pip install 'pagedkv[flashinfer]' "
            "(see the README for installing it from wheels on a machine without network)"
        ) from exc


def flashinfer_available() -> bool:
    """True when FlashInfer imports."""
    try:
        import_flashinfer()
    except ImportError:
        return False
    return True


class _IndexRing:
    """Two pinned host buffers and two device buffers for page indices, used in turn.

    Step N writes the pair step N-2 used; `FlashInferBackend.plan` makes sure the GPU is past
    step N-2 first. Each upload is an asynchronous copy from pinned memory.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self._device = device
        self._host = [self._pinned(capacity), self._pinned(capacity)]
        self._dev = [self._on_device(capacity), self._on_device(capacity)]
        self._turn = 0

    @staticmethod
    def _pinned(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=True)

    def _on_device(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=self._device)

    def upload(self, indices: IntArray) -> torch.Tensor:
        """Copy `indices` to the device; return the device view that holds them."""
        self._turn ^= 1
        t, n = self._turn, int(indices.shape[0])
        if n > self._host[t].shape[0]:
            size = max(n, 2 * self._host[t].shape[0])
            self._host[t], self._dev[t] = self._pinned(size), self._on_device(size)
        np.copyto(self._host[t][:n].numpy(), indices)
        dst = self._dev[t][:n]
        dst.copy_(self._host[t][:n], non_blocking=True)
        return dst


class FlashInferBackend:
    """FlashInfer decode (tensor cores) for all-decode steps, paged prefill for the rest."""

    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        if spec.device.type != "cuda":
            raise ValueError(f"backend='flashinfer' needs a CUDA device, got {spec.device}")
        if spec.dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"backend='flashinfer' supports float16 and bfloat16, got {spec.dtype}"
            )
        fi = import_flashinfer()
        self._spec = spec
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=spec.device)
        self._decode: Any = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True
        )
        self._prefill: Any = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._indices = _IndexRing(spec.device)
        self._active: Any = None
        self._planned: torch.cuda.Event | None = None

    def plan(self, step: StepPlan) -> None:
        """Plan the decode or the prefill wrapper for this step.

        Nothing here waits for the device except one event: the one recorded after the previous
        step's plan. Once the GPU passes it, the step before that has finished (so the index
        buffers it read may be rewritten) and the previous plan's own uploads, ours and those
        FlashInfer makes from its pinned buffer, have landed (so that buffer may be rewritten).
        So the host blocks only when it gets more than one step ahead of the GPU.
        """
        spec = self._spec
        if self._planned is not None:
            self._planned.synchronize()
        indices = self._indices.upload(step.kv_indices)
        # Host tensors: FlashInfer derives its schedule from them on the CPU and copies them to
        # the device itself; pageable sources are staged by the driver before the call returns.
        indptr = torch.from_numpy(step.kv_indptr)
        last = torch.from_numpy(step.kv_last_page_len)
        common: dict[str, Any] = {
            "logits_soft_cap": spec.logits_soft_cap,
            "sm_scale": spec.sm_scale,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.dtype,
        }
        if step.is_decode:
            self._decode.plan(
                indptr,
                indices,
                last,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                pos_encoding_mode="NONE",
                **common,
            )
            self._active = self._decode
        else:
            self._prefill.plan(
                torch.from_numpy(step.qo_indptr),
                indptr,
                indices,
                last,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                causal=True,
                pos_encoding_mode="NONE",
                **common,
            )
            self._active = self._prefill
        self._planned = torch.cuda.current_stream(spec.device).record_event()

    def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Run the planned wrapper on one layer's NHD cache tensor."""
        if self._active is None:
            raise RuntimeError("plan() must be called before run()")
        out: torch.Tensor = self._active.run(q, kv)
        return out
