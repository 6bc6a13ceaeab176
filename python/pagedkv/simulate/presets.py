"""Named traces, models and GPUs for the simulator, each with the source of its numbers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv import Attention
from pagedkv.groups import KVGroups, layer_attention
from pagedkv.kv_layout import KVLayout, Layout
from pagedkv.simulate.errors import ConfigError


@dataclass(frozen=True)
class TracePreset:
    """Published length statistics of a request trace; the simulator draws synthetic requests."""

    name: str
    mean_prompt: float
    mean_output: float
    source: str


@dataclass(frozen=True)
class UniformTracePreset:
    """Prompt and output lengths drawn uniformly from inclusive ranges."""

    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    source: str


@dataclass(frozen=True)
class ChatTracePreset:
    """Multi-turn sessions: each prompt is the previous prompt, its output and a new message.

    Messages (the first prompt too) and outputs are log-normal with these means; turns of a
    session arrive `think` seconds apart on average (exponential).
    """

    name: str
    turns: int
    mean_message: float
    mean_output: float
    think: float
    source: str


def gated_deltanet_state_bytes(
    *,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    conv_kernel: int,
    dtype_bytes: int,
) -> int:
    """Bytes of one sequence's state in one Gated DeltaNet layer, as transformers' cache of
    Qwen3-Next holds it (`LinearAttentionLayer`, `Qwen3NextGatedDeltaNet`): a conv state of
    (2 x key heads x key dim + value heads x value dim) channels x `conv_kernel` positions,
    and a recurrent state of value heads x key dim x value dim."""
    conv = (2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim) * conv_kernel
    recurrent = num_value_heads * key_head_dim * value_head_dim
    return (conv + recurrent) * dtype_bytes


@dataclass(frozen=True)
class ModelPreset:
    """A model as the simulator sees it: KV bytes per token, weight bytes and context length.

    `kv_layout` is per-head K and V (`NHD`) or MLA's latent of `head_dim` plus `rope_dim`.
    `attention` gives each layer's attention (empty: every layer is full attention).
    `num_layers` counts the layers with a KV cache; a hybrid recurrent model (Mamba, linear
    attention) also has `num_state_layers` layers whose fixed-size states take `state_bytes`
    per sequence, all of them together.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    max_len: int
    source: str
    dtype_bytes: float = 2  # fp16 / bf16 weights
    kv_layout: Layout = "NHD"
    rope_dim: int = 0
    kv_dtype_bytes: int = 2  # 1 for a float8 KV cache
    attention: tuple[Attention, ...] = ()
    num_state_layers: int = 0
    state_bytes: int = 0

    def __post_init__(self) -> None:
        if self.attention and len(self.attention) != self.num_layers:
            raise ConfigError(
                f"{self.name}: {len(self.attention)} layer attentions for {self.num_layers} layers"
            )
        if (self.num_state_layers > 0) != (self.state_bytes > 0):
            raise ConfigError(
                f"{self.name}: {self.num_state_layers} recurrent layers with a state of "
                f"{self.state_bytes} bytes (both or neither)"
            )

    @property
    def has_state(self) -> bool:
        """Whether some layers keep a recurrent state instead of a KV cache."""
        return self.state_bytes > 0

    @property
    def state_token_slots(self) -> float:
        """One sequence's recurrent state in token slots of the KV layers (its bytes over the
        KV bytes of a token), the unit the simulator reports memory in."""
        return self.state_bytes / self.kv_bytes_per_token

    def full_attention_everywhere(self) -> ModelPreset:
        """The same model with a full-attention layer, like its own, for each recurrent one."""
        return dataclasses.replace(
            self,
            name=f"{self.name} with full attention everywhere",
            num_layers=self.num_layers + self.num_state_layers,
            attention=(),
            num_state_layers=0,
            state_bytes=0,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV of every layer for one token."""
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        """The KV of one layer for one token."""
        kv = KVLayout(self.kv_layout, self.num_kv_heads, self.head_dim, self.rope_dim)
        return kv.bytes_per_token(1, self.kv_dtype_bytes)

    @property
    def layers(self) -> tuple[Attention, ...]:
        """Each layer's attention."""
        return self.attention or (Attention.full(),) * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer attends to less than every token."""
        return any(a.kind != "full" for a in self.layers)

    def groups(self, layers_per_group: int | None = None) -> KVGroups:
        """The model's KV-cache groups (`pagedkv.groups`; None: the default group size)."""
        return KVGroups.from_layers(self.layers, layers_per_group=layers_per_group)

    def needed_slots(self, lengths: npt.NDArray[np.int64], block_size: int) -> float:
        """Token slots (one token of every layer) that sequences of `lengths` tokens need if
        each layer holds exactly what its queries can still read: full attention every
        token, a window W min(len, W + block_size) tokens, a chunk C the current chunk's; and
        each sequence's recurrent state (`state_token_slots`)."""
        total = len(lengths) * self.state_token_slots * self.num_layers
        for attention in set(self.layers):
            count = self.layers.count(attention)
            if attention.window is not None:
                held = np.minimum(lengths, attention.window + block_size)
            elif attention.chunk is not None:
                held = lengths - (lengths - 1) // attention.chunk * attention.chunk
            else:
                held = lengths
            total += count * float(np.sum(held))
        return total / self.num_layers

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read once per decode step."""
        return self.num_params * self.dtype_bytes


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's memory size, memory bandwidth and dense 16-bit tensor throughput."""

    name: str
    memory_bytes: int
    bandwidth: float  # bytes per second
    flops: float  # dense fp16/bf16 FLOP/s
    source: str


_MIB = 1 << 20

TRACES: dict[str, TracePreset] = {
    t.name: t
    for t in (
        TracePreset(
            "sharegpt",
            161.31,
            337.99,
            "ShareGPT conversations; means as reported by Kwon et al., 'Efficient Memory "
            "Management for Large Language Model Serving with PagedAttention', SOSP 2023, Fig. 11",
        ),
        TracePreset(
            "alpaca",
            19.31,
            58.45,
            "Alpaca instructions; means as reported by Kwon et al., SOSP 2023, Fig. 11",
        ),
        TracePreset(
            "azure-conv",
            1155.0,
            211.0,
            "Azure LLM inference trace 2023, conversation service (Patel et al., 'Splitwise', "
            "ISCA 2024; github.com/Azure/AzurePublicDataset)",
        ),
        TracePreset(
            "azure-code",
            2048.0,
            28.0,
            "Azure LLM inference trace 2023, coding service (Patel et al., 'Splitwise', "
            "ISCA 2024; github.com/Azure/AzurePublicDataset)",
        ),
    )
}

UNIFORM_TRACES: dict[str, UniformTracePreset] = {
    t.name: t
    for t in (
        UniformTracePreset(
            "long-16k-32k",
            (16384, 32768),
            (128, 512),
            "long prompts, where windowed layers save most; both ranges are our choice",
        ),
    )
}

CHAT_TRACES: dict[str, ChatTracePreset] = {
    t.name: t
    for t in (
        ChatTracePreset(
            "chat",
            6,
            161.31,
            337.99,
            30.0,
            "message and output means are ShareGPT's (Kwon et al., SOSP 2023, Fig. 11); the "
            "30 s mean think time is our assumption",
        ),
    )
}

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("OPT-13B", 40, 40, 128, 12.85e9, 2048, "facebook/opt-13b config.json"),
        ModelPreset(
            "Llama-2-7B", 32, 32, 128, 6.74e9, 4096, "meta-llama/Llama-2-7b-hf config.json"
        ),
        ModelPreset(
            "Llama-3-8B", 32, 8, 128, 8.03e9, 8192, "meta-llama/Meta-Llama-3-8B config.json"
        ),
        ModelPreset(
            "Llama-3-70B", 80, 8, 128, 70.55e9, 8192, "meta-llama/Meta-Llama-3-70B config.json"
        ),
        ModelPreset("Qwen2.5-7B", 28, 4, 128, 7.62e9, 32768, "Qwen/Qwen2.5-7B config.json"),
        ModelPreset(
            "DeepSeek-V2-Lite",
            27,
            1,
            512,
            15.7e9,
            32768,
            "deepseek-ai/DeepSeek-V2-Lite config.json (MLA: kv_lora_rank 512, rope 64)",
            kv_layout="MLA",
            rope_dim=64,
        ),
        ModelPreset(
            "DeepSeek-V3",
            61,
            1,
            512,
            671e9,
            163840,
            "deepseek-ai/DeepSeek-V3 config.json (MLA: kv_lora_rank 512, rope 64; FP8 weights)",
            dtype_bytes=1,
            kv_layout="MLA",
            rope_dim=64,
        ),
        ModelPreset(
            "gemma-3-27b",
            62,
            16,
            128,
            27.4e9,
            131072,
            "huggingface.co/google/gemma-3-27b-it/blob/main/config.json (text_config: 62 layers, "
            "16 KV heads, head_dim 128, sliding_window 1024, sliding_window_pattern 6: every "
            "6th layer full)",
            attention=tuple(
                layer_attention(
                    {"num_hidden_layers": 62, "sliding_window": 1024, "sliding_window_pattern": 6}
                )
            ),
        ),
        ModelPreset(
            "gpt-oss-120b",
            36,
            8,
            64,
            116.8e9,
            131072,
            "huggingface.co/openai/gpt-oss-120b/blob/main/config.json (36 layers alternating "
            "sliding_attention (sliding_window 128) and full_attention, 8 KV heads, head_dim 64; "
            "MXFP4 MoE weights, counted at 4.25 bits)",
            dtype_bytes=4.25 / 8,
            attention=tuple(
                layer_attention(
                    {
                        "num_hidden_layers": 36,
                        "sliding_window": 128,
                        "layer_types": ["sliding_attention", "full_attention"] * 18,
                    }
                )
            ),
        ),
        ModelPreset(
            "llama-4-scout",
            48,
            8,
            128,
            109e9,
            10485760,
            "huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json "
            "(48 layers, 8 KV heads, head_dim 128, attention_chunk_size 8192; no_rope_layers: "
            "every 4th layer is a full-attention NoPE layer, the others chunked)",
            attention=tuple(
                layer_attention(
                    {
                        "num_hidden_layers": 48,
                        "attention_chunk_size": 8192,
                        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
                    }
                )
            ),
        ),
        ModelPreset(
            "qwen3-next-80b",
            12,
            2,
            256,
            80e9,
            262144,
            "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (48 layers, "
            "full_attention_interval 4: 12 full-attention layers with 2 KV heads of head_dim "
            "256, 36 Gated DeltaNet layers with 16 key and 32 value heads of 128, conv kernel "
            "4; about 80B parameters, 3B active; the states in bf16, the model's dtype, in "
            "which transformers' LinearAttentionLayer cache keeps them)",
            num_state_layers=36,
            state_bytes=36
            * gated_deltanet_state_bytes(
                num_key_heads=16,
                num_value_heads=32,
                key_head_dim=128,
                value_head_dim=128,
                conv_kernel=4,
                dtype_bytes=2,
            ),
        ),
    )
}

GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("A100-40GB", 40960 * _MIB, 1.555e12, 312e12, "NVIDIA A100 datasheet (SXM)"),
        GpuPreset("A100-80GB", 81920 * _MIB, 2.039e12, 312e12, "NVIDIA A100 datasheet (SXM)"),
        GpuPreset("H100-80GB", 81559 * _MIB, 3.35e12, 989e12, "NVIDIA H100 datasheet (SXM)"),
        GpuPreset("H200", 143771 * _MIB, 4.8e12, 989e12, "NVIDIA H200 datasheet (SXM)"),
    )
}

# Share of GPU memory a server may use at all; the rest is for the CUDA context and
# activations (vLLM's default `gpu_memory_utilization`).
GPU_MEMORY_UTILIZATION = 0.9


def default_kv_memory(model: ModelPreset, gpu: GpuPreset, num_gpus: int = 1) -> int:
    """KV memory left on `num_gpus` GPUs after the weights: utilization * memory - weights."""
    if num_gpus < 1:
        raise ConfigError(f"num_gpus must be at least 1, got {num_gpus}")
    left = int(GPU_MEMORY_UTILIZATION * gpu.memory_bytes * num_gpus - model.weight_bytes)
    if left <= 0:
        raise ConfigError(
            f"{model.name} weights ({model.weight_bytes / 1e9:.1f} GB) do not fit in "
            f"{num_gpus} x {gpu.name}; use more GPUs (--gpus) or give --kv-memory"
        )
    return left
