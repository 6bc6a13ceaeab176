"""Paged attention over a `KVCache`: FlashInfer or Triton on CUDA, a torch reference anywhere."""

from pagedkv.attention._device_table import DeviceBlockTable
from pagedkv.attention._paged import BackendName, PagedAttention
from pagedkv.attention._plan import PlanLike, StepPlan
from pagedkv.attention._tables import TablePlan, plan_from_tables, random_tables

__all__ = [
    "BackendName",
    "DeviceBlockTable",
    "PagedAttention",
    "PlanLike",
    "StepPlan",
    "TablePlan",
    "plan_from_tables",
    "random_tables",
]
