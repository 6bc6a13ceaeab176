"""CUDA-graph decode: `run` captured per batch-size bucket, replayed after new plans, equals eager.

Needs CUDA (and FlashInfer for its backend); skipped otherwise. The CPU-side part (padding to a
bucket, fixed buffers) is tested in `test_triton_attention.py` and `test_flashinfer_calls.py`.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from attention_cases import TOL

from pagedkv import Attention
from pagedkv.attention import PagedAttention, TablePlan, plan_from_tables
from pagedkv.kv_cache import KVCache

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("backend", "window", "sinks"),
    [
        ("triton", None, False),
        ("flashinfer", None, False),
        ("triton", 128, True),
        ("flashinfer", 128, False),
    ],
)
def test_graph_replay_matches_eager(backend: str, window: int | None, sinks: bool) -> None:
    """Replays read each new plan, a sliding window's pages included (the window itself is
    captured: one PagedAttention per KV-cache group), and the captured sinks tensor."""
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs FlashInfer")
    hq, hkv, dim, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    what = Attention.full() if window is None else Attention.sliding_window(window)
    sink = torch.linspace(-1.0, 1.0, hq, device="cuda").to(dtype) if sinks else None

    def attention(**kw: object) -> PagedAttention:
        return PagedAttention(
            hq,
            hkv,
            dim,
            bs,
            backend,
            device="cuda",
            dtype=dtype,
            sinks=sinks,
            **kw,  # type: ignore[arg-type]
        )

    graphed = attention(cuda_graph_batch_sizes=(4, 8), cuda_graph_max_pages=512)
    eager = attention()
    cache = KVCache(1, 512, bs, hkv, dim, dtype, "cuda")
    cache.layer(0).normal_()
    rng = np.random.default_rng(1)

    def plan_of(kv_lens: list[int]) -> TablePlan:
        tables = [rng.permutation(512)[:64] for _ in kv_lens]
        return plan_from_tables(tables, kv_lens, [1] * len(kv_lens), bs, what)

    static_q = torch.zeros(8, hq, dim, dtype=dtype, device="cuda")
    graphed.plan(plan_of([100] * 8))
    graphed.run(static_q, cache, 0, sinks=sink)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graphed.run(static_q, cache, 0, sinks=sink)
    for kv_lens in ([5, 900, 33, 1, 7, 600, 64, 16], [1000] * 6, [1, 2, 3, 4, 5]):
        plan = plan_of(kv_lens)
        graphed.plan(plan)
        assert graphed.graph_batch_size == 8
        q = torch.randn(len(kv_lens), hq, dim, dtype=dtype, device="cuda")
        static_q.zero_()
        static_q[: len(kv_lens)] = q
        graph.replay()
        eager.plan(plan)
        want = eager.run(q, cache, 0, sinks=sink)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(static_out[: len(kv_lens)], want, atol=atol, rtol=rtol)
