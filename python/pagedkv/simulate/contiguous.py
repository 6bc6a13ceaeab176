"""Contiguous KV allocation: each sequence gets one region of a linear slot address space.

This is how servers stored KV before paging (Orca, FasterTransformer): a region is reserved
at admission for the most tokens the sequence may reach and is freed whole when it finishes.
Regions are placed first-fit, so free memory can be split into gaps too small for the next
request: that is the external fragmentation the paged system does not have.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from pagedkv.simulate.engine import Active
from pagedkv.simulate.metrics import Composition
from pagedkv.simulate.trace import Request


class FirstFitSpace:
    """Free gaps of the address space `[0, capacity)`, kept sorted and merged."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._ends: list[int] = [capacity]

    def allocate(self, size: int) -> int | None:
        """Start of a region of `size` slots in the lowest gap that fits, or None."""
        if size < 1:
            raise ValueError(f"region size must be positive, got {size}")
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= size:
                if end - start == size:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return the region `[start, start + size)`, merging it with adjacent gaps."""
        end = start + size
        i = bisect.bisect_left(self._starts, start)
        if start < 0 or end > self.capacity or size < 1:
            raise ValueError(f"region [{start}, {end}) is outside [0, {self.capacity})")
        if (i > 0 and self._ends[i - 1] > start) or (
            i < len(self._starts) and self._starts[i] < end
        ):
            raise ValueError(f"region [{start}, {end}) overlaps free memory")
        merge_left = i > 0 and self._ends[i - 1] == start
        merge_right = i < len(self._starts) and self._starts[i] == end
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif merge_left:
            self._ends[i - 1] = end
        elif merge_right:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)

    @property
    def free_slots(self) -> int:
        """Slots in all gaps."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def gaps(self) -> list[tuple[int, int]]:
        """The free gaps as `(start, end)`, in address order."""
        return list(zip(self._starts, self._ends, strict=True))


ReservationPolicy = Callable[[Request, int], int]


def reserve_max(request: Request, max_len: int) -> int:
    """Orca (Max): the model's maximum sequence length, whatever the request."""
    return max_len


def reserve_pow2(request: Request, max_len: int) -> int:
    """Orca (Pow2): the prompt plus the output length rounded up to a power of two."""
    return min(max_len, request.prompt_len + (1 << (request.output_len - 1).bit_length()))


def reserve_oracle(request: Request, max_len: int) -> int:
    """Orca (Oracle): exactly the final length, as if it were known in advance."""
    return request.final_len


class ContiguousSystem:
    """A KV system that reserves one contiguous region per sequence at admission."""

    def __init__(self, name: str, capacity: int, policy: ReservationPolicy, max_len: int) -> None:
        self.name = name
        self.capacity = capacity
        self._policy = policy
        self._max_len = max_len
        self._space = FirstFitSpace(capacity)
        self._regions: dict[int, tuple[list[int], int]] = {}  # request -> (starts, size)

    def reservation(self, request: Request) -> int:
        """Slots reserved per sequence of `request`."""
        size = self._policy(request, self._max_len)
        if size < request.final_len:
            raise ValueError(
                f"{self.name}: reservation {size} is shorter than the request's final length "
                f"{request.final_len} (max length {self._max_len})"
            )
        return size

    def admit(self, active: Active) -> int | None:
        """Reserve one region per sequence, all or none; the prompt is computed once."""
        size = self.reservation(active.request)
        starts: list[int] = []
        for _ in range(active.width):
            start = self._space.allocate(size)
            if start is None:
                for s in starts:
                    self._space.free(s, size)
                return None
            starts.append(start)
        self._regions[active.index] = (starts, size)
        return active.request.prompt_len

    def decode(self, running: Sequence[Active]) -> list[Active]:
        """Nothing to allocate: the regions were reserved for the whole request."""
        return []

    def release(self, active: Active) -> None:
        """Free the request's regions."""
        starts, size = self._regions.pop(active.index)
        for start in starts:
            self._space.free(start, size)

    def composition(self, running: Sequence[Active]) -> Composition:
        """Token states, reservation up to the final length, and the reservation beyond it."""
        token = reserved = internal = held = 0
        for active in running:
            _, size = self._regions[active.index]
            w = active.width
            token += w * active.length
            reserved += w * active.remaining
            internal += w * (size - active.request.final_len)
            held += w * size
        return Composition(token, reserved, internal, self.capacity - held, logical=held)
