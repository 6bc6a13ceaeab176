"""`PagedAttention`: plan once per step, run per layer, on FlashInfer or the torch reference."""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch

from pagedkv.attention._flashinfer import (
    DEFAULT_WORKSPACE_BYTES,
    FLASHINFER_DTYPES,
    FlashInferBackend,
    flashinfer_available,
)
from pagedkv.attention._plan import PlanLike, StepPlan
from pagedkv.attention._reference import TorchReference
from pagedkv.attention._spec import AttentionSpec
from pagedkv.kv_cache import KVCache, resolve_device

BackendName = Literal["auto", "flashinfer", "torch"]


class _Backend(Protocol):
    name: str

    def plan(self, step: StepPlan) -> None: ...

    def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor: ...


class PagedAttention:
    """Causal attention of a step's query tokens over their sequences' paged KV.

    Handles decode, prefill, chunked prefill (the query is the tail of a longer KV) and mixed
    batches, with GQA. Query token `i` of a sequence with `q_len` queries and `kv_len` KV tokens
    sees KV positions `0 ..= kv_len - q_len + i` (causal mask aligned bottom-right).

    `backend="flashinfer"` runs FlashInfer (CUDA, float16/bfloat16), `"torch"` the vectorised
    reference (any device and float dtype), and `"auto"` FlashInfer when the device is CUDA, the
    dtype is supported and FlashInfer imports, the reference otherwise. `sm_scale` defaults to
    `1 / sqrt(head_dim)`; `logits_soft_cap`, when given, maps logits `x` to `cap * tanh(x / cap)`
    after scaling.

    >>> attn = PagedAttention(8, 2, 64, 16, device="cpu", dtype=torch.float32)
    >>> attn.backend
    'torch'
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        backend: BackendName = "auto",
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float16,
        sm_scale: float | None = None,
        logits_soft_cap: float | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        for name, value in (
            ("num_qo_heads", num_qo_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
        if logits_soft_cap is not None and not (
            math.isfinite(logits_soft_cap) and logits_soft_cap > 0
        ):
            raise ValueError(f"logits_soft_cap must be positive and finite, got {logits_soft_cap}")
        self.spec = AttentionSpec(
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
            logits_soft_cap=logits_soft_cap,
            dtype=dtype,
            device=resolve_device(device),
        )
        self._impl: _Backend
        if backend == "auto":
            backend = "flashinfer" if self._flashinfer_fits() else "torch"
        if backend == "flashinfer":
            self._impl = FlashInferBackend(self.spec, workspace_bytes)
        elif backend == "torch":
            self._impl = TorchReference(self.spec)
        else:
            raise ValueError(f"backend must be 'auto', 'flashinfer' or 'torch', got {backend!r}")
        self._step: StepPlan | None = None

    def _flashinfer_fits(self) -> bool:
        spec = self.spec
        return (
            spec.device.type == "cuda"
            and spec.dtype in FLASHINFER_DTYPES
            and flashinfer_available()
        )

    @property
    def backend(self) -> str:
        """The backend in use: `"flashinfer"` or `"torch"`."""
        return self._impl.name

    def plan(self, plan: PlanLike) -> None:
        """Validate this step's plan and prepare every layer's `run`; call once per step."""
        step = StepPlan.from_plan(plan, self.spec.block_size)
        self._impl.plan(step)
        self._step = step

    def run(self, q: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """Attention output `[tokens, num_qo_heads, head_dim]` for `q` of the same shape.

        `q` holds the step's query tokens in plan order; `cache` must already hold their K/V
        (see `KVCache.write`).
        """
        step = self._step
        if step is None:
            raise RuntimeError("PagedAttention.plan() must be called before run()")
        spec = self.spec
        expected = (step.num_query_tokens, spec.num_qo_heads, spec.head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q has shape {tuple(q.shape)}, the plan expects {expected}")
        if q.dtype != spec.dtype or q.device != spec.device:
            raise ValueError(
                f"q is {q.dtype} on {q.device}, this PagedAttention is {spec.dtype} on "
                f"{spec.device}"
            )
        self._check_cache(cache, step)
        return self._impl.run(q, cache.layer(layer))

    def _check_cache(self, cache: KVCache, step: StepPlan) -> None:
        spec = self.spec
        if cache.block_size != step.block_size:
            raise ValueError(
                f"the cache has block_size={cache.block_size} but the plan has "
                f"block_size={step.block_size}"
            )
        if (cache.block_size, cache.num_kv_heads, cache.head_dim) != (
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
        ):
            raise ValueError(
                f"cache has block_size={cache.block_size}, num_kv_heads={cache.num_kv_heads}, "
                f"head_dim={cache.head_dim}; attention expects {spec.block_size}, "
                f"{spec.num_kv_heads}, {spec.head_dim}"
            )
        if cache.dtype != spec.dtype or cache.device != spec.device:
            raise ValueError(
                f"cache is {cache.dtype} on {cache.device}, this PagedAttention is {spec.dtype} "
                f"on {spec.device}"
            )
        if step.max_block_id >= cache.num_blocks:
            raise ValueError(
                f"plan references block {step.max_block_id} but the cache has "
                f"{cache.num_blocks} blocks"
            )
