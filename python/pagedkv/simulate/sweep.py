"""Latency against request rate (the vLLM paper's Fig. 12) and the rate each system sustains.

Every system runs at every rate on the same seeded trace: the same lengths, with Poisson
arrivals drawn at that rate. Normalized latency is the paper's: the mean over requests of
(finish - arrival) / output tokens, in seconds per token. A system sustains the highest swept
rate up to which its latency stays within the bound; the ratios between systems' sustainable
rates are as fine as the sweep's grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.simulate.errors import ConfigError
from pagedkv.simulate.simulation import SimulationConfig, SimulationResult, simulate
from pagedkv.simulate.trace import Request

# Default bound on normalized latency, seconds per output token: 0.2 s is 5 tokens/s, about
# the pace at which people read (roughly 4 words/s; a word is about 1.3 tokens).
DEFAULT_LATENCY_BOUND = 0.2


@dataclass(frozen=True)
class Sustained:
    """The highest swept rate a system sustains within the latency bound."""

    rate: float | None  # None: over the bound already at the lowest rate
    censored: bool  # within the bound at every swept rate: it may sustain more


@dataclass(frozen=True)
class RateRatio:
    """How many times a baseline's sustainable rate a system sustains."""

    system: str
    baseline: str
    ratio: float | None  # None: undefined (a rate is None)
    at_least: bool  # the system never crossed the bound: the true ratio may be higher


def sustained(rates: Sequence[float], latencies: Sequence[float], bound: float) -> Sustained:
    """The highest of ascending `rates` before the first latency over `bound`."""
    best: float | None = None
    for rate, latency in zip(rates, latencies, strict=True):
        if latency > bound:
            return Sustained(best, censored=False)
        best = rate
    return Sustained(best, censored=True)


@dataclass(frozen=True)
class SweepResult:
    """One simulation per rate, with the latency bound the sustainable rates use."""

    rates: list[float]
    points: list[SimulationResult]  # one per rate, in the same order
    latency_bound: float

    @property
    def config(self) -> SimulationConfig:
        """The settings every point shares."""
        return self.points[0].config

    @property
    def names(self) -> list[str]:
        """The systems' report labels, in order."""
        return [m.name for m in self.points[0].systems]

    def latencies(self, system: int) -> list[float]:
        """Normalized latency (s per output token) of the `system`-th system at each rate."""
        return [p.systems[system].mean_latency_per_token for p in self.points]

    def mean_seqs(self, system: int) -> list[float]:
        """Mean running sequences per step of the `system`-th system at each rate."""
        return [p.systems[system].mean_seqs for p in self.points]

    def sustained(self, system: int) -> Sustained:
        """The highest rate the `system`-th system sustains within the latency bound."""
        return sustained(self.rates, self.latencies(system), self.latency_bound)

    def ratios(self) -> list[RateRatio]:
        """The first system's sustainable rate over each other system's."""
        first = self.sustained(0)
        out = []
        for i, name in enumerate(self.names[1:], start=1):
            other = self.sustained(i)
            ratio = None
            if first.rate is not None and other.rate is not None:
                ratio = first.rate / other.rate
            out.append(RateRatio(self.names[0], name, ratio, at_least=first.censored))
        return out

    def as_dict(self) -> dict[str, object]:
        """Rates, per-system curves, sustainable rates, ratios and every point's metrics."""
        systems = []
        for i, name in enumerate(self.names):
            s = self.sustained(i)
            systems.append(
                {
                    "name": name,
                    "normalized_latency_s_per_token": self.latencies(i),
                    "mean_seqs": self.mean_seqs(i),
                    "sustainable_rate": s.rate,
                    "within_bound_at_every_rate": s.censored,
                }
            )
        first = self.points[0].as_dict()
        return {
            "trace": first["trace"],
            "config": first["config"],
            "latency_bound_s_per_token": self.latency_bound,
            "rates": self.rates,
            "systems": systems,
            "ratios": [
                {
                    "system": r.system,
                    "baseline": r.baseline,
                    "ratio": r.ratio,
                    "at_least": r.at_least,
                }
                for r in self.ratios()
            ],
            "points": [
                {"rate": rate, "systems": [m.as_dict() for m in p.systems]}
                for rate, p in zip(self.rates, self.points, strict=True)
            ],
        }


def sweep(
    trace_at: Callable[[float], Sequence[Request]],
    rates: Sequence[float],
    config: SimulationConfig,
    *,
    trace_name: str = "trace",
    latency_bound: float = DEFAULT_LATENCY_BOUND,
    on_finish: Callable[[str], Callable[[int], None] | None] | None = None,
) -> SweepResult:
    """Simulate every configured system on `trace_at(rate)` for each of the ascending `rates`.

    `on_finish(label)`, as for `simulate`, is asked once per system and rate; the label names
    both.
    """
    if not rates:
        raise ConfigError("no rate to sweep")
    if any(not 0 < r < float("inf") for r in rates):
        raise ConfigError(f"sweep rates must be positive and finite, got {list(rates)}")
    if any(a >= b for a, b in itertools.pairwise(rates)):
        raise ConfigError(f"sweep rates must be ascending, got {list(rates)}")
    if not latency_bound > 0:
        raise ConfigError(f"latency bound must be positive, got {latency_bound}")
    points = []
    for rate in rates:

        def labelled(name: str, rate: float = rate) -> Callable[[int], None] | None:
            return on_finish(f"{rate:g} req/s, {name}") if on_finish is not None else None

        points.append(simulate(trace_at(rate), config, trace_name=trace_name, on_finish=labelled))
    return SweepResult(list(rates), points, latency_bound)
