"""The store protocol of the external KV tier, and an in-process store for tests and examples.

A store holds opaque values under byte keys and answers three batched calls, each bounded by a
timeout. Failures raise `StoreError` (`StoreTimeout` when the timeout ran out); the tier counts
them and treats the blocks as misses. Eviction is the store's business. Calls come from several
threads at once (the tier's savers and its loader), so a store must be thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol


class StoreError(RuntimeError):
    """A store call failed: server down, connection lost, protocol error."""


class StoreTimeout(StoreError):
    """A store call did not finish within its timeout."""


class Store(Protocol):
    """A key-value store reached with batched calls, each bounded by `timeout` seconds."""

    def exists_prefix(self, keys: Sequence[bytes], timeout: float) -> int:
        """How many of `keys`, from the first on, are all present (one round trip)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], timeout: float) -> None:
        """Store every `(key, value)` pair (one round trip)."""
        ...

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        """The value of each key, or None where it is missing (one round trip)."""
        ...


def leading_run(found: Sequence[object]) -> int:
    """Length of the run of truthy entries at the start of `found`."""
    for i, f in enumerate(found):
        if not f:
            return i
    return len(found)


class MemoryStore:
    """A thread-safe dict behind the `Store` protocol, with injectable faults.

    `down` makes every call raise `StoreError`; a `latency` of more than a call's timeout makes
    it wait out the timeout and raise `StoreTimeout` (otherwise the call sleeps `latency`).
    `data` may be edited directly to plant missing, short or corrupt values.
    """

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.down = False
        self.latency = 0.0
        self.calls = 0
        self._lock = threading.Lock()

    def _enter(self, timeout: float) -> None:
        with self._lock:
            self.calls += 1
        if self.down:
            raise StoreError("memory store is down")
        if self.latency > timeout:
            time.sleep(timeout)
            raise StoreTimeout(f"memory store took longer than {timeout}s")
        if self.latency:
            time.sleep(self.latency)

    def exists_prefix(self, keys: Sequence[bytes], timeout: float) -> int:
        """How many of `keys`, from the first on, are all present."""
        self._enter(timeout)
        with self._lock:
            return leading_run([k in self.data for k in keys])

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], timeout: float) -> None:
        """Store every `(key, value)` pair."""
        self._enter(timeout)
        with self._lock:
            self.data.update((k, bytes(v)) for k, v in items)

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        """The value of each key, or None where it is missing."""
        self._enter(timeout)
        with self._lock:
            return [self.data.get(k) for k in keys]
