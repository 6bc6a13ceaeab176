"""How the FlashInfer backend calls FlashInfer, checked on the CPU with a recording stand-in.

The stand-in records every constructor and `plan` call; the tests check what a GPU would care
about (non-blocking planning, host arrays from the pinned staging buffer, page indices on the
device, one workspace of the configured size, fixed buffers for CUDA-graph buckets), and that
every argument name exists in the installed FlashInfer's signatures. FlashInfer imports without
a GPU; CI installs it from the device kit and names the folder in `PAGEDKV_FLASHINFER_SITE`.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import pagedkv.attention._flashinfer as fi_backend
from pagedkv import Attention, Batch, BlockManager
from pagedkv.attention import DeviceBlockTable, PagedAttention, plan_from_tables
from pagedkv.kv_cache import KVCache
from pagedkv.kv_layout import KVLayout


class Recorder:
    """A FlashInfer wrapper class that records its calls."""

    calls: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((type(self).__name__, "__init__", args, kwargs))

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((type(self).__name__, "plan", args, kwargs))

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append((type(self).__name__, "run", args, kwargs))
        q: torch.Tensor = args[0] if args else kwargs["query"]
        return q.clone()


@pytest.fixture
def recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    calls: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []
    decode = type("BatchDecodeWithPagedKVCacheWrapper", (Recorder,), {"calls": calls})
    prefill = type("BatchPrefillWithPagedKVCacheWrapper", (Recorder,), {"calls": calls})
    mla = type("BatchMLAPagedAttentionWrapper", (Recorder,), {"calls": calls})
    sink = type("BatchAttentionWithAttentionSinkWrapper", (Recorder,), {"calls": calls})

    def csr(*args: Any) -> tuple[Any, ...]:
        calls.append(("MLAPlanMetadata", "csr", args, {}))
        return args

    fake = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=decode,
        BatchPrefillWithPagedKVCacheWrapper=prefill,
        BatchMLAPagedAttentionWrapper=mla,
        BatchAttentionWithAttentionSinkWrapper=sink,
        mla=SimpleNamespace(MLAPlanMetadata=SimpleNamespace(csr=csr)),
    )
    monkeypatch.setattr(fi_backend, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(fi_backend, "check_spec", lambda spec: None)  # lets it run on the CPU
    return calls


def attention(**kwargs: Any) -> PagedAttention:
    heads = 1 if kwargs.get("layout") == "MLA" else 2
    return PagedAttention(8, heads, 16, 4, "flashinfer", dtype=torch.float32, **kwargs)


def cache_for(attn: PagedAttention, scales: Any = None) -> KVCache:
    s = attn.spec
    return KVCache(
        1,
        6,
        4,
        s.num_kv_heads,
        16,
        s.kv_dtype,
        layout=s.layout.name,
        rope_dim=s.layout.rope_dim,
        scales=scales,
    )


SINKS = torch.linspace(-1.0, 1.0, 8, dtype=torch.bfloat16)
FULL = Attention.full()


def step(
    attn: PagedAttention,
    q_lens: list[int],
    cache: KVCache | None = None,
    what: Attention = FULL,
) -> None:
    tables = [[3, 1, 4], [0, 5], [2]]
    attn.plan(plan_from_tables(tables, [9, 6, 2], q_lens, 4, what))
    rows = attn.graph_batch_size or sum(q_lens)
    q = torch.zeros(rows, 8, attn.spec.qk_dim)
    attn.run(q, cache or cache_for(attn), 0, sinks=SINKS if attn.spec.sinks else None)


def calls_named(calls: list[Any], cls: str, method: str) -> list[Any]:
    return [c for c in calls if c[0] == cls and c[1] == method]


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 2]])
def test_a_sliding_window_is_window_left(recorded: list[Any], q_lens: list[int]) -> None:
    attn = attention()
    tables = [[3, 1, 4], [0, 5], [2]]
    for window, window_left in ((None, -1), (6, 5)):
        what = Attention.full() if window is None else Attention.sliding_window(window)
        attn.plan(plan_from_tables(tables, [9, 6, 2], q_lens, 4, what))
        *_, kwargs = [c for c in recorded if c[1] == "plan"][-1]
        assert kwargs["window_left"] == window_left
    chunked = plan_from_tables(tables, [9, 6, 2], q_lens, 4, Attention.chunked_local(8))
    with pytest.raises(ValueError, match=r"plan\.attention.*chunked-local"):
        attn.plan(chunked)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 2]])
def test_sinks_run_on_the_attention_sink_wrapper(recorded: list[Any], q_lens: list[int]) -> None:
    # Decode and prefill steps alike, one wrapper per module (with and without a window).
    attn = attention(sinks=True, sm_scale=0.3)
    cls = "BatchAttentionWithAttentionSinkWrapper"
    for what, window_left in ((FULL, -1), (Attention.sliding_window(6), 5)):
        recorded.clear()
        step(attn, q_lens, what=what)
        assert {c[0] for c in recorded} == {cls}
        ((_, _, init_args, init),) = calls_named(recorded, cls, "__init__")
        assert init_args[1] == "NHD" and init["backend"] == "fa2"
        assert init["window_left"] == (0 if window_left >= 0 else -1)
        assert init["q_data_type"] == init["kv_data_type"] == torch.float32
        assert init["head_dim_qk"] == init["head_dim_vo"] == 16
        ((_, _, args, kwargs),) = calls_named(recorded, cls, "plan")
        assert args[0].tolist() == [0, *np.cumsum(q_lens).tolist()]
        assert args[1].tolist() == [0, 3, 5, 6] and args[2].tolist() == [3, 1, 4, 0, 5, 2]
        assert args[3].tolist() == [1, 2, 2] and args[4:] == (8, 2, 16, 4)
        assert kwargs["causal"] is True and kwargs["window_left"] == window_left
        assert kwargs["non_blocking"] is True and kwargs["sm_scale"] == 0.3
        ((_, _, run_args, run_kwargs),) = calls_named(recorded, cls, "run")
        _, kv, sinks, sm_scale = run_args
        assert kv.shape == (6, 2, 4, 2, 16) and run_kwargs == {}
        assert sinks.dtype == torch.float32 and torch.equal(sinks, SINKS.float())
        assert sm_scale == 0.3
    recorded.clear()
    step(attn, q_lens)  # the wrapper without a window is reused
    assert not calls_named(recorded, cls, "__init__")


def test_sink_graph_buckets_get_fixed_buffers(recorded: list[Any]) -> None:
    attn = attention(sinks=True, cuda_graph_batch_sizes=(4,), cuda_graph_max_pages=32)
    step(attn, [1, 1, 1])
    assert attn.graph_batch_size == 4
    graph_inits = [c for c in recorded if c[1] == "__init__" and c[3].get("use_cuda_graph")]
    ((cls, _, _, kwargs),) = graph_inits
    assert cls == "BatchAttentionWithAttentionSinkWrapper"
    assert kwargs["qo_indptr_buf"].shape == kwargs["paged_kv_indptr_buf"].shape == (5,)
    assert kwargs["paged_kv_indices_buf"].shape == (32,)
    assert kwargs["paged_kv_last_page_len_buf"].shape == (4,)
    ((_, _, args, _),) = [c for c in recorded if c[1] == "plan"]
    assert args[0].tolist() == [0, 1, 2, 3, 4] and args[3].tolist() == [1, 2, 2, 1]


def test_what_flashinfer_cannot_run_is_named() -> None:
    # FlashInfer has no chunked-local mask, and its sink wrapper no soft cap, float8 or MLA.
    base = PagedAttention(8, 2, 64, 16, dtype=torch.bfloat16).spec
    cuda = replace(base, device=torch.device("cuda", 0))
    chunks = replace(cuda, attention=Attention.chunked_local(8192))
    with pytest.raises(ValueError, match=r"chunked_local\(8192\): .*no chunked-local"):
        fi_backend.check_spec(chunks)
    assert fi_backend.unsupported(replace(cuda, sinks=True)) is None
    for change, why in (
        ({"logits_soft_cap": 30.0}, "no logits soft cap"),
        ({"kv_dtype": E4M3}, "no float8 KV scales"),
        ({"layout": KVLayout("MLA", 1, 512, 64), "head_dim": 512}, "MLA takes no attention sinks"),
    ):
        with pytest.raises(ValueError, match=f"with attention sinks: .*{why}"):
            fi_backend.check_spec(replace(cuda, sinks=True, **change))


def test_one_workspace_of_the_configured_size(recorded: list[Any]) -> None:
    attention()
    inits = [c for c in recorded if c[1] == "__init__"]
    assert len(inits) == 2
    workspaces = {c[2][0].data_ptr() for c in inits}
    assert len(workspaces) == 1
    assert inits[0][2][0].numel() == fi_backend.DEFAULT_WORKSPACE_BYTES == 384 << 20
    recorded.clear()
    attention(workspace_bytes=1 << 20)
    assert recorded[0][2][0].numel() == 1 << 20
    assert all(c[3]["backend"] == "fa2" for c in recorded)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_plan_is_non_blocking_from_the_staging_buffer(recorded: list[Any], mode: str) -> None:
    attn = attention()
    staging = attn._impl._staging  # type: ignore[attr-defined]
    q_lens = [1, 1, 1] if mode == "decode" else [3, 1, 2]
    step(attn, q_lens)
    cls = (
        "BatchDecodeWithPagedKVCacheWrapper"
        if mode == "decode"
        else ("BatchPrefillWithPagedKVCacheWrapper")
    )
    ((_, _, args, kwargs),) = calls_named(recorded, cls, "plan")
    assert kwargs["non_blocking"] is True
    assert kwargs["logits_soft_cap"] is None and kwargs["sm_scale"] == 0.25
    host = staging._host[staging._turn]
    arrays = list(args[:4] if mode == "prefill" else args[:3])
    if mode == "prefill":
        assert kwargs["causal"] is True
        qo = arrays.pop(0)
        assert qo.tolist() == [0, 3, 4, 6]
        assert qo.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    indptr, indices, last = arrays
    assert indptr.tolist() == [0, 3, 5, 6] and last.tolist() == [1, 2, 2]
    assert indices.tolist() == [3, 1, 4, 0, 5, 2]
    # indptr and last-page lengths are views of the (pinned on CUDA) staging buffer; the page
    # indices are the device copy of it.
    for t in (indptr, last):
        assert t.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    dev = staging._dev[staging._turn]
    assert indices.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()
    # The next step stages into the other buffer, so this step's arrays stay intact.
    step(attn, q_lens)
    assert indptr.tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("graph", [False, True])
def test_a_persistent_batch_hands_over_its_device_csr(recorded: list[Any], graph: bool) -> None:
    # plan(batch, table=...): FlashInfer gets the pages built on the device from the table
    # (nothing of them staged on the host), the row arrays from the staging buffer as usual.
    kwargs: dict[str, Any] = {"cuda_graph_batch_sizes": (4,), "cuda_graph_max_pages": 32}
    attn = attention(**(kwargs if graph else {}))
    mgr = BlockManager(32, 4, hash_key=bytes(32))
    batch, table = Batch(), DeviceBlockTable("cpu")
    for seq_id, length in ((1, 9), (2, 3)):
        mgr.allocate(seq_id, list(range(length)))
        mgr.plan([seq_id], [length])
        batch.add(seq_id)
    mgr.step_batch(batch, [5, 5])
    staging = attn._impl._staging  # type: ignore[attr-defined]
    attn.plan(batch, table=table)
    ((_, _, args, _),) = [c for c in recorded if c[1] == "plan"]
    indptr, indices, last = args[:3]
    expected = batch.kv_indices.tolist() + ([0, 0] if graph else [])
    assert indices.tolist() == expected
    assert indices.untyped_storage().data_ptr() != (
        staging._dev[staging._turn].untyped_storage().data_ptr()
    )
    assert indptr.tolist()[:3] == batch.kv_indptr.tolist()
    assert last.tolist()[:2] == batch.kv_last_page_len.tolist()
    assert staging._staged == indptr.shape[0] + last.shape[0]  # no pages staged


def test_graph_buckets_get_fixed_buffer_wrappers(recorded: list[Any]) -> None:
    attn = attention(cuda_graph_batch_sizes=(4, 8), cuda_graph_max_pages=32)
    step(attn, [1, 1, 1])
    assert attn.graph_batch_size == 4
    graph_inits = [c for c in recorded if c[1] == "__init__" and c[3].get("use_cuda_graph")]
    assert len(graph_inits) == 1
    kwargs = graph_inits[0][3]
    assert kwargs["paged_kv_indptr_buffer"].shape == (5,)
    assert kwargs["paged_kv_last_page_len_buffer"].shape == (4,)
    assert kwargs["paged_kv_indices_buffer"].shape == (32,)
    plan = recorded[-2]
    assert plan[1] == "plan"
    assert plan[2][0].tolist() == [0, 3, 5, 6, 7]  # padded with a one-page sequence
    assert plan[2][2].tolist() == [1, 2, 2, 1]
    step(attn, [1, 1, 1])  # the same bucket reuses its wrapper
    assert len([c for c in recorded if c[1] == "__init__" and c[3].get("use_cuda_graph")]) == 1


def test_run_checks_the_cache_once_per_plan(
    recorded: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    attn = attention()
    checks = []
    real = attn._check_cache
    monkeypatch.setattr(attn, "_check_cache", lambda c, s: checks.append(1) or real(c, s))
    cache = KVCache(3, 6, 4, 2, 16, dtype=torch.float32)
    attn.plan(plan_from_tables([[3, 1, 4]], [9], [1], 4))
    for layer in range(3):
        attn.run(torch.zeros(1, 8, 16), cache, layer)
    assert len(checks) == 1
    attn.plan(plan_from_tables([[3, 1, 4]], [9], [1], 4))
    attn.run(torch.zeros(1, 8, 16), cache, 0)
    assert len(checks) == 2
    with pytest.raises(ValueError, match="references block 4"):
        attn.run(torch.zeros(1, 8, 16), KVCache(1, 4, 4, 2, 16, dtype=torch.float32), 0)


E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_hnd_and_float8_reach_the_wrappers(recorded: list[Any], mode: str) -> None:
    attn = attention(layout="HND", kv_dtype=E4M3)
    step(attn, [1, 1, 1] if mode == "decode" else [3, 1, 2], cache_for(attn, [[0.5, 0.25]]))
    inits = [c for c in recorded if c[1] == "__init__"]
    assert all(c[2][1] == "HND" for c in inits)
    ((_, _, _, plan_kwargs),) = [c for c in recorded if c[1] == "plan"]
    assert plan_kwargs["kv_data_type"] == E4M3 and plan_kwargs["q_data_type"] == torch.float32
    ((_, _, args, run_kwargs),) = [c for c in recorded if c[1] == "run"]
    assert run_kwargs == {"k_scale": 0.5, "v_scale": 0.25}
    assert args[1].shape == (6, 2, 2, 4, 16)  # the HND layer itself


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 2]])
def test_mla_plans_one_wrapper_for_every_phase(recorded: list[Any], q_lens: list[int]) -> None:
    attn = attention(layout="MLA", rope_dim=64, kv_dtype=E4M3)
    step(attn, q_lens, cache_for(attn, [[0.5, 0.25]]))
    assert {c[0] for c in recorded} == {"BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"}
    ((_, _, csr, _),) = calls_named(recorded, "MLAPlanMetadata", "csr")
    qo, indptr, indices, kv_lens = csr
    assert qo.tolist() == [0, *np.cumsum(q_lens).tolist()]
    assert indptr.tolist() == [0, 3, 5, 6] and kv_lens.tolist() == [9, 6, 2]
    assert indices.tolist() == [3, 1, 4, 0, 5, 2]
    ((_, _, _, kwargs),) = calls_named(recorded, "BatchMLAPagedAttentionWrapper", "plan")
    assert kwargs["metadata"] == csr
    assert (kwargs["num_heads"], kwargs["head_dim_ckv"], kwargs["head_dim_kpe"]) == (8, 16, 64)
    assert kwargs["page_size"] == 4 and kwargs["causal"] is True
    assert kwargs["sm_scale"] == 80**-0.5 and kwargs["kv_data_type"] == E4M3
    assert kwargs["scale_mode"] == "kv-per-tensor"
    ((_, _, _, run_kwargs),) = calls_named(recorded, "BatchMLAPagedAttentionWrapper", "run")
    assert run_kwargs["query"].shape == (sum(q_lens), 8, 80)
    assert run_kwargs["kv_cache"].shape == (6, 4, 80)
    assert (run_kwargs["ckv_scale"], run_kwargs["kpe_scale"]) == (0.5, 0.25)


def test_mla_graph_buckets_get_fixed_buffers(recorded: list[Any]) -> None:
    attn = attention(
        layout="MLA", rope_dim=64, cuda_graph_batch_sizes=(4,), cuda_graph_max_pages=32
    )
    step(attn, [1, 1, 1])
    assert attn.graph_batch_size == 4
    graph_inits = [c for c in recorded if c[1] == "__init__" and c[3].get("use_cuda_graph")]
    ((_, _, _, kwargs),) = graph_inits
    assert kwargs["qo_indptr"].shape == kwargs["kv_indptr"].shape == (5,)
    assert kwargs["kv_indices"].shape == (32,) and kwargs["kv_len_arr"].shape == (4,)
    ((_, _, csr, _),) = calls_named(recorded, "MLAPlanMetadata", "csr")
    assert csr[3].tolist() == [9, 6, 2, 1]  # padded with a one-token sequence


# ---------------------------------------------------------------------------------------------
# Argument names against the installed FlashInfer.

_DUMP = """
import inspect, json, flashinfer, flashinfer.mla
out = {"version": flashinfer.__version__}
def dump(name, f, first=()):
    sig = inspect.signature(f)
    out[name] = list(first) + [
        (p.name, p.kind.name, p.default is not p.empty) for p in sig.parameters.values()
    ]
