"""GPU check for pagedkv's attention: FlashInfer against the torch reference, then decode speed.

Meant for one lent GPU (written for an H200) and a few minutes:

1. correctness: FlashInfer decode and prefill (plain, chunked, mixed; GQA 1/4/8; block sizes
   1/16/32; soft cap and a custom scale) against the torch reference on the same plan, random
   bfloat16 data; fails on a NaN or a relative error (L2) above the bound;
2. no device sync in `plan`: planning while the GPU is busy must return before the GPU is done;
3. decode timing at batch 64 and 256 with contexts 1K, 4K and 16K (32 query heads, 8 KV heads,
   head_dim 128, block 16): time per call and achieved KV-read bandwidth, against a
   device-to-device copy measured in the same run;
4. plan overhead per step (host time of `PagedAttention.plan`).

Run: ``python benches/gpu_check.py`` (``--quick`` skips the 16K contexts). Exit status 0 only
when every check passes. Plans are built here with numpy in the exact layout `BlockManager.plan`
returns, so the check needs no manager state.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.attention import PagedAttention
from pagedkv.kv_cache import KVCache

HQ, HKV, DIM, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
REL_ERR_BOUND = 1e-2


@dataclass
class ArrayPlan:
    """The fields of `pagedkv.Plan` that attention reads, built with numpy."""

    kv_indptr: npt.NDArray[np.int32]
    kv_indices: npt.NDArray[np.int32]
    kv_last_page_len: npt.NDArray[np.int32]
    qo_indptr: npt.NDArray[np.int32]


def make_plan(
    kv_lens: Sequence[int], q_lens: Sequence[int], bs: int, num_blocks: int, seed: int
) -> ArrayPlan:
    """Sequences on distinct, randomly chosen blocks (vectorised: 256 x 16K builds in ms)."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    pages = (kv + bs - 1) // bs
    nnz = int(pages.sum())
    if nnz > num_blocks:
        raise ValueError(f"plan needs {nnz} blocks, the cache has {num_blocks}")
    indices = np.random.default_rng(seed).permutation(num_blocks)[:nnz]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    qo = np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))])
    return ArrayPlan(
        kv_indptr=indptr.astype(np.int32),
        kv_indices=indices.astype(np.int32),
        kv_last_page_len=(kv - (pages - 1) * bs).astype(np.int32),
        qo_indptr=qo.astype(np.int32),
    )


def random_cache(num_blocks: int, bs: int, hkv: int) -> KVCache:
    cache = KVCache(1, num_blocks, bs, hkv, DIM, dtype=DTYPE, device="cuda")
    cache.layer(0).normal_()
    return cache


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: list[int]
    q_lens: list[int]
    group: int = 4
    bs: int = BS
    cap: float | None = None
    sm_scale: float | None = None


def correctness_cases(rng: np.random.Generator) -> list[Case]:
    def lens(n: int, hi: int) -> list[int]:
        return [int(x) for x in rng.integers(1, hi, n)]

    decode_kv = lens(64, 3000)
    prefill = lens(6, 700)
    chunk_kv = lens(8, 1500)
    chunk_q = [int(rng.integers(1, k + 1)) for k in chunk_kv]
    mixed_kv = lens(24, 2000)
    mixed_q = [
        1 if i % 3 else int(rng.integers(1, min(k, 300) + 1)) for i, k in enumerate(mixed_kv)
    ]
    cases = [
        Case("decode", decode_kv, [1] * 64),
        Case("prefill", prefill, prefill),
        Case("chunked prefill", chunk_kv, chunk_q),
        Case("mixed", mixed_kv, mixed_q),
        Case("decode soft-cap+scale", decode_kv, [1] * 64, cap=30.0, sm_scale=0.05),
        Case("mixed soft-cap", mixed_kv, mixed_q, cap=20.0),
    ]
    for group in (1, 8):
        cases.append(Case(f"decode gqa {group}", decode_kv[:16], [1] * 16, group=group))
        cases.append(Case(f"mixed gqa {group}", mixed_kv[:8], mixed_q[:8], group=group))
    for bs in (1, 32):
        cases.append(Case(f"decode bs {bs}", decode_kv[:16], [1] * 16, bs=bs))
        cases.append(Case(f"mixed bs {bs}", mixed_kv[:8], mixed_q[:8], bs=bs))
    return cases


def check_correctness(seed: int) -> bool:
    rng = np.random.default_rng(seed)
    ok = True
    print(f"correctness: FlashInfer vs torch reference, {DTYPE}, bound {REL_ERR_BOUND:g}")
    for case in correctness_cases(rng):
        hkv, hq = HKV, HKV * case.group
        num_blocks = sum(math.ceil(k / case.bs) for k in case.kv_lens) + 64
        cache = random_cache(num_blocks, case.bs, hkv)
        plan = make_plan(case.kv_lens, case.q_lens, case.bs, num_blocks, seed)
        q = torch.randn(sum(case.q_lens), hq, DIM, device="cuda", dtype=DTYPE)
        outs = {}
        for backend in ("flashinfer", "torch"):
            attn = PagedAttention(
                hq,
                hkv,
                DIM,
                case.bs,
                backend,
                device="cuda",
                dtype=DTYPE,
                logits_soft_cap=case.cap,
                sm_scale=case.sm_scale,
            )
            attn.plan(plan)
            outs[backend] = attn.run(q, cache, 0).float()
        fi, ref = outs["flashinfer"], outs["torch"]
        finite = bool(torch.isfinite(fi).all())
        rel = float((fi - ref).norm() / ref.norm())
        max_abs = float((fi - ref).abs().max())
        passed = finite and rel <= REL_ERR_BOUND
        ok &= passed
        print(
            f"  {'PASS' if passed else 'FAIL'} {case.name:24s} B={len(case.kv_lens):3d} "
            f"tokens={sum(case.q_lens):5d} hq/hkv={hq}/{hkv} bs={case.bs:2d} "
            f"rel_l2={rel:.2e} max_abs={max_abs:.2e}{'' if finite else ' NON-FINITE'}"
        )
        del cache
    return ok


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds per call of `fn`, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / t


