"""`PagedAttention`: plan once per step, run per layer, on FlashInfer, Triton or torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from pagedkv._core import Attention, Batch
from pagedkv._device import resolve_device, upload_ints
from pagedkv.attention._device_table import DeviceBlockTable
from pagedkv.attention._flashinfer import DEFAULT_WORKSPACE_BYTES, FlashInferBackend
from pagedkv.attention._plan import PlanLike, StepPlan
from pagedkv.attention._reference import TorchReference
from pagedkv.attention._select import PREFERENCE, unfit_reason
from pagedkv.attention._spec import AttentionSpec
from pagedkv.attention._triton import TritonBackend
from pagedkv.kv_cache import KVCache
from pagedkv.kv_layout import KVLayout, Layout

BackendName = Literal["auto", "flashinfer", "triton", "torch"]


class _Backend(Protocol):
    name: str

    def plan(self, step: StepPlan, graph: bool) -> None: ...

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        scales: tuple[float, float] | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PagedAttention:
    """Causal attention of a step's query tokens over their sequences' paged KV.

    Handles decode, prefill, chunked prefill (the query is the tail of a longer KV) and mixed
    batches, with GQA. Query token `i` of a sequence with `q_len` queries and `kv_len` KV tokens
    sees KV positions `0 ..= kv_len - q_len + i` (causal mask aligned bottom-right).

    Windows come from the plan: a plan whose `attention` (`pagedkv.Attention`, from a windowed
    `BlockManager` or a `HybridManager` group) is a sliding window of `w` lets each query read
    only its last `w` positions, itself included; a chunked-local one only the positions of its
    own chunk. Build one `PagedAttention` per KV-cache group; `attention`, when given, declares
    the attention its plans carry: `auto` then picks a backend that runs it and `plan` refuses
    a plan of another attention (with None every plan's attention is taken as it comes, and a
    backend without it raises `ValueError`). FlashInfer runs sliding windows (`window_left`)
    but has no chunked-local mask: `auto` skips it for chunks, and a plan of chunks raises.

    Attention sinks (gpt-oss): with `sinks=True`, `run` takes `sinks`, a `[num_qo_heads]` float
    tensor of the layer's learned logits; each query head's softmax gets its sink as one more
    logit, in its denominator only (it is not scaled or capped and has no value), so the
    weights on the keys sum to less than one. FlashInfer runs them on float16/bfloat16 KV
    without a soft cap (its attention-sink wrapper); `auto` skips it otherwise.

    `backend="flashinfer"` runs FlashInfer (CUDA, float16/bfloat16), `"triton"` this package's
    Triton kernel (CUDA, float16/bfloat16/float32), `"torch"` the vectorised reference (any
    device and float dtype), and `"auto"` the first of those three that fits the device, dtype
    and head_dim and builds; `backend_reason` says why it was picked. `sm_scale` defaults to
    `1 / sqrt(head_dim)`; `logits_soft_cap`, when given, maps logits `x` to `cap * tanh(x / cap)`
    after scaling.

    Layouts and KV dtypes: `layout` (`"NHD"`, `"HND"` or `"MLA"`, with `rope_dim`) and
    `kv_dtype` (default `dtype`; float8 e4m3/e5m2 caches are read with their scales) must match
    the `KVCache`. For MLA, `num_kv_heads` is 1, `head_dim` the latent width, `q` is
    `[tokens, num_qo_heads, head_dim + rope_dim]` (the K up-projection absorbed into its latent
    part) and the output `[tokens, num_qo_heads, head_dim]`, still in latent space; `sm_scale`
    defaults to `1 / sqrt(head_dim + rope_dim)`. A backend that cannot run a layout or dtype is
    skipped by `auto` (`backend_reason` says why) and raises `ValueError` when named.

    CUDA graphs: with `cuda_graph_batch_sizes`, a decode step of at most the largest size and
    at most `cuda_graph_max_pages` pages is padded to the smallest size that holds it and
    planned into fixed buffers, so `run` may be captured once per size and replayed after each
    later `plan`; `graph_batch_size` then gives the padded size, the rows `q` must have. A
    captured launch keeps the window and the `sinks` tensor it was captured with: the buffers
    serve the attention of the first step planned into them (a decode step of another one runs
    eagerly), and replays must read the same `sinks` tensor (a model's parameter).

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
        kv_dtype: torch.dtype | None = None,
        layout: Layout = "NHD",
        rope_dim: int = 0,
        sm_scale: float | None = None,
        logits_soft_cap: float | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        cuda_graph_batch_sizes: Sequence[int] = (),
        cuda_graph_max_pages: int = 0,
        attention: Attention | None = None,
        sinks: bool = False,
    ) -> None:
        for name, value in (
            ("num_qo_heads", num_qo_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
            ("workspace_bytes", workspace_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        for name, dt in (("dtype", dtype), ("kv_dtype", kv_dtype)):
            if not dt.is_floating_point:
                raise ValueError(f"{name} must be a floating point dtype, got {dt}")
        kv_layout = KVLayout(layout, num_kv_heads, head_dim, rope_dim)
        if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
        if logits_soft_cap is not None and not (
            math.isfinite(logits_soft_cap) and logits_soft_cap > 0
        ):
            raise ValueError(f"logits_soft_cap must be positive and finite, got {logits_soft_cap}")
        if not isinstance(sinks, bool):
            raise ValueError(
                f"sinks must be True or False (run takes the logits), got {type(sinks).__name__}"
            )
        if attention is not None and not isinstance(attention, Attention):
            raise ValueError(
                f"attention must be a pagedkv.Attention or None, got {type(attention).__name__}"
            )
        sizes = sorted(set(cuda_graph_batch_sizes))
        if sizes and (sizes[0] < 1 or cuda_graph_max_pages < 1):
            raise ValueError(
                "cuda_graph_batch_sizes must be >= 1 and cuda_graph_max_pages >= 1, got "
                f"{list(cuda_graph_batch_sizes)} and {cuda_graph_max_pages}"
            )
        self.spec = AttentionSpec(
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim + rope_dim),
            logits_soft_cap=logits_soft_cap,
            dtype=dtype,
            device=resolve_device(device),
            kv_dtype=kv_dtype,
            layout=kv_layout,
            attention=attention,
            sinks=sinks,
        )
        self._graph_sizes = sizes
        self._graph_max_pages = cuda_graph_max_pages
        self._workspace_bytes = workspace_bytes
        if backend == "auto":
            self._impl, self.backend_reason = self._auto()
        elif backend in PREFERENCE:
            self._impl = self._build(backend)
            self.backend_reason = f"backend={backend!r} was requested"
        else:
            raise ValueError(
                f"backend must be 'auto', 'flashinfer', 'triton' or 'torch', got {backend!r}"
            )
        if sizes and self._impl.name == "torch":
            raise ValueError(
                "cuda_graph_batch_sizes needs the flashinfer or triton backend; "
                f"this PagedAttention runs torch ({self.backend_reason})"
            )
        self._step: StepPlan | None = None
        self._graph_attention: Attention | None = None
        self._graph_batch: int | None = None
        self._checked_cache: KVCache | None = None

    def _build(self, backend: str) -> _Backend:
        if backend == "flashinfer":
            return FlashInferBackend(self.spec, self._workspace_bytes, self._graph_max_pages)
        if backend == "triton":
            return TritonBackend(self.spec, self._graph_max_pages)
        return TorchReference(self.spec)

    def _auto(self) -> tuple[_Backend, str]:
        """The first backend of `PREFERENCE` that fits and builds, and why the others did not."""
        skipped: list[str] = []
        for name in PREFERENCE:
            why = unfit_reason(name, self.spec)
            if why is None:
                try:
                    impl = self._build(name)
                except Exception as exc:  # an ABI, CUDA or driver mismatch: fall back, say why
                    why = f"{name} failed to build: {type(exc).__name__}: {exc}"
                else:
                    because = f" because {'; '.join(skipped)}" if skipped else ""
                    return impl, f"auto picked {name}{because}"
            skipped.append(why)
        raise AssertionError("the torch reference always fits")  # pragma: no cover

    @property
    def backend(self) -> str:
        """The backend in use: `"flashinfer"`, `"triton"` or `"torch"`."""
        return self._impl.name

    @property
    def graph_batch_size(self) -> int | None:
        """The padded batch size of the planned step when it uses CUDA-graph buffers, else None.

        `q` then needs that many rows (pad it after the real tokens); output rows past the real
        batch are undefined.
        """
        return self._graph_batch

    def plan(self, plan: PlanLike, *, table: DeviceBlockTable | None = None) -> None:
        """Validate this step's plan and prepare every layer's `run`; call once per step.

        With `table`, `plan` must be a `pagedkv.Batch`: the table is synced from the batch's
        update log and the CSR pages are built from it on the device, so the host handles only
        the row arrays (no `kv_indices`). The table must live on this attention's device and
        follow this batch alone.
        """
        if table is None:
            step = StepPlan.from_plan(plan, self.spec.block_size)
        else:
            step = self._step_from_table(plan, table)
        declared = self.spec.attention
        if declared is not None and step.attention != declared:
            raise ValueError(
                f"plan.attention is {step.attention!r} but this PagedAttention was built with "
                f"attention={declared!r}: plan each KV-cache group with its own PagedAttention"
            )
        bucket = self._bucket(step)
        if bucket is not None:
            step = step.padded_to(bucket)
            if self._graph_attention is None:
                self._graph_attention = step.attention
        self._impl.plan(step, graph=bucket is not None)
        self._step = step
        self._graph_batch = bucket
        self._checked_cache = None

    def _step_from_table(self, plan: PlanLike, table: DeviceBlockTable) -> StepPlan:
        """The step of a persistent batch with its CSR pages built on the device by `table`."""
        if not isinstance(plan, Batch):
            raise TypeError(f"plan(..., table=) needs a pagedkv.Batch, got {type(plan).__name__}")
        if table.device != self.spec.device:
            raise ValueError(
                f"the DeviceBlockTable is on {table.device}, this PagedAttention on "
                f"{self.spec.device}"
            )
        table.sync(plan)
        kv_indptr = plan.kv_indptr
        pages = table.kv_indices(upload_ints(kv_indptr, table.device), int(kv_indptr[-1]))
        return StepPlan.from_device_csr(plan, self.spec.block_size, pages, table.max_block_id)

    def _bucket(self, step: StepPlan) -> int | None:
        """The graph batch size that takes `step`, or None to run it eagerly."""
        if not step.is_decode:
            return None
        bucket = next((s for s in self._graph_sizes if s >= step.batch_size), None)
        # Each padding sequence takes one page.
        if bucket is None or step.nnz + bucket - step.batch_size > (self._graph_max_pages):
            return None
        # A captured launch keeps its window: the buffers serve one attention.
        if self._graph_attention not in (None, step.attention):
            return None
        return bucket

    def run(
        self,
        q: torch.Tensor,
        cache: KVCache,
        layer: int,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output `[tokens, num_qo_heads, head_dim]` for `q`
        `[tokens, num_qo_heads, head_dim + rope_dim]` (`rope_dim` is 0 but for MLA).

        `q` holds the step's query tokens in plan order; `cache` must already hold their K/V
        (see `KVCache.write`). The cache is checked against the plan at its first `run`.
        `sinks` (required with `sinks=True`, refused without) are the layer's `[num_qo_heads]`
        sink logits, a float tensor on this attention's device.
        """
        step = self._step
        if step is None:
            raise RuntimeError("PagedAttention.plan() must be called before run()")
        spec = self.spec
        expected = (step.num_query_tokens, spec.num_qo_heads, spec.qk_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q has shape {tuple(q.shape)}, the plan expects {expected}")
        if q.dtype != spec.dtype or q.device != spec.device:
            raise ValueError(
                f"q is {q.dtype} on {q.device}, this PagedAttention is {spec.dtype} on "
                f"{spec.device}"
            )
        if q.stride(-1) != 1:
            raise ValueError("q must be contiguous in its last dimension")
        if cache is not self._checked_cache:
            self._check_cache(cache, step)
            self._checked_cache = cache
        if sinks is not None:
            sinks = self._checked_sinks(sinks)
        elif spec.sinks:
            raise ValueError("sinks: this PagedAttention was built with sinks=True; pass sinks=")
        return self._impl.run(q, cache.layer(layer), cache.scales(layer), sinks)

    def _checked_sinks(self, sinks: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if not spec.sinks:
            raise ValueError("sinks given, but this PagedAttention was built with sinks=False")
        if tuple(sinks.shape) != (spec.num_qo_heads,) or not sinks.dtype.is_floating_point:
            raise ValueError(
                f"sinks must be a float tensor of shape ({spec.num_qo_heads},), got "
                f"{sinks.dtype} of shape {tuple(sinks.shape)}"
            )
        if sinks.device != spec.device:
            raise ValueError(f"sinks are on {sinks.device}, this PagedAttention on {spec.device}")
        return sinks.contiguous()

    def _check_cache(self, cache: KVCache, step: StepPlan) -> None:
        spec = self.spec
        if cache.block_size != step.block_size:
            raise ValueError(
                f"the cache has block_size={cache.block_size} but the plan has "
                f"block_size={step.block_size}"
            )
        if (cache.block_size, cache.kv_layout) != (spec.block_size, spec.layout):
            raise ValueError(
                f"cache has block_size={cache.block_size} and {cache.kv_layout}; attention "
                f"expects {spec.block_size} and {spec.layout}"
            )
        if cache.dtype != spec.kv_dtype or cache.device != spec.device:
            raise ValueError(
                f"cache is {cache.dtype} on {cache.device}, this PagedAttention reads "
                f"{spec.kv_dtype} KV on {spec.device}"
            )
        if step.max_block_id >= cache.num_blocks:
            raise ValueError(
                f"plan references block {step.max_block_id} but the cache has "
                f"{cache.num_blocks} blocks"
            )
