"""The step-time model: how long one continuous-batching step takes on the simulated GPUs.

Decode is memory-bound: a step reads every weight once and the KV of every running sequence
once, so its decode part takes (weight bytes + KV bytes read) / achieved memory bandwidth;
decode throughput is the tokens a step generates over that time. Prompt tokens computed in
the step (prefill, recompute after preemption) add 2 * parameters FLOPs each at the achieved
dense 16-bit FLOP/s. Achieved = peak (datasheet) x an efficiency: real kernels reach neither
peak. Tensor parallelism over several GPUs is taken as ideal (bandwidth and FLOPs add up, no
communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.simulate.errors import ConfigError
from pagedkv.simulate.presets import GpuPreset, ModelPreset

# Achieved fraction of peak memory bandwidth in decode: gpt-fast (PyTorch, 2023) measured
# 1397.31 GB/s decoding Llama-2-7B in bf16 on an A100-80GB (peak 2039 GB/s), about 68.5%.
DECODE_BANDWIDTH_FRACTION = 1397.31 / 2039
DECODE_BANDWIDTH_SOURCE = (
    "gpt-fast (github.com/pytorch-labs/gpt-fast, 2023): Llama-2-7B bf16 decode at "
    "1397.31 GB/s on an A100-80GB (power-limited to 330 W) of 2039 GB/s peak"
)

# Achieved fraction of peak FLOP/s in prefill: Pope et al., 'Efficiently Scaling Transformer
# Inference' (MLSys 2023), 76% model FLOPs utilization processing input tokens at large batch.
PREFILL_FLOP_FRACTION = 0.76
PREFILL_FLOP_SOURCE = (
    "Pope et al., 'Efficiently Scaling Transformer Inference', MLSys 2023: 76% MFU on "
    "large-batch input tokens (PaLM 540B, TPU v4)"
)


def check_fraction(value: float, what: str) -> None:
    """Raise ConfigError unless `value` is in (0, 1]."""
    if not 0 < value <= 1:  # also rejects nan
        raise ConfigError(f"{what} must be in (0, 1], got {value}")


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step from bytes read and prompt tokens computed.

    `bandwidth` and `flops` are the GPUs' peaks; `bandwidth_fraction` and `flop_fraction`
    are the shares of them that decode and prefill achieve (1.0: ideal hardware).
    """

    weight_bytes: float
    kv_bytes_per_token: int
    num_params: float
    bandwidth: float  # peak bytes/s over all GPUs
    flops: float  # peak FLOP/s over all GPUs
    bandwidth_fraction: float  # see DECODE_BANDWIDTH_FRACTION
    flop_fraction: float  # see PREFILL_FLOP_FRACTION

    def __post_init__(self) -> None:
        check_fraction(self.bandwidth_fraction, "decode bandwidth fraction")
        check_fraction(self.flop_fraction, "prefill FLOP fraction")

    @classmethod
    def for_hardware(
        cls,
        model: ModelPreset,
        gpu: GpuPreset,
        num_gpus: int,
        *,
        bandwidth_fraction: float,
        flop_fraction: float,
    ) -> StepTimeModel:
        """The model for `model` on `num_gpus` GPUs of kind `gpu`."""
        return cls(
            weight_bytes=model.weight_bytes,
            kv_bytes_per_token=model.kv_bytes_per_token,
            num_params=model.num_params,
            bandwidth=gpu.bandwidth * num_gpus,
            flops=gpu.flops * num_gpus,
            bandwidth_fraction=bandwidth_fraction,
            flop_fraction=flop_fraction,
        )

    def decode_seconds(self, context_tokens: float) -> float:
        """Reading the weights and the KV of `context_tokens` once (tokens of every layer)."""
        read = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        return read / (self.bandwidth * self.bandwidth_fraction)

    def prefill_seconds(self, prefill_tokens: int) -> float:
        """Computing `prefill_tokens` prompt tokens."""
        return 2.0 * self.num_params * prefill_tokens / (self.flops * self.flop_fraction)
