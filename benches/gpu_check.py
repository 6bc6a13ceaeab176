"""GPU check for pagedkv's attention: every GPU backend against the reference, then speed.

Meant for one lent GPU (written for an H200) and a few minutes. For each backend (FlashInfer and
Triton by default) it measures:

1. kernel compile / load time (JIT), printed on its own before the table;
2. correctness: decode and prefill (plain, chunked, mixed; GQA 1/4/8; block sizes 1/16/32; soft
   cap and a custom scale) against the torch reference on the same plan, random bfloat16 data;
   fails on a NaN or a relative error (L2) above the bound;
3. no device sync in `plan`, for a decode and a prefill step: planning while the GPU is busy
   must return before the GPU is done;
4. CUDA-graph decode: `run` captured for batch-size buckets, replayed after new plans, against
   eager `run` on the same plans;
5. decode speed at batch 64 and 256 with contexts 1K, 4K and 16K (32 query heads, 8 KV heads,
   head_dim 128, block 16): a loop of calls timed between one pair of events, as KV-read
   bandwidth against a device-to-device copy measured in the same run;
6. host time of `plan` per step (decode and mixed);
7. a persistent batch of a real `BlockManager` (256 sequences, 4K contexts, decode steps):
   attention planned with the CSR built on the device from the batch's table
   (`plan(batch, table=...)`) must equal the host CSR's exactly, with the host time of both;
8. windows, chunks and sinks (`window_cases`): sliding-window and chunked-local attention, with
   and without attention sinks, and sinks alone, for decode, prefill and mixed steps, against
   the reference as in 2 (a case a backend cannot run is listed with the reason);
9. windowed decode at long context (batch 32, contexts 16K and 64K, window 4K): the plan a
   windowed manager makes (the window's pages only) must equal the window over the whole
   table, then its KV-read bandwidth and its speed-up over full attention at the same context,
   measured in the same run (the window reads about context / window times less KV);
10. KV layouts and dtypes (`LAYOUTS`: HND, float8 e4m3/e5m2 with scales, MLA 512 + 64 in
   bfloat16 and e4m3): decode and mixed steps against the torch reference on the same cache,
   and decode bandwidth at batch 64, context 4K (bytes the layout stores per token). A
   combination a backend cannot run is listed with the reason, not failed.

Everything lands in one table; the exit status is 0 only when every check passes. Run:
``python benches/gpu_check.py`` (``--quick`` skips the 16K decode and 64K window contexts and
shortens loops; ``--backends triton`` picks backends). Plans come from `plan_from_tables` on
random tables, in the exact layout `BlockManager.plan` returns, so the check needs no manager
state.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from pagedkv import Attention, Batch, BlockManager
from pagedkv.attention import (
    DeviceBlockTable,
    PagedAttention,
    TablePlan,
    plan_from_tables,
    random_tables,
)
from pagedkv.attention._select import unfit_reason
from pagedkv.kv_cache import KVCache

HQ, HKV, DIM, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"  # tests run parts of the check on the CPU
WINDOW, CHUNK = 512, 1024  # the correctness cases' window and chunk, in tokens
REL_ERR_BOUND = 1e-2
BACKENDS = ("flashinfer", "triton")


@dataclass
class Row:
    """One line of the result table; `ok` is None for a measurement that cannot fail."""

    check: str
    backend: str
    case: str
    value: str
    ok: bool | None


ROWS: list[Row] = []


def record(check: str, backend: str, case: str, value: str, ok: bool | None) -> None:
    ROWS.append(Row(check, backend, case, value, ok))
    status = "" if ok is None else ("PASS" if ok else "FAIL")
    print(f"  {status:4s} {check} {backend} {case}: {value}", file=sys.stderr, flush=True)


def make_plan(
    kv_lens: list[int],
    q_lens: list[int],
    bs: int,
    num_blocks: int,
    seed: int,
    attention: Attention | None = None,
) -> TablePlan:
    """Sequences on distinct, randomly chosen blocks of a `num_blocks` pool."""
    tables = random_tables(kv_lens, bs, num_blocks, seed)
    return plan_from_tables(tables, kv_lens, q_lens, bs, attention or Attention.full())


def random_cache(num_blocks: int, bs: int, hkv: int) -> KVCache:
    cache = KVCache(1, num_blocks, bs, hkv, DIM, dtype=DTYPE, device=DEVICE)
    cache.layer(0).normal_()
    return cache


def attention(backend: str, group: int = HQ // HKV, bs: int = BS, **kw: object) -> PagedAttention:
    return PagedAttention(
        HKV * group,
        HKV,
        DIM,
        bs,
        backend,
        device=DEVICE,
        dtype=DTYPE,
        **kw,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: list[int]
    q_lens: list[int]
    group: int = 4
    bs: int = BS
    cap: float | None = None
    sm_scale: float | None = None
    attention: Attention | None = None
    sinks: bool = False

    def build(self, backend: str) -> PagedAttention:
        """This case's attention on `backend`."""
        return attention(
            backend,
            self.group,
            self.bs,
            logits_soft_cap=self.cap,
            sm_scale=self.sm_scale,
            attention=self.attention,
            sinks=self.sinks,
        )

    def unfit(self, backend: str) -> str | None:
        """Why `backend` cannot run this case (None when it looks able to)."""
        return unfit_reason(backend, self.build("torch").spec)


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


