"""Paged attention over a `KVCache`: FlashInfer on CUDA, a vectorised torch reference anywhere."""

from pagedkv.attention._paged import BackendName, PagedAttention
from pagedkv.attention._plan import PlanLike, StepPlan

__all__ = ["BackendName", "PagedAttention", "PlanLike", "StepPlan"]
