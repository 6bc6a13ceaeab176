"""The parts of benches/gpu_check.py that run without a GPU: its plans, its table, its exit code.

The GPU check runs on lent machines with little time; a bug in its plan building or its report
must not cost such a run, so what can be checked on the CPU is checked here.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from pagedkv.attention import PagedAttention, StepPlan
from pagedkv.kv_cache import KVCache


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_correctness_plans_are_valid_and_fit_their_pools(gpu_check: ModuleType) -> None:
    cases = gpu_check.correctness_cases(np.random.default_rng(0))
    assert {c.bs for c in cases} == {1, 16, 32} and {c.group for c in cases} == {1, 4, 8}
    assert any(c.cap for c in cases) and any(c.sm_scale for c in cases)
    for case in cases:
        num_blocks = sum(math.ceil(k / case.bs) for k in case.kv_lens) + 64
        plan = gpu_check.make_plan(case.kv_lens, case.q_lens, case.bs, num_blocks, seed=0)
        step = StepPlan.from_plan(plan, case.bs)
        assert step.kv_lens.tolist() == case.kv_lens and step.q_lens.tolist() == case.q_lens
        assert step.max_block_id < num_blocks
        assert np.unique(step.kv_indices).size == step.kv_indices.size  # distinct blocks


def test_table_and_exit_status(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "ROWS", [])
    gpu_check.record("correct", "triton", "decode", "rel_l2 1.0e-03", True)
    gpu_check.record("decode bw", "triton", "batch 64 ctx 1K", "3000 GB/s", None)
    gpu_check.record("cuda graph", "flashinfer", "bucket 8", "rel_l2 9.9e-01", False)
    gpu_check.print_table()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["check", "backend", "case", "result", "status"]
    assert lines[2].endswith("PASS") and lines[4].endswith("FAIL")
    assert lines[3].endswith("GB/s")  # a measurement has no status
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick"])
        assert gpu_check.main() == 2


def test_persistent_batch_check_runs_on_the_cpu(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check's own logic, scaled down, on the CPU with the torch reference.
    def cpu_cache(num_blocks: int, bs: int, hkv: int) -> KVCache:
        cache = KVCache(1, num_blocks, bs, hkv, gpu_check.DIM, dtype=torch.float32)
        cache.layer(0).normal_()
        return cache

    def cpu_attention(backend: str) -> PagedAttention:
        hq, hkv, dim, bs = gpu_check.HQ, gpu_check.HKV, gpu_check.DIM, gpu_check.BS
        return PagedAttention(hq, hkv, dim, bs, backend, dtype=torch.float32)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check, "DTYPE", torch.float32)
    monkeypatch.setattr(gpu_check, "random_cache", cpu_cache)
    monkeypatch.setattr(gpu_check, "attention", cpu_attention)
    gpu_check.check_persistent_batch("torch", rows=3, context=40, steps=20, device="cpu")
    (row,) = gpu_check.ROWS
    assert row.check == "persistent" and row.ok, row


def test_layout_cases_build_on_the_cpu(gpu_check: ModuleType) -> None:
    # Each layout case's cache and reference attention, and one decode step through them.
    for lc in gpu_check.LAYOUTS:
        fp8 = lc.kv_dtype.itemsize == 1
        cache = KVCache(
            1,
            4,
            16,
            lc.hkv,
            lc.dim,
            lc.kv_dtype,
            layout=lc.layout,
            rope_dim=lc.rope_dim,
            scales=[[0.02, 0.03]] if fp8 else None,
        )
        attn = PagedAttention(
            lc.hq,
            lc.hkv,
            lc.dim,
            16,
            "torch",
            dtype=lc.dtype,
            kv_dtype=lc.kv_dtype,
            layout=lc.layout,
            rope_dim=lc.rope_dim,
        )
        attn.plan(gpu_check.make_plan([20], [1], 16, 4, seed=0))
        out = attn.run(torch.ones(1, lc.hq, lc.dim + lc.rope_dim, dtype=lc.dtype), cache, 0)
        assert out.shape == (1, lc.hq, lc.dim)
    names = {lc.name.split()[0] for lc in gpu_check.LAYOUTS}
    assert names == {"NHD", "HND", "MLA"}
