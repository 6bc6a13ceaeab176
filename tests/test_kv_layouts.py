"""KV layouts (NHD, HND, MLA) and dtypes (float, float8 with scales) end to end on the CPU.

Every layout x KV dtype x phase: the torch reference against dense attention over the
dequantized KV, and the Triton kernel (Triton's interpreter without CUDA) against dense too.
Block moves (copy-on-write, swaps, host reads and writes) keep every layout's bytes, and bad
combinations are refused with a message that names them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from attention_cases import MIXES, Batch, assert_close, expected_output, random_batch

import pagedkv.attention._flashinfer as fi_backend
from pagedkv.attention import PagedAttention, plan_from_tables
from pagedkv.attention._select import unfit_reason
from pagedkv.attention._spec import AttentionSpec
from pagedkv.kv_cache import KVCache
from pagedkv.kv_layout import KVLayout, Layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS: list[Layout] = ["NHD", "HND", "MLA"]
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
PHASES = [*sorted(MIXES), "prefix"]
E4M3 = torch.float8_e4m3fn
# Scales that move values well inside float8's range, so a wrong or missing scale shows.
SCALES = (0.02, 0.05)


def query_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """Float KV is read by queries of its dtype; float8 by float32 queries, so the comparison
    with dense attention over the dequantized KV is tight."""
    return torch.float32 if kv_dtype.itemsize == 1 else kv_dtype


def layout_batch(
    layout: Layout,
    kv_dtype: torch.dtype,
    phase: str,
    seed: int,
    bs: int = 16,
    dtype: torch.dtype | None = None,
) -> Batch:
    """A random batch of `phase` (a `MIXES` key, or `prefix`: mixed with shared prefix blocks)."""
    mla = layout == "MLA"
    shapes = MIXES["mixed" if phase == "prefix" else phase]
    return random_batch(
        seed,
        shapes,
        hq=8,
        hkv=1 if mla else 2,
        dim=32 if mla else 16,
        bs=bs,
        dtype=query_dtype(kv_dtype) if dtype is None else dtype,
        shared_prefix_blocks=2 if phase == "prefix" else 0,
        layout=layout,
        kv_dtype=kv_dtype,
        rope_dim=16 if mla else 0,
        scales=SCALES,
    )


def attention_for(
    batch_cache: KVCache, hq: int, backend: str, dtype: torch.dtype
) -> PagedAttention:
    c = batch_cache
    return PagedAttention(
        hq,
        c.num_kv_heads,
        c.head_dim,
        c.block_size,
        backend,  # type: ignore[arg-type]
        device=DEVICE if backend == "triton" else "cpu",
        dtype=dtype,
        kv_dtype=c.dtype,
        layout=c.layout,
        rope_dim=c.rope_dim,
    )


def scale(batch_cache: KVCache) -> float:
    return 1 / math.sqrt(batch_cache.head_dim + batch_cache.rope_dim)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_matches_dense_on_dequantized_kv(
    layout: Layout, kv_dtype: torch.dtype, phase: str
) -> None:
    batch = layout_batch(layout, kv_dtype, phase, seed=len(phase) + kv_dtype.itemsize)
    dtype = batch.q.dtype
    attn = attention_for(batch.cache, 8, "torch", dtype)
    attn.plan(batch.plan)
    out = attn.run(batch.q, batch.cache, 0)
    assert out.shape == (batch.q.shape[0], 8, batch.cache.head_dim) and out.dtype == dtype
    assert_close(out, expected_output(batch, scale(batch.cache)), dtype)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_matches_dense_on_dequantized_kv(
    layout: Layout, kv_dtype: torch.dtype, phase: str
) -> None:
    batch = layout_batch(layout, kv_dtype, phase, seed=3 + len(phase), bs=4)
    cache = batch.cache if DEVICE == "cpu" else on_device(batch.cache)
    dtype = batch.q.dtype
    attn = attention_for(cache, 8, "triton", dtype)
    attn.plan(batch.plan)
    out = attn.run(batch.q.to(DEVICE), cache, 0).cpu()
    assert_close(out, expected_output(batch, scale(batch.cache)), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float8_with_half_precision_queries(layout: Layout) -> None:
    # The serving case: bfloat16 queries over an e4m3 cache, on both backends.
    batch = layout_batch(layout, E4M3, "mixed", seed=9, dtype=torch.bfloat16)
    want = expected_output(batch, scale(batch.cache))
    for backend in ("torch", "triton"):
        cache = batch.cache if backend == "torch" or DEVICE == "cpu" else on_device(batch.cache)
        attn = attention_for(cache, 8, backend, torch.bfloat16)
        attn.plan(batch.plan)
        assert_close(attn.run(batch.q.to(attn.spec.device), cache, 0).cpu(), want, torch.bfloat16)


def test_scales_are_applied() -> None:
    # The same stored bytes read with other scales give another answer: the scales are used.
    batch = layout_batch("NHD", E4M3, "decode", seed=1)
    attn = attention_for(batch.cache, 8, "torch", torch.float32)
    attn.plan(batch.plan)
    out = attn.run(batch.q, batch.cache, 0)
    k_scale, v_scale = SCALES
    doubled_v = KVCache(1, batch.cache.num_blocks, 16, 2, 16, E4M3, scales=[[k_scale, 2 * v_scale]])
    doubled_v.layer(0).copy_(batch.cache.layer(0))
    torch.testing.assert_close(attn.run(batch.q, doubled_v, 0), 2 * out, rtol=1e-5, atol=1e-6)
    doubled_k = KVCache(1, batch.cache.num_blocks, 16, 2, 16, E4M3, scales=[[2 * k_scale, v_scale]])
    doubled_k.layer(0).copy_(batch.cache.layer(0))
    assert not torch.allclose(attn.run(batch.q, doubled_k, 0), out, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_graph_buckets_for_every_layout(layout: Layout) -> None:
    batch = layout_batch(layout, E4M3, "decode", seed=5, bs=4)
    cache = batch.cache if DEVICE == "cpu" else on_device(batch.cache)
    c = cache
    kwargs = {"cuda_graph_batch_sizes": (8,), "cuda_graph_max_pages": 64}
    graphed = PagedAttention(
        8,
        c.num_kv_heads,
        c.head_dim,
        4,
        "triton",
        device=DEVICE,
        dtype=torch.float32,
        kv_dtype=E4M3,
        layout=layout,
        rope_dim=c.rope_dim,
        **kwargs,  # type: ignore[arg-type]
    )
    graphed.plan(batch.plan)
    assert graphed.graph_batch_size == 8
    q = torch.cat([batch.q, batch.q.new_zeros(8 - batch.q.shape[0], *batch.q.shape[1:])])
    out = graphed.run(q.to(DEVICE), cache, 0)[: batch.q.shape[0]].cpu()
    assert_close(out, expected_output(batch, scale(batch.cache)), torch.float32)


def on_device(cache: KVCache) -> KVCache:
    moved = KVCache(
        1,
        cache.num_blocks,
        cache.block_size,
        cache.num_kv_heads,
        cache.head_dim,
        cache.dtype,
        DEVICE,
        layout=cache.layout,
        rope_dim=cache.rope_dim,
        scales=[cache.scales(0)] if cache.is_fp8 else None,
    )
    moved.layer(0).copy_(cache.layer(0))
    return moved


# ---------------------------------------------------------------------------------------------
# The cache: shapes, sizes, writes and block moves per layout.


@pytest.mark.parametrize(
    ("layout", "page", "per_token"),
    [("NHD", (2, 4, 2, 8), 32), ("HND", (2, 2, 4, 8), 32), ("MLA", (4, 12), 12)],
)
def test_page_shapes_and_bytes_per_token(
    layout: Layout, page: tuple[int, ...], per_token: int
) -> None:
    heads, rope = (1, 4) if layout == "MLA" else (2, 0)
    for dtype in (torch.bfloat16, E4M3):
        cache = KVCache(3, 5, 4, heads, 8, dtype, layout=layout, rope_dim=rope)
        assert cache.layer(0).shape == (5, *page) and cache.page_shape == page
        assert cache.bytes_per_token == 3 * per_token * dtype.itemsize
        assert cache.nbytes == 5 * 4 * cache.bytes_per_token == 5 * cache.block_nbytes
    # DeepSeek-V3: 61 layers of a 512 + 64 latent in bfloat16.
    assert KVLayout("MLA", 1, 512, 64).bytes_per_token(61, 2) == 70272


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_places_tokens_and_quantizes(layout: Layout) -> None:
    heads, rope = (1, 4) if layout == "MLA" else (2, 0)
    cache = KVCache(1, 6, 4, heads, 8, E4M3, layout=layout, rope_dim=rope, scales=[[0.5, 0.25]])
    slots = np.array([13, 0, 22, 5], dtype=np.int32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, heads, 8, generator=gen) * 300  # beyond e4m3's 448 once scaled: saturates
    b = torch.randn(4, heads, 8 if rope == 0 else 4, generator=gen)
    t = cache.layer(0).float()
    blk, off = slots // 4, slots % 4
    if layout == "MLA":
        cache.write_latent(0, a[:, 0], b[:, 0], slots)
        t = cache.layer(0).float()
        got_a, got_b = t[blk, off, None, :8] * 0.5, t[blk, off, None, 8:] * 0.25
    else:
        cache.write(0, a, b, slots)
        t = cache.layer(0).float()
        if layout == "HND":
            got_a, got_b = t[blk, 0, :, off] * 0.5, t[blk, 1, :, off] * 0.25
        else:
            got_a, got_b = t[blk, 0, off] * 0.5, t[blk, 1, off] * 0.25
    clipped = a.clamp(-448 * 0.5, 448 * 0.5)
    torch.testing.assert_close(got_a, clipped, rtol=0.07, atol=0.0)
    torch.testing.assert_close(got_b, b, rtol=0.07, atol=0.02)
    assert int((t != 0).sum()) <= 4 * cache.kv_layout.elements_per_token


@pytest.mark.parametrize("dtype", [torch.float16, E4M3], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_moves_keep_every_layout(layout: Layout, dtype: torch.dtype) -> None:
    heads, rope = (1, 4) if layout == "MLA" else (2, 0)
    kw = {"layout": layout, "rope_dim": rope}

    def make(blocks: int) -> KVCache:
        return KVCache(2, blocks, 4, heads, 8, dtype, **kw)  # type: ignore[arg-type]

    gpu, cpu = make(8), make(4)
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):
        gpu.layer(layer).copy_(torch.randn(gpu.layer(layer).shape, generator=gen).to(dtype))

    def raw(c: KVCache, block: int) -> list[torch.Tensor]:
        return [c.layer(i)[block].view(torch.uint8).clone() for i in range(2)]

    def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(x, y, strict=True))

    before = raw(gpu, 3)
    gpu.copy_blocks(np.array([[3, 6], [6, 7]], dtype=np.int32))  # a chain, applied in order
    assert same(raw(gpu, 6), before) and same(raw(gpu, 7), before)
    gpu.swap_out(cpu, np.array([[3, 1]], dtype=np.int32))
    gpu.swap_in(cpu, np.array([[1, 0]], dtype=np.int32))
    assert same(raw(cpu, 1), before) and same(raw(gpu, 0), before)
    host = gpu.read_blocks(np.array([3, 2])).ready()
    assert host.shape == (2, 2, *gpu.page_shape)
    other = make(8)
    other.write_block_bytes(np.array([5, 4]), [h.view(torch.uint8).numpy().tobytes() for h in host])
    assert same(raw(other, 5), before) and same(raw(other, 4), raw(gpu, 2))


def test_block_moves_need_one_format() -> None:
    nhd = KVCache(1, 4, 4, 2, 8, torch.float16)
    for other in (
        KVCache(1, 4, 4, 2, 8, torch.float16, layout="HND"),
        KVCache(1, 4, 4, 2, 8, E4M3),
        KVCache(1, 4, 4, 1, 8, torch.float16, layout="MLA", rope_dim=8),
    ):
        with pytest.raises(ValueError, match="block format"):
            nhd.swap_out(other, np.array([[0, 0]]))
    # The same float8 bytes under other scales are other KV.
    with pytest.raises(ValueError, match="block format"):
        KVCache(1, 4, 4, 2, 8, E4M3).swap_out(
            KVCache(1, 4, 4, 2, 8, E4M3, scales=[[2.0, 1.0]]), np.array([[0, 0]])
        )


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_cache_refuses_bad_layouts_and_scales() -> None:
    with pytest.raises(ValueError, match="layout must be one of NHD, HND, MLA"):
        KVCache(1, 4, 4, 2, 8, layout="NDH")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one latent per token"):
        KVCache(1, 4, 4, 2, 8, layout="MLA", rope_dim=4)
    with pytest.raises(ValueError, match="rope_dim is the MLA latent's rope part"):
        KVCache(1, 4, 4, 2, 8, rope_dim=4)
    with pytest.raises(ValueError, match=r"scales must have shape \[num_layers, 2\] = \[2, 2\]"):
        KVCache(2, 4, 4, 2, 8, E4M3, scales=[[1.0, 1.0]])
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="positive and finite"):
            KVCache(1, 4, 4, 2, 8, E4M3, scales=[[1.0, bad]])
    with pytest.raises(ValueError, match="scales apply to float8 caches only"):
        KVCache(1, 4, 4, 2, 8, torch.float16, scales=[[1.0, 1.0]])


def test_writes_refuse_the_wrong_layout_or_dtype() -> None:
    mla = KVCache(1, 4, 4, 1, 8, E4M3, layout="MLA", rope_dim=4)
    slots = np.array([0], dtype=np.int32)
    with pytest.raises(ValueError, match="write_latent"):
        mla.write(0, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), slots)
    with pytest.raises(ValueError, match=r"rope must have shape \[tokens, 4\]"):
        mla.write_latent(0, torch.zeros(1, 8), torch.zeros(1, 8), slots)
    with pytest.raises(ValueError, match="takes float16/bfloat16/float32"):
        mla.write_latent(0, torch.zeros(1, 8, dtype=torch.float64), torch.zeros(1, 4), slots)
    with pytest.raises(ValueError, match="write_latent needs the MLA layout"):
        KVCache(1, 4, 4, 2, 8).write_latent(0, torch.zeros(1, 8), torch.zeros(1, 4), slots)


def cuda_spec(
    layout: Layout,
    kv_dtype: torch.dtype,
    dtype: torch.dtype = torch.bfloat16,
    dims: tuple[int, int] = (128, 0),
) -> AttentionSpec:
    head_dim, rope = dims
    heads = 1 if layout == "MLA" else 2
    kv = KVLayout(layout, heads, head_dim, rope)
    return AttentionSpec(
        16, heads, head_dim, 16, 0.1, None, dtype, torch.device("cuda", 0), kv_dtype, kv
    )


def test_unfit_combinations_name_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fp8_mla = cuda_spec("MLA", E4M3, dims=(512, 64))
    why = str(unfit_reason("flashinfer", fp8_mla))
    assert why.startswith("flashinfer cannot run the MLA layout with float8_e4m3fn KV and ")
    assert "compute capability 9.x" in why
    assert "8.9+" in str(unfit_reason("triton", cuda_spec("HND", E4M3)))
    half_mla = cuda_spec("MLA", torch.float16, torch.float16, dims=(512, 64))
    assert "float8" not in str(unfit_reason("flashinfer", half_mla))
    assert "divisible by 128" in str(
        unfit_reason("flashinfer", cuda_spec("MLA", torch.bfloat16, dims=(96, 32)))
    )
    assert "query dtype, or float8" in str(unfit_reason("triton", cuda_spec("NHD", torch.float16)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "e4m3 KV, bfloat16 queries" in str(
        fi_backend.unsupported(cuda_spec("MLA", torch.float8_e5m2, dims=(512, 64)))
    )
    assert fi_backend.unsupported(fp8_mla) is None
    assert fi_backend.unsupported(cuda_spec("HND", torch.float8_e5m2, torch.float16)) is None
    assert "latents up to 512" in str(
        unfit_reason("triton", cuda_spec("MLA", E4M3, dims=(1024, 64)))
    )


def test_explicit_backends_raise_naming_the_combination() -> None:
    with pytest.raises(ValueError, match="cannot run the MLA layout with bfloat16 KV and "):
        fi_backend.check_spec(cuda_spec("MLA", torch.bfloat16, dims=(96, 32)))
    with pytest.raises(ValueError, match="backend='triton' cannot run the NHD layout with float16"):
        PagedAttention(4, 2, 8, 4, "triton", dtype=torch.float32, kv_dtype=torch.float16)


def test_auto_on_cpu_falls_back_to_torch_for_every_layout() -> None:
    attn = PagedAttention(
        4, 1, 16, 4, dtype=torch.bfloat16, kv_dtype=E4M3, layout="MLA", rope_dim=8
    )
    assert attn.backend == "torch" and "flashinfer needs a CUDA device" in attn.backend_reason


def test_run_checks_the_cache_layout_and_dtype() -> None:
    attn = PagedAttention(4, 2, 8, 4, "torch", dtype=torch.float32, kv_dtype=E4M3, layout="HND")
    attn.plan(plan_from_tables([[0]], [3], [1], 4))
    with pytest.raises(ValueError, match="KVLayout"):
        attn.run(torch.zeros(1, 4, 8), KVCache(1, 2, 4, 2, 8, E4M3), 0)
    with pytest.raises(ValueError, match=r"reads torch\.float8_e4m3fn KV"):
        attn.run(torch.zeros(1, 4, 8), KVCache(1, 2, 4, 2, 8, torch.float32, layout="HND"), 0)
    mla = PagedAttention(4, 1, 8, 4, "torch", dtype=torch.float32, layout="MLA", rope_dim=4)
    mla.plan(plan_from_tables([[0]], [3], [1], 4))
    with pytest.raises(ValueError, match=r"q has shape \(1, 4, 8\), the plan expects \(1, 4, 12\)"):
        mla.run(
            torch.zeros(1, 4, 8), KVCache(1, 2, 4, 1, 8, torch.float32, layout="MLA", rope_dim=4), 0
        )


def test_readme_example_runs() -> None:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    match = re.search(r"## KV layouts and dtypes\n.*?```python\n(.*?)```", readme.read_text(), re.S)
    assert match, "the README's layouts section has a Python example"
    exec(compile(match.group(1), "README layouts example", "exec"), {})
