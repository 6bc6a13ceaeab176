"""The simulator's errors: each one is bad input, reported to the user in one line."""

from __future__ import annotations


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the line and the problem."""


class ConfigError(ValueError):
    """A simulation setting that cannot work; the message names it."""


class SimulationError(RuntimeError):
    """The trace cannot run on a system (a request never fits its KV memory)."""
