"""The simulator behind `pagedkv simulate`: paged versus contiguous KV memory on one trace.

Example:
    >>> from pagedkv.simulate import MODELS, GPUS, TRACES, SimulationConfig, simulate
    >>> from pagedkv.simulate import synthetic_trace
    >>> config = SimulationConfig(MODELS["OPT-13B"], GPUS["A100-40GB"], kv_memory=12 * 10**9)
    >>> trace = synthetic_trace(TRACES["alpaca"], 50, max_len=config.max_len,
    ...                         rate=float("inf"), seed=0)
    >>> result = simulate(trace, config, trace_name="alpaca")
    >>> [m.name for m in result.systems]
    ['paged (pagedkv)', 'contiguous max', 'contiguous pow2', 'contiguous oracle']
"""

from pagedkv.simulate.errors import ConfigError, SimulationError, TraceError
from pagedkv.simulate.metrics import Composition, SystemMetrics
from pagedkv.simulate.presets import GPUS, MODELS, TRACES, GpuPreset, ModelPreset, TracePreset
from pagedkv.simulate.simulation import SYSTEMS, SimulationConfig, SimulationResult, simulate
from pagedkv.simulate.trace import Request, load_jsonl, parse_jsonl, synthetic_trace

__all__ = [
    "GPUS",
    "MODELS",
    "SYSTEMS",
    "TRACES",
    "Composition",
    "ConfigError",
    "GpuPreset",
    "ModelPreset",
    "Request",
    "SimulationConfig",
    "SimulationError",
    "SimulationResult",
    "SystemMetrics",
    "TraceError",
    "TracePreset",
    "load_jsonl",
    "parse_jsonl",
    "simulate",
    "synthetic_trace",
]