for cls in (
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchAttentionWithAttentionSinkWrapper",
):
    c = getattr(flashinfer, cls)
    for m in ("__init__", "plan", "_plan_impl", "run"):
        if hasattr(c, m):
            dump(cls + "." + m, getattr(c, m))
# A classmethod's signature has no cls; _bind passes one.
dump("MLAPlanMetadata.csr", flashinfer.mla.MLAPlanMetadata.csr, [("cls", "POSITIONAL_ONLY", False)])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def signatures() -> dict[str, Any]:
    env = dict(os.environ)
    site = os.environ.get("PAGEDKV_FLASHINFER_SITE")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.skip(f"FlashInfer does not import: {proc.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _bind(params: list[list[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    sig = inspect.Signature(
        [
            inspect.Parameter(
                name,
                getattr(inspect.Parameter, kind),
                default=None if has_default else inspect.Parameter.empty,
            )
            for name, kind, has_default in params
        ]
    )
    sig.bind(None, *args, **kwargs)  # raises TypeError on an unknown or missing argument


def test_argument_names_exist_in_flashinfer(
    recorded: list[Any], signatures: dict[str, Any]
) -> None:
    layouts: list[dict[str, Any]] = [
        {},
        {"layout": "HND", "kv_dtype": E4M3},
        {"layout": "MLA", "rope_dim": 64},
        {"layout": "MLA", "rope_dim": 64, "kv_dtype": E4M3},
        {"sinks": True},
        {"sinks": True, "layout": "HND"},
    ]
    for graph in (False, True):
        for layout in layouts:
            attn = attention(
                cuda_graph_batch_sizes=(4,) if graph else (),
                cuda_graph_max_pages=32 if graph else 0,
                **layout,
            )
            step(attn, [1, 1, 1])
            step(attn, [3, 1, 2])
            if layout.get("layout") != "MLA":
                step(attn, [3, 1, 2], what=Attention.sliding_window(6))
    assert {(c[0], c[1]) for c in recorded} >= {
        ("BatchDecodeWithPagedKVCacheWrapper", "__init__"),
        ("BatchDecodeWithPagedKVCacheWrapper", "plan"),
        ("BatchDecodeWithPagedKVCacheWrapper", "run"),
        ("BatchPrefillWithPagedKVCacheWrapper", "plan"),
        ("BatchMLAPagedAttentionWrapper", "__init__"),
        ("BatchMLAPagedAttentionWrapper", "plan"),
        ("BatchMLAPagedAttentionWrapper", "run"),
        ("MLAPlanMetadata", "csr"),
        ("BatchAttentionWithAttentionSinkWrapper", "__init__"),
        ("BatchAttentionWithAttentionSinkWrapper", "plan"),
        ("BatchAttentionWithAttentionSinkWrapper", "run"),
    }
    for cls, method, args, kwargs in recorded:
        _bind(signatures[f"{cls}.{method}"], args, kwargs)
        impl = signatures.get(f"{cls}._plan_impl")
        if method == "plan" and impl is not None:
            # decode's plan forwards **kwargs to _plan_impl, whose keywords are the real check.
            _bind(impl, args, kwargs)
