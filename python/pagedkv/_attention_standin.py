"""Stand-in for `pagedkv.Attention` until the binding lands (same interface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Attention:
    kind: Literal["full", "sliding_window", "chunked_local"]
    window: int | None = None
    chunk: int | None = None

    @staticmethod
    def full() -> Attention:
        return Attention("full")

    @staticmethod
    def sliding_window(window: int) -> Attention:
        if window < 1:
            raise ValueError("window must be positive")
        return Attention("sliding_window", window=window)

    @staticmethod
    def chunked_local(chunk: int) -> Attention:
        if chunk < 1:
            raise ValueError("chunk must be positive")
        return Attention("chunked_local", chunk=chunk)

    @property
    def window_left(self) -> int:
        return self.window - 1 if self.window is not None else -1

    def first_key(self, position: int) -> int:
        if self.window is not None:
            return max(0, position + 1 - self.window)
        if self.chunk is not None:
            return position // self.chunk * self.chunk
        return 0
