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

Latency against request rate, every system on the same requests at each rate:
    >>> def at(rate):
    ...     return synthetic_trace(TRACES["alpaca"], 50, max_len=config.max_len, rate=rate, seed=0)
    >>> swept = sweep(at, [10.0, 20.0], config)
    >>> swept.rates, swept.sustained(0).rate  # paged: within the bound at both
    ([10.0, 20.0], 20.0)
"""

from pagedkv.simulate.errors import ConfigError, SimulationError, TraceError
from pagedkv.simulate.metrics import Composition, SystemMetrics
from pagedkv.simulate.presets import GPUS, MODELS, TRACES, GpuPreset, ModelPreset, TracePreset
from pagedkv.simulate.simulation import SYSTEMS, SimulationConfig, SimulationResult, simulate
from pagedkv.simulate.sweep import DEFAULT_LATENCY_BOUND, SweepResult, sweep
from pagedkv.simulate.trace import Request, load_jsonl, parse_jsonl, synthetic_trace

__all__ = [
    "DEFAULT_LATENCY_BOUND",
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
    "SweepResult",
    "SystemMetrics",
    "TraceError",
    "TracePreset",
    "load_jsonl",
    "parse_jsonl",
    "simulate",
    "sweep",
    "synthetic_trace",
]
