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
from pagedkv.attention._triton import unsupported
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


@pytest.fixture
def on_the_cpu(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The check scaled down to the CPU: float32, 8 query and 2 KV heads of 16, no rows yet."""
    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "DTYPE", torch.float32)
    monkeypatch.setattr(gpu_check, "HQ", 8)
    monkeypatch.setattr(gpu_check, "HKV", 2)
    monkeypatch.setattr(gpu_check, "DIM", 16)
    return gpu_check


def test_window_cases_cover_windows_chunks_and_sinks(on_the_cpu: ModuleType) -> None:
    gpu_check = on_the_cpu
    cases = gpu_check.window_cases(np.random.default_rng(0))
    kinds = {(c.attention.kind if c.attention else "full", c.sinks) for c in cases}
    assert kinds == {
        ("sliding_window", False), ("chunked_local", False),
        ("sliding_window", True), ("chunked_local", True), ("full", True),
    }  # fmt: skip
    assert {c.name.split()[-1] for c in cases} == {"decode", "prefill", "mixed"}
    for case in cases:
        assert all(q <= k for q, k in zip(case.q_lens, case.kv_lens, strict=True))
    # Every case of the check (2 and 8) builds its reference on the CPU.
    for case in gpu_check.all_cases(0):
        assert case.build("torch").spec.sinks == case.sinks


def test_window_checks_pass_on_triton_in_the_interpreter(
    on_the_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The correctness check of windows, chunks and sinks, small, with the Triton kernel in
    # Triton's interpreter: a bug in the check's plans, sinks or comparison fails here. The
    # kernel's own limits stand in for the CUDA device `unfit_reason` asks for.
    monkeypatch.setattr(on_the_cpu, "unfit_reason", lambda backend, spec: unsupported(spec))
    cases = on_the_cpu.window_cases(np.random.default_rng(1), n=4, hi=40, window=8, chunk=16)
    on_the_cpu.check_correctness("triton", 0, cases)
    assert len(on_the_cpu.ROWS) == len(cases) == 15
    assert all(row.ok for row in on_the_cpu.ROWS), on_the_cpu.ROWS


def test_a_windowed_decode_plans_only_the_windows_pages(on_the_cpu: ModuleType) -> None:
    batch, ctx, window, bs = 3, 101, 20, 4
    whole, masked, live = on_the_cpu.window_plans(batch, ctx, window, bs, 90, seed=0)
    # The window's first key, position 81, is in block 20: 6 pages of 21 tokens from there.
    assert (np.diff(live.kv_indptr) == 6).all() and (live.kv_last_page_len == 1).all()
    assert (np.diff(whole.kv_indptr) == 26).all()
    assert live.kv_indices.tolist() == whole.block_tables[:, 20:26].flatten().tolist()
    cache = on_the_cpu.random_cache(90, bs, on_the_cpu.HKV)
    q = torch.randn(batch, 8, on_the_cpu.DIM)
    outs = []
    for plan in (masked, live, whole):
        attn = PagedAttention(8, on_the_cpu.HKV, on_the_cpu.DIM, bs, "torch", dtype=torch.float32)
        attn.plan(plan)
        outs.append(attn.run(q, cache, 0))
    torch.testing.assert_close(outs[1], outs[0])
    assert on_the_cpu.rel_error(outs[2], outs[0]) > 0.1  # the window does narrow attention


def test_warm_up_builds_every_variant_on_triton_in_the_interpreter(
    on_the_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(on_the_cpu, "unfit_reason", lambda backend, spec: unsupported(spec))
    on_the_cpu.warm_up("triton", 0)
    assert "compile/load time triton" in capsys.readouterr().out


def test_window_bench_runs_on_the_cpu(
    on_the_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its plans, checks and report at batch 1 with the reference; the timing is a stand-in.
    def one_call(fn: object, calls: int) -> float:
        fn()  # type: ignore[operator]
        return 1e-3

    monkeypatch.setattr(on_the_cpu, "loop_seconds", one_call)
    on_the_cpu.bench_window_decode("torch", True, 1e12, batch=1)
    check, speed = on_the_cpu.ROWS
    assert check.ok and check.case == "batch 1 ctx 16K window 4K: window pages = whole table"
    assert speed.ok is None and "1.0x faster (4.0x less KV read)" in speed.value, speed
