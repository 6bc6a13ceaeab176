"""`backend="auto"`: FlashInfer, then Triton, then torch, falling back on any failure."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch

import pagedkv.attention._paged as paged
import pagedkv.attention._select as select
from pagedkv import Attention
from pagedkv.attention import PagedAttention
from pagedkv.attention._spec import AttentionSpec
from pagedkv.kv_layout import KVLayout


def spec(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> AttentionSpec:
    layout = KVLayout("NHD", 2, head_dim)
    return AttentionSpec(
        8, 2, head_dim, 16, 0.1, None, dtype, torch.device("cuda", 0), dtype, layout
    )


def test_auto_on_cpu_is_torch_and_says_why() -> None:
    attn = PagedAttention(4, 4, 8, 16)
    assert attn.backend == "torch"
    assert attn.backend_reason.startswith("auto picked torch because flashinfer needs a CUDA")
    explicit = PagedAttention(4, 4, 8, 16, "torch")
    assert explicit.backend_reason == "backend='torch' was requested"


def test_unfit_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability 8.0+" in str(select.unfit_reason("flashinfer", spec()))
    assert "compute capability 8.0+" in str(select.unfit_reason("triton", spec()))
    assert select.unfit_reason("triton", spec(torch.float16)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "float32" in str(select.unfit_reason("flashinfer", spec(torch.float32)))
    assert "head_dim <= 256" in str(select.unfit_reason("triton", spec(head_dim=512)))
    real_find = importlib.util.find_spec

    def find(name: str, *args: Any) -> Any:
        return object() if name == "flashinfer" else real_find(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(select, "nvcc_available", lambda: False)
    assert "nvcc" in str(select.unfit_reason("flashinfer", spec(head_dim=96)))
    assert select.unfit_reason("flashinfer", spec(head_dim=128)) is None
    monkeypatch.setattr(select, "nvcc_available", lambda: True)
    assert select.unfit_reason("flashinfer", spec(head_dim=96)) is None


def test_flashinfer_is_unfit_for_chunks_and_some_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real_find = importlib.util.find_spec

    def find(name: str, *args: Any) -> Any:
        return object() if name == "flashinfer" else real_find(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(select, "nvcc_available", lambda: True)
    window = replace(spec(), attention=Attention.sliding_window(4096))
    assert select.unfit_reason("flashinfer", window) is None
    chunk = replace(spec(), attention=Attention.chunked_local(8192))
    assert "chunked-local" in str(select.unfit_reason("flashinfer", chunk))
    sinks = replace(window, sinks=True)
    assert select.unfit_reason("flashinfer", sinks) is None
    capped = replace(sinks, logits_soft_cap=30.0)
    assert "sinks: FlashInfer's attention-sink wrapper has no logits soft cap" in str(
        select.unfit_reason("flashinfer", capped)
    )
    # FlashInfer's prebuilt attention-sink modules are for head_dim 64 (gpt-oss) alone.
    monkeypatch.setattr(select, "nvcc_available", lambda: False)
    assert "prebuilt attention-sink kernels for head_dim 128" in str(
        select.unfit_reason("flashinfer", sinks)
    )
    gpt_oss = replace(sinks, head_dim=64, layout=KVLayout("NHD", 2, 64))
    assert select.unfit_reason("flashinfer", gpt_oss) is None
    mla = replace(window, layout=KVLayout("MLA", 1, 512, 64), num_kv_heads=1, head_dim=512)
    assert "sliding window" in str(select.unfit_reason("flashinfer", mla))
    for s in (chunk, sinks, capped, mla):
        assert select.unfit_reason("triton", s) is None


def test_auto_falls_back_when_a_backend_fails_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged, "unfit_reason", lambda name, spec: None)

    def broken(error: type[Exception]) -> Any:
        def build(*args: Any) -> None:
            raise error("undefined symbol: _ZN3c10")

        return build

    monkeypatch.setattr(paged, "FlashInferBackend", broken(OSError))
    monkeypatch.setattr(paged, "TritonBackend", broken(RuntimeError))
    attn = PagedAttention(4, 4, 8, 16, dtype=torch.float32)
    assert attn.backend == "torch"
    assert "flashinfer failed to build: OSError: undefined symbol" in attn.backend_reason
    assert "triton failed to build: RuntimeError" in attn.backend_reason
    # An explicitly requested backend that fails raises instead.
    with pytest.raises(OSError, match="undefined symbol"):
        PagedAttention(4, 4, 8, 16, "flashinfer", dtype=torch.float32)


def test_graph_buckets_need_a_gpu_backend() -> None:
    with pytest.raises(ValueError, match="flashinfer or triton"):
        PagedAttention(4, 4, 8, 16, cuda_graph_batch_sizes=(8,), cuda_graph_max_pages=64)
    with pytest.raises(ValueError, match="cuda_graph_max_pages"):
        PagedAttention(4, 4, 8, 16, cuda_graph_batch_sizes=(8,))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_prefers_flashinfer_then_triton() -> None:
    attn = PagedAttention(8, 8, 128, 16, device="cuda", dtype=torch.bfloat16)
    has_fi = importlib.util.find_spec("flashinfer") is not None
    assert attn.backend == ("flashinfer" if has_fi else "triton")
    f32 = PagedAttention(8, 8, 128, 16, device="cuda", dtype=torch.float32)
    assert f32.backend == "triton"
    assert "FlashInfer takes float16 and bfloat16 queries" in f32.backend_reason