def window_cases(
    rng: np.random.Generator, n: int = 16, hi: int = 3000, window: int = WINDOW, chunk: int = CHUNK
) -> list[Case]:
    """Sliding window, chunked-local, each with and without sinks, and sinks alone: a decode,
    a prefill and a mixed step each (`n` sequences of up to `hi` tokens; prefills shorter)."""
    decode_kv = [int(x) for x in rng.integers(1, hi, n)]
    prefill = [int(x) for x in rng.integers(1, max(hi // 4, 2), max(n // 4, 2))]
    mixed_kv = [int(x) for x in rng.integers(1, hi, n)]
    mixed_q = [1 if i % 3 else int(rng.integers(1, k + 1)) for i, k in enumerate(mixed_kv)]
    kinds = [
        ("window", Attention.sliding_window(window), False),
        ("chunked", Attention.chunked_local(chunk), False),
        ("window+sinks", Attention.sliding_window(window), True),
        ("chunked+sinks", Attention.chunked_local(chunk), True),
        ("sinks", None, True),
    ]
    return [
        Case(f"{name} {step}", kv, q, attention=what, sinks=sinks)
        for name, what, sinks in kinds
        for step, kv, q in (
            ("decode", decode_kv, [1] * n),
            ("prefill", prefill, prefill),
            ("mixed", mixed_kv, mixed_q),
        )
    ]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def prebuild_flashinfer_modules() -> None:
    """JIT-compile FlashInfer's attention modules the check uses (plain, soft cap, sliding
    window; attention sinks with and without a window) at the same time rather than one after
    the other, each with its own parallel ninja.

    Best effort: `_gen_batch_prefill_primary_module` is what FlashInfer 0.7's FA2 wrappers
    build (decode with tensor cores included) for a cache whose K and V strides are equal, and
    the attention-sink wrapper builds its module when constructed; on any error, or another
    version, the first `plan` builds whatever it needs.
    """
    try:
        import flashinfer
        from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module

        builds: list[Callable[[], object]] = [
            _gen_batch_prefill_primary_module(
                "fa2", DTYPE, DTYPE, DTYPE, torch.int32, DIM, DIM, 0, window, cap, False
            ).build_and_load
            for window, cap in ((False, False), (False, True), (True, False))
        ]
        workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
        builds += [
            partial(
                flashinfer.BatchAttentionWithAttentionSinkWrapper,
                workspace,
                "NHD",
                backend="fa2",
                q_data_type=DTYPE,
                kv_data_type=DTYPE,
                head_dim_qk=DIM,
                head_dim_vo=DIM,
                window_left=window_left,
            )
            for window_left in (-1, 0)
        ]
        with ThreadPoolExecutor(len(builds)) as pool:
            list(pool.map(lambda build: build(), builds))
    except Exception as exc:
        print(f"prebuilding FlashInfer's modules skipped ({exc!r}); plan() builds them", flush=True)


def all_cases(seed: int) -> list[Case]:
    """The correctness cases of 2 and 8."""
    return correctness_cases(np.random.default_rng(seed)) + window_cases(
        np.random.default_rng(seed + 1)
    )


def sink_logits(case: Case) -> torch.Tensor | None:
    """Random per-head sink logits for a case with sinks (a model's are of this size)."""
    if not case.sinks:
        return None
    return torch.randn(HKV * case.group, device=DEVICE, dtype=torch.float32) * 2


def warm_up(backend: str, seed: int) -> None:
    """Compile or load every kernel variant the check uses, and print how long that took."""
    t0 = time.perf_counter()
    if backend == "flashinfer":
        prebuild_flashinfer_modules()
    variants = {
        (c.bs, c.group, c.cap, c.attention, c.sinks): c
        for c in all_cases(seed)
        if not c.unfit(backend)
    }
    for case in variants.values():
        cache = random_cache(64, case.bs, HKV)
        attn = case.build(backend)
        for q_lens in ([1, 1], [5, 1]):  # a decode and a prefill step
            attn.plan(make_plan([40, 9], q_lens, case.bs, 64, 0, case.attention))
            q = torch.randn(sum(q_lens), HKV * case.group, DIM, device=DEVICE, dtype=DTYPE)
            attn.run(q, cache, 0, sinks=sink_logits(case))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"compile/load time {backend}: {time.perf_counter() - t0:.1f} s", flush=True)


def check_correctness(backend: str, seed: int, cases: list[Case]) -> None:
    """Each case on `backend` and on the reference, same plan, cache, queries and sinks; a case
    the backend cannot run is listed with the reason."""
    for case in cases:
        shape = f"B={len(case.kv_lens)} tok={sum(case.q_lens)} g={case.group} bs={case.bs}"
        why = case.unfit(backend)
        if why is not None:
            record("correct", backend, f"{case.name} ({shape})", f"not run: {why}"[:160], None)
            continue
        hq = HKV * case.group
        num_blocks = sum(math.ceil(k / case.bs) for k in case.kv_lens) + 64
        cache = random_cache(num_blocks, case.bs, HKV)
        plan = make_plan(case.kv_lens, case.q_lens, case.bs, num_blocks, seed, case.attention)
        q = torch.randn(sum(case.q_lens), hq, DIM, device=DEVICE, dtype=DTYPE)
        sinks = sink_logits(case)
        outs = {}
        for name in (backend, "torch"):
            attn = case.build(name)
            attn.plan(plan)
            outs[name] = attn.run(q, cache, 0, sinks=sinks)
        finite = bool(torch.isfinite(outs[backend]).all())
        rel = rel_error(outs[backend], outs["torch"])
        value = f"rel_l2 {rel:.1e}" + ("" if finite else " NON-FINITE")
        record("correct", backend, f"{case.name} ({shape})", value, finite and rel <= REL_ERR_BOUND)
        del cache


def spin_cycles_per_second() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def check_no_sync_in_plan(backend: str) -> None:
    """Plan while a ~200 ms kernel runs: a plan that synchronised would take that long."""
    cycles = spin_cycles_per_second()
    mixed_kv = [4096] * 32
    for mode, plan in (
        ("decode", make_plan([4096] * 64, [1] * 64, BS, 64 * 256, seed=1)),
        ("prefill", make_plan(mixed_kv, [1 if i % 2 else 256 for i in range(32)], BS, 32 * 256, 2)),
    ):
        attn = attention(backend)
        attn.plan(plan)  # first plan: loads kernels, sizes buffers
        attn.plan(plan)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(0.2 * cycles))  # keep the GPU busy for about 200 ms
        t0 = time.perf_counter()
        attn.plan(plan)  # may wait only for the previous plan's event, which precedes the sleep
        host = time.perf_counter() - t0
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        remaining = time.perf_counter() - t1
        value = f"plan {host * 1e3:.2f} ms, GPU still busy {remaining * 1e3:.0f} ms"
        record("plan no-sync", backend, mode, value, host < 0.05 and remaining > 0.05)


def check_cuda_graphs(backend: str) -> None:
    """Capture decode `run` per bucket, replay after new plans, compare with eager."""
    buckets, max_pages = (8, 64), 64 * 200
    num_blocks = max_pages + 64
    cache = random_cache(num_blocks, BS, HKV)
    graphed = attention(backend, cuda_graph_batch_sizes=buckets, cuda_graph_max_pages=max_pages)
    eager = attention(backend)
    rng = np.random.default_rng(7)
    for bucket in buckets:
        static_q = torch.zeros(bucket, HQ, DIM, device="cuda", dtype=DTYPE)
        graphed.plan(make_plan([100] * bucket, [1] * bucket, BS, num_blocks, seed=bucket))
        graphed.run(static_q, cache, 0)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = graphed.run(static_q, cache, 0)
        for trial in range(3):
            batch = int(rng.integers(bucket // 2 + 1, bucket + 1))
            kv_lens = [int(x) for x in rng.integers(1, 3000, batch)]
            plan = make_plan(kv_lens, [1] * batch, BS, num_blocks, seed=trial)
            graphed.plan(plan)
            ok_bucket = graphed.graph_batch_size == bucket
            q = torch.randn(batch, HQ, DIM, device="cuda", dtype=DTYPE)
            static_q.zero_()
            static_q[:batch] = q
            graph.replay()
            eager.plan(plan)
            want = eager.run(q, cache, 0)
            rel = rel_error(static_out[:batch], want)
            record(
                "cuda graph",
                backend,
                f"bucket {bucket}, batch {batch}",
                f"rel_l2 vs eager {rel:.1e}",
                ok_bucket and rel <= REL_ERR_BOUND,
            )


def loop_seconds(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    """Seconds per call of `fn`: `calls` calls between one pair of events (launch overhead of
    each call overlaps the previous one, as in a real decode loop)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = loop_seconds(lambda: dst.copy_(src), calls=10)
    return 2 * nbytes / t


def bench_decode(backend: str, quick: bool, copy_bw: float) -> None:
    contexts = [1024, 4096] if quick else [1024, 4096, 16384]
    batches = [64, 256]
    calls = 20 if quick else 50
    num_blocks = max(batches) * max(contexts) // BS
    cache = random_cache(num_blocks, BS, HKV)
    attn = attention(backend)
    for batch in batches:
        for ctx in contexts:
            plan = make_plan([ctx] * batch, [1] * batch, BS, num_blocks, seed=ctx + batch)
            q = torch.randn(batch, HQ, DIM, device="cuda", dtype=DTYPE)
            attn.plan(plan)
            t = loop_seconds(lambda q=q: attn.run(q, cache, 0), calls)
            kv_bytes = batch * ctx * 2 * HKV * DIM * cache.layer(0).element_size()
            bw = kv_bytes / t
            case = f"batch {batch} ctx {ctx // 1024}K"
            speed = f"{t * 1e6:.0f} us, {bw / 1e9:.0f} GB/s = {bw / copy_bw:.2f} x copy"
            record("decode bw", backend, case, speed, None)
            us = plan_host_seconds(attn, plan) * 1e6
            record("plan host", backend, f"decode {case}", f"{us:.0f} us", None)


def window_plans(
    batch: int, context: int, window: int, bs: int, num_blocks: int, seed: int
) -> tuple[TablePlan, TablePlan, TablePlan]:
    """Decode plans at `context` on the same blocks: full attention over the whole table, the
    window over the whole table, and the window as a windowed manager plans it (the table from
    the block holding the window's first key, lengths counted from there)."""
    tables = random_tables([context] * batch, bs, num_blocks, seed)
    first = max(context - window, 0) // bs
    live = context - first * bs
    sliding = Attention.sliding_window(window)
    ones = [1] * batch
    return (
        plan_from_tables(tables, [context] * batch, ones, bs),
        plan_from_tables(tables, [context] * batch, ones, bs, sliding),
        plan_from_tables([t[first:] for t in tables], [live] * batch, ones, bs, sliding),
    )


def bench_window_decode(
    backend: str, quick: bool, copy_bw: float, batch: int = 32, window: int = 4096
) -> None:
    """A windowed decode at long context reads the window's pages only: check its output
    against the window over the whole table, then time it against full attention."""
    contexts = [16384] if quick else [16384, 65536]
    calls = 20 if quick else 50
    num_blocks = batch * max(contexts) // BS
    cache = random_cache(num_blocks, BS, HKV)
    full, windowed = attention(backend), attention(backend)
    for ctx in contexts:
        whole, masked, live = window_plans(batch, ctx, window, BS, num_blocks, seed=ctx)
        q = torch.randn(batch, HQ, DIM, device=DEVICE, dtype=DTYPE)
        windowed.plan(masked)
        want = windowed.run(q, cache, 0)
        windowed.plan(live)
        rel = rel_error(windowed.run(q, cache, 0), want)
        case = f"batch {batch} ctx {ctx // 1024}K window {window // 1024}K"
        record(
            "window bw",
            backend,
            f"{case}: window pages = whole table",
            f"rel_l2 {rel:.1e}",
            rel <= REL_ERR_BOUND,
        )
        t_window = loop_seconds(lambda q=q: windowed.run(q, cache, 0), calls)
        full.plan(whole)
        t_full = loop_seconds(lambda q=q: full.run(q, cache, 0), calls)
        live_tokens = int(live.kv_indptr[1] - 1) * BS + int(live.kv_last_page_len[0])
        bw = batch * live_tokens * cache.bytes_per_token / t_window
        speed = (
            f"{t_window * 1e6:.0f} us, {bw / 1e9:.0f} GB/s = {bw / copy_bw:.2f} x copy; "
            f"full {t_full * 1e6:.0f} us: {t_full / t_window:.1f}x faster "
            f"({ctx / live_tokens:.1f}x less KV read)"
        )
        record("window bw", backend, case, speed, None)


def plan_host_seconds(attn: PagedAttention, plan: TablePlan, reps: int = 30) -> float:
    """Median host seconds of one `plan` call (validation, uploads, the backend's own plan)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        attn.plan(plan)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times))


def bench_mixed_plan(backend: str) -> None:
    rng = np.random.default_rng(3)
    kv = [int(x) for x in rng.integers(64, 4096, 64)]
    q = [1 if i % 4 else min(k, 512) for i, k in enumerate(kv)]
    num_blocks = sum(math.ceil(k / BS) for k in kv) + 16
    attn = attention(backend)
    us = plan_host_seconds(attn, make_plan(kv, q, BS, num_blocks, seed=3)) * 1e6
    record("plan host", backend, f"mixed batch 64 ({sum(q)} query tokens)", f"{us:.0f} us", None)


def check_persistent_batch(
    backend: str, rows: int = 256, context: int = 4096, steps: int = 20, device: str = "cuda"
) -> None:
    """Decode steps of a manager's persistent batch: the device-built CSR against the host's."""
    num_blocks = rows * math.ceil((context + steps) / BS) + 64
    mgr = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    cache = random_cache(num_blocks, BS, HKV)
    batch, table = Batch(), DeviceBlockTable(device)
    rng = np.random.default_rng(5)
    for seq in range(rows):
        mgr.allocate(seq, rng.integers(0, 32_000, context, dtype=np.int32))
        mgr.plan([seq], [context])
        batch.add(seq)
    on_host, on_device = attention(backend), attention(backend)
    host_s, device_s, worst = [], [], 0.0
    for step in range(steps):
        mgr.step_batch(batch, np.full(rows, step, dtype=np.int32))
        q = torch.randn(rows, HQ, DIM, device=device, dtype=DTYPE)
        t0 = time.perf_counter()
        on_host.plan(batch)
        t1 = time.perf_counter()
        on_device.plan(batch, table=table)
        device_s.append(time.perf_counter() - t1)
        host_s.append(t1 - t0)
        diff = (on_host.run(q, cache, 0) - on_device.run(q, cache, 0)).abs().max()
        worst = max(worst, float(diff))
    value = (
        f"plan host CSR {np.median(host_s) * 1e6:.0f} us, device CSR "
        f"{np.median(device_s) * 1e6:.0f} us, max |diff| {worst:.1e}"
    )
    case = f"B={rows} ctx={context}, {steps} steps"
    record("persistent", backend, case, value, worst == 0)


def print_table() -> None:
    headers = ("check", "backend", "case", "result", "status")
    cells = [
        (r.check, r.backend, r.case, r.value, "" if r.ok is None else ("PASS" if r.ok else "FAIL"))
        for r in ROWS
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*headers))
    print(line.format(*("-" * w for w in widths)))
    for c in cells:
        print(line.format(*c).rstrip())


@dataclass(frozen=True)
class LayoutCase:
    """A cache format: layout, KV dtype, the queries' dtype, heads and dims."""

    name: str
    layout: str
    kv_dtype: torch.dtype
    dtype: torch.dtype = DTYPE
    hq: int = HQ
    hkv: int = HKV
    dim: int = DIM
    rope_dim: int = 0


LAYOUTS = (
    LayoutCase("HND bf16", "HND", DTYPE),
    LayoutCase("NHD e4m3", "NHD", torch.float8_e4m3fn),
    LayoutCase("HND e4m3", "HND", torch.float8_e4m3fn),
    LayoutCase("NHD e5m2 (fp16 q)", "NHD", torch.float8_e5m2, torch.float16),
    LayoutCase("MLA bf16", "MLA", DTYPE, hq=16, hkv=1, dim=512, rope_dim=64),
    LayoutCase("MLA e4m3", "MLA", torch.float8_e4m3fn, hq=16, hkv=1, dim=512, rope_dim=64),
)


def layout_setup(
    backend: str, lc: LayoutCase, num_blocks: int
) -> tuple[PagedAttention, PagedAttention, KVCache]:
    """The backend's and the reference's attention for `lc`, and a random cache of it."""
    fp8 = lc.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    cache = KVCache(
        1,
        num_blocks,
        BS,
        lc.hkv,
        lc.dim,
        lc.kv_dtype,
        "cuda",
        layout=lc.layout,  # type: ignore[arg-type]
        rope_dim=lc.rope_dim,
        scales=[[0.02, 0.03]] if fp8 else None,
    )
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, device="cuda").mul_(8).to(lc.kv_dtype))
    attns = [
        PagedAttention(
            lc.hq,
            lc.hkv,
            lc.dim,
            BS,
            name,
            device="cuda",
            dtype=lc.dtype,  # type: ignore[arg-type]
            kv_dtype=lc.kv_dtype,
            layout=lc.layout,
            rope_dim=lc.rope_dim,  # type: ignore[arg-type]
        )
        for name in (backend, "torch")
    ]
    return attns[0], attns[1], cache


def check_layouts(backend: str, seed: int, copy_bw: float) -> None:
    """Every `LAYOUTS` case: decode and mixed against the reference, then decode bandwidth."""
    rng = np.random.default_rng(seed)
    kv = [int(x) for x in rng.integers(1, 2000, 16)]
    steps = {"decode": [1] * 16, "mixed": [1 if i % 3 else min(k, 200) for i, k in enumerate(kv)]}
    for lc in LAYOUTS:
        probe = PagedAttention(
            lc.hq,
            lc.hkv,
            lc.dim,
            BS,
            "torch",
            device="cuda",
            dtype=lc.dtype,
            kv_dtype=lc.kv_dtype,
            layout=lc.layout,
            rope_dim=lc.rope_dim,  # type: ignore[arg-type]
        )
        why = unfit_reason(backend, probe.spec)
        if why is not None:
            record("layouts", backend, lc.name, f"not run: {why}"[:160], None)
            continue
        num_blocks = sum(math.ceil(k / BS) for k in kv) + 64
        attn, ref, cache = layout_setup(backend, lc, num_blocks)
        for step, q_lens in steps.items():
            plan = make_plan(kv, q_lens, BS, num_blocks, seed)
            q = torch.randn(sum(q_lens), lc.hq, lc.dim + lc.rope_dim, device="cuda").to(lc.dtype)
            outs = []
            for a in (attn, ref):
                a.plan(plan)
                outs.append(a.run(q, cache, 0))
            finite = bool(torch.isfinite(outs[0]).all())
            rel = rel_error(outs[0], outs[1])
            value = f"rel_l2 {rel:.1e}" + ("" if finite else " NON-FINITE")
            ok = finite and rel <= REL_ERR_BOUND
            record("layouts", backend, f"{lc.name} {step}", value, ok)
        batch, ctx = 64, 4096
        num_blocks = batch * ctx // BS
        attn, _, cache = layout_setup(backend, lc, num_blocks)
        attn.plan(make_plan([ctx] * batch, [1] * batch, BS, num_blocks, seed=1))
        q = torch.randn(batch, lc.hq, lc.dim + lc.rope_dim, device="cuda").to(lc.dtype)
        t = loop_seconds(lambda q=q, a=attn, c=cache: a.run(q, c, 0), calls=20)
        bw = batch * ctx * cache.bytes_per_token / t
        speed = f"{t * 1e6:.0f} us, {bw / 1e9:.0f} GB/s = {bw / copy_bw:.2f} x copy"
        record("layout bw", backend, f"{lc.name} batch {batch} ctx 4K", speed, None)
        del cache


def main() -> int:
    parser = argparse.ArgumentParser(description="pagedkv GPU check (backends vs reference)")
    parser.add_argument("--quick", action="store_true", help="skip the 16K contexts")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated, from: flashinfer, triton"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    backends = [b for b in args.backends.split(",") if b]
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    usable = []
    copy_bw = copy_bandwidth()
    record("d2d copy", "-", "4 GiB, read+write", f"{copy_bw / 1e9:.0f} GB/s", None)
    for backend in backends:
        try:
            warm_up(backend, args.seed)
        except Exception as exc:  # report it as a failed row, go on with the other backends
            record(
                "build", backend, "compile + first run", f"{type(exc).__name__}: {exc}"[:160], False
            )
        else:
            usable.append(backend)
    for backend in usable:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("correct", partial(check_correctness, backend, args.seed, all_cases(args.seed))),
            ("plan no-sync", partial(check_no_sync_in_plan, backend)),
            ("cuda graph", partial(check_cuda_graphs, backend)),
            ("plan host", partial(bench_mixed_plan, backend)),
            ("persistent", partial(check_persistent_batch, backend)),
            ("decode bw", partial(bench_decode, backend, args.quick, copy_bw)),
            ("window bw", partial(bench_window_decode, backend, args.quick, copy_bw)),
            ("layouts", partial(check_layouts, backend, args.seed, copy_bw)),
        ]
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # a failed row; the other checks still run
                record(name, backend, "raised", f"{type(exc).__name__}: {exc}"[:160], False)
    print()
    print_table()
    ok = bool(usable) and all(r.ok is not False for r in ROWS)
    verdict = "ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED"
    print(f"\n{verdict} in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