def check_no_sync_in_plan() -> bool:
    """Plan while a ~200 ms kernel runs: a plan that synchronised would take that long."""
    num_blocks = 64 * 256
    plan = make_plan([4096] * 64, [1] * 64, BS, num_blocks, seed=1)
    attn = PagedAttention(HQ, HKV, DIM, BS, "flashinfer", device="cuda", dtype=DTYPE)
    attn.plan(plan)  # compiles / loads kernels outside the measurement
    probe = 10_000_000
    per_cycle = cuda_time(lambda: torch.cuda._sleep(probe), reps=3, warmup=1) / probe
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 / per_cycle))  # keep the GPU busy for about 200 ms
    t0 = time.perf_counter()
    attn.plan(plan)  # waits only for the previous plan's event, which precedes the sleep
    host = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    remaining = time.perf_counter() - t1
    passed = host < 0.05 and remaining > 0.05
    print(
        f"no device sync in plan: {'PASS' if passed else 'FAIL'} "
        f"(plan took {host * 1e3:.2f} ms while the GPU still had {remaining * 1e3:.0f} ms to go)"
    )
    return passed


def bench_decode(quick: bool) -> None:
    contexts = [1024, 4096] if quick else [1024, 4096, 16384]
    batches = [64, 256]
    max_tokens = max(batches) * max(contexts)
    num_blocks = max_tokens // BS
    cache = random_cache(num_blocks, BS, HKV)
    gib = cache.nbytes / 2**30
    copy_bw = copy_bandwidth()
    print(f"\ndecode: {HQ}/{HKV} heads, head_dim {DIM}, block {BS}, {DTYPE}, cache {gib:.1f} GiB")
    print(f"device-to-device copy (read + write): {copy_bw / 1e9:8.1f} GB/s")
    print(
        f"{'batch':>6} {'context':>8} {'us/call':>9} {'KV GB/s':>9} {'vs copy':>8} {'plan us':>8}"
    )
    attn = PagedAttention(HQ, HKV, DIM, BS, "flashinfer", device="cuda", dtype=DTYPE)
    for batch in batches:
        for ctx in contexts:
            plan = make_plan([ctx] * batch, [1] * batch, BS, num_blocks, seed=ctx + batch)
            q = torch.randn(batch, HQ, DIM, device="cuda", dtype=DTYPE)
            attn.plan(plan)

            def run(q: torch.Tensor = q) -> torch.Tensor:
                return attn.run(q, cache, 0)

            t = cuda_time(run, reps=20)
            kv_bytes = batch * ctx * 2 * HKV * DIM * cache.layer(0).element_size()
            bw = kv_bytes / t
            plan_us = plan_overhead(attn, plan)
            print(
                f"{batch:6d} {ctx:8d} {t * 1e6:9.1f} {bw / 1e9:9.1f} {bw / copy_bw:8.2f} "
                f"{plan_us:8.1f}"
            )


def plan_overhead(attn: PagedAttention, plan: ArrayPlan, reps: int = 30) -> float:
    """Median host microseconds of one `plan` call (validation, uploads, FlashInfer's plan)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        attn.plan(plan)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def bench_prefill_plan() -> None:
    rng = np.random.default_rng(3)
    kv = [int(x) for x in rng.integers(64, 4096, 64)]
    q = [1 if i % 4 else min(k, 512) for i, k in enumerate(kv)]
    num_blocks = sum(math.ceil(k / BS) for k in kv) + 16
    plan = make_plan(kv, q, BS, num_blocks, seed=3)
    attn = PagedAttention(HQ, HKV, DIM, BS, "flashinfer", device="cuda", dtype=DTYPE)
    attn.plan(plan)
    us = plan_overhead(attn, plan)
    print(f"plan overhead, mixed batch of 64 ({sum(q)} query tokens): {us:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description="pagedkv GPU check (FlashInfer vs reference)")
    parser.add_argument("--quick", action="store_true", help="skip the 16K contexts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError as exc:
        print(f"FlashInfer does not import ({exc}); see the README for wheels", file=sys.stderr)
        return 2
    print(
        f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"flashinfer {flashinfer.__version__}"
    )
    t0 = time.perf_counter()
    ok = check_correctness(args.seed)
    ok &= check_no_sync_in_plan()
    bench_decode(args.quick)
    bench_prefill_plan()
    verdict = "ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED"
    print(f"\n{verdict} in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
