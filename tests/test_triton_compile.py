"""The Triton kernel compiled for real GPUs, without one: Triton ships its own ptxas.

The interpreter tests run the kernel's logic in numpy; this compiles it to sm80 / sm86 / sm90
machine code as a GPU run would (float8 KV and MLA latent rows included), which catches what
only the compiler checks (dot shapes and types, layouts) and the shared memory a program needs
against the smallest sm80+ budget.
It runs in a subprocess: the test session runs Triton in its interpreter mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SMEM_SM86 = 99 * 1024  # the smallest per-block shared memory of the sm80+ GPUs Triton targets

_COMPILE = """
import inspect, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedkv.attention._triton import BLOCK_M_DECODE, tile_sizes
from pagedkv.attention._triton_kernel import paged_attention_kernel as kernel

names = list(inspect.signature(kernel.fn).parameters)
results = []
elems = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}
for case in json.loads(sys.argv[1]):
    dtype, kv_dtype, head_dim, rope_dim, mode, group, cap, arch, mask, sinks = case
    torch_dtype = getattr(torch, dtype)
    block_d, block_n, block_m_prefill = tile_sizes(head_dim, torch_dtype)
    sig = {}
    for n in names:
        if n in ("q_ptr", "out_ptr", "sinks_ptr"):
            sig[n] = "*" + elems[dtype]
        elif n == "kv_ptr":
            sig[n] = "*" + elems[kv_dtype]
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        elif n in ("k_scale", "pe_scale", "v_scale", "soft_cap"):
            sig[n] = "fp32"
        elif n.startswith("stride") or n in ("window", "chunk"):
            sig[n] = "i32"
        else:
            sig[n] = "constexpr"
    const = {
        "PAGE": 16, "GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": block_d,
        "ROPE_DIM": rope_dim, "BLOCK_R": max(16, 1 << (rope_dim - 1).bit_length()),
        "MLA": rope_dim > 0,
        "BLOCK_M": BLOCK_M_DECODE if mode == "decode" else block_m_prefill, "BLOCK_N": block_n,
        "HAS_CAP": cap, "HAS_WINDOW": mask == "window", "HAS_CHUNK": mask == "chunk",
        "HAS_SINKS": sinks, "PRECISION": "ieee" if dtype == "float32" else "tf32",
        "DOT_FP32": False,
    }
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}
    )
    out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    results.append(out.metadata.shared)
print(json.dumps(results))
"""

# (query dtype, KV dtype, head_dim or MLA latent, MLA rope part, mode, group, cap, sm,
# window or chunk mask, sinks).
CASES = [
    ("bfloat16", "bfloat16", 128, 0, "decode", 4, False, 90, None, False),
    ("bfloat16", "bfloat16", 128, 0, "prefill", 8, True, 90, None, False),
    ("float16", "float16", 64, 0, "prefill", 1, False, 80, None, False),
    ("bfloat16", "bfloat16", 256, 0, "prefill", 4, False, 86, None, False),
    ("float32", "float32", 128, 0, "prefill", 4, True, 86, None, False),
    ("float32", "float32", 256, 0, "prefill", 4, False, 86, None, False),
    # float8 KV (compute capability 8.9+) and MLA's 512 + 64 latent rows.
    ("bfloat16", "float8_e4m3fn", 128, 0, "decode", 4, False, 90, None, False),
    ("float16", "float8_e5m2", 128, 0, "prefill", 4, False, 89, None, False),
    ("bfloat16", "bfloat16", 512, 64, "decode", 16, False, 86, None, False),
    ("bfloat16", "bfloat16", 512, 64, "prefill", 16, False, 86, None, False),
    ("bfloat16", "float8_e4m3fn", 512, 64, "decode", 128, False, 90, None, False),
    # Sliding windows and chunks (the key loop starts past 0), with and without sinks.
    ("bfloat16", "bfloat16", 128, 0, "decode", 8, False, 90, "window", True),
    ("bfloat16", "bfloat16", 64, 0, "prefill", 8, True, 86, "window", True),
    ("float16", "float16", 128, 0, "prefill", 4, False, 80, "chunk", False),
    ("bfloat16", "bfloat16", 128, 0, "decode", 4, False, 90, None, True),
]


def test_kernel_compiles_for_sm80_to_sm90_within_shared_memory() -> None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences Triton 3.9's warning about its default
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, nbytes in zip(CASES, shared, strict=True):
        assert 0 < nbytes <= SMEM_SM86, (case, nbytes)
