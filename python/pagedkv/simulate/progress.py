"""A small progress bar on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

import time
from typing import TextIO


class ProgressBar:
    """`label [#####-----] done/total`, redrawn at most ten times a second.

    `label` may change as the work goes on (say, which run of a sweep is under way).
    """

    def __init__(self, label: str, total: int, stream: TextIO, *, enabled: bool) -> None:
        self.label = label
        self._total = max(total, 1)
        self._stream = stream
        self._enabled = enabled
        self._done = 0
        self._drawn_at = 0.0
        self._width = 0

    def update(self, count: int) -> None:
        """Count `count` more items done."""
        self._done += count
        now = time.monotonic()
        if self._enabled and (now - self._drawn_at >= 0.1 or self._done >= self._total):
            self._drawn_at = now
            filled = 30 * min(self._done, self._total) // self._total
            text = f"{self.label} [{'#' * filled}{'-' * (30 - filled)}] {self._done}/{self._total}"
            self._width = max(self._width, len(text))
            self._stream.write("\r" + text.ljust(self._width))  # covers a longer old label
            self._stream.flush()

    def close(self) -> None:
        """Erase the bar."""
        if self._enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
