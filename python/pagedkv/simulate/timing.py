"""The step-time model: how long one continuous-batching step takes on the simulated GPUs.

Decode is memory-bound: a step reads every weight once and the KV of every running sequence
once, so its decode part takes (weight bytes + KV bytes read) / memory bandwidth; decode
throughput is the tokens a step generates over that time. Prompt tokens computed in the step
(prefill, recompute after preemption) add 2 * parameters FLOPs each at the GPUs' dense 16-bit
peak to the simulated clock, which paces arrivals and latency. Tensor parallelism over
several GPUs is taken as ideal (bandwidth and FLOPs add up, no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.simulate.presets import GpuPreset, ModelPreset


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step from bytes read and prompt tokens computed."""

    weight_bytes: float
    kv_bytes_per_token: int
    num_params: float
    bandwidth: float  # bytes/s over all GPUs
    flops: float  # FLOP/s over all GPUs

    @classmethod
    def for_hardware(cls, model: ModelPreset, gpu: GpuPreset, num_gpus: int) -> StepTimeModel:
        """The model for `model` on `num_gpus` GPUs of kind `gpu`."""
        return cls(
            weight_bytes=model.weight_bytes,
            kv_bytes_per_token=model.kv_bytes_per_token,
            num_params=model.num_params,
            bandwidth=gpu.bandwidth * num_gpus,
            flops=gpu.flops * num_gpus,
        )

    def decode_seconds(self, context_tokens: int) -> float:
        """Reading the weights and the KV of `context_tokens` once."""
        return (self.weight_bytes + self.kv_bytes_per_token * context_tokens) / self.bandwidth

    def prefill_seconds(self, prefill_tokens: int) -> float:
        """Computing `prefill_tokens` prompt tokens at peak FLOP/s."""
        return 2.0 * self.num_params * prefill_tokens / self.flops

    def step_seconds(self, context_tokens: int, prefill_tokens: int) -> float:
        """One step that attends over `context_tokens` and computes `prefill_tokens` prompts."""
        return self.decode_seconds(context_tokens) + self.prefill_seconds(prefill_tokens)
