"""Placement of contiguous regions in one linear address space of token slots.

Two allocators: `BuddySpace`, the power-of-two buddy system the vLLM paper's Orca baselines
use (section 6.1), and `FirstFitSpace`, an exact-size first-fit allocator that wastes no
slot on rounding (a stronger baseline). Both leave free memory split into gaps that can be
too small for the next request: external fragmentation.
"""

from __future__ import annotations

import bisect
from typing import Protocol


class AddressSpace(Protocol):
    """An allocator of contiguous regions of slots in `[0, capacity)`."""

    capacity: int

    def allocate(self, size: int) -> tuple[int, int] | None:
        """`(start, slots held)` of a region of at least `size` slots, or None if none fits."""
        ...

    def free(self, start: int) -> None:
        """Return the region that starts at `start`."""
        ...


def _check_capacity(capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")


def _check_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"region size must be positive, got {size}")


class FirstFitSpace:
    """Exact-size regions in the lowest free gap that fits; freed gaps merge with neighbours."""

    def __init__(self, capacity: int) -> None:
        _check_capacity(capacity)
        self.capacity = capacity
        self._starts: list[int] = [0]  # free gaps, sorted and never adjacent
        self._ends: list[int] = [capacity]
        self._held: dict[int, int] = {}  # start -> size of each allocated region

    def allocate(self, size: int) -> tuple[int, int] | None:
        """The lowest gap that fits gives its first `size` slots."""
        _check_size(size)
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= size:
                if end - start == size:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + size
                self._held[start] = size
                return start, size
        return None

    def free(self, start: int) -> None:
        """Return a region, merging it with the gaps on either side."""
        size = self._held.pop(start, None)
        if size is None:
            raise ValueError(f"no region starts at {start}")
        end = start + size
        i = bisect.bisect_left(self._starts, start)
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
    def gaps(self) -> list[tuple[int, int]]:
        """The free gaps as `(start, end)`, in address order."""
        return list(zip(self._starts, self._ends, strict=True))


class BuddySpace:
    """The binary buddy system: regions are aligned powers of two, split and merged in halves.

    A capacity that is not a power of two is cut into its binary digits, largest first
    (14 = 8 + 4 + 2 at addresses 0, 8, 12); each piece is aligned to its size and is the
    largest block that can form there. A request of `size` slots holds the next power of two.
    """

    def __init__(self, capacity: int) -> None:
        _check_capacity(capacity)
        self.capacity = capacity
        self._free: dict[int, list[int]] = {}  # order -> sorted starts of free blocks
        self._top_starts: list[int] = []  # the capacity's pieces: start and order
        self._top_orders: list[int] = []
        start = 0
        for order in range(capacity.bit_length() - 1, -1, -1):
            if capacity >> order & 1:
                self._free[order] = [start]
                self._top_starts.append(start)
                self._top_orders.append(order)
                start += 1 << order
        self._held: dict[int, int] = {}  # start -> order of each allocated block

    def allocate(self, size: int) -> tuple[int, int] | None:
        """The lowest block of the smallest order that fits, split down to `size`'s order."""
        _check_size(size)
        order = (size - 1).bit_length()
        have = next((o for o in sorted(self._free) if o >= order and self._free[o]), None)
        if have is None:
            return None
        start = self._free[have].pop(0)
        while have > order:  # keep the lower half, free the upper
            have -= 1
            bisect.insort(self._free.setdefault(have, []), start + (1 << have))
        self._held[start] = order
        return start, 1 << order

    def free(self, start: int) -> None:
        """Return a block, merging it with its buddy while the buddy is free too."""
        order = self._held.pop(start, None)
        if order is None:
            raise ValueError(f"no region starts at {start}")
        top = self._top_orders[bisect.bisect_right(self._top_starts, start) - 1]
        while order < top:
            buddy = start ^ (1 << order)
            same = self._free.get(order, [])
            i = bisect.bisect_left(same, buddy)
            if i == len(same) or same[i] != buddy:
                break
            del same[i]
            start = min(start, buddy)
            order += 1
        bisect.insort(self._free.setdefault(order, []), start)

    @property
    def free_blocks(self) -> list[tuple[int, int]]:
        """The free blocks as `(start, size)`, in address order."""
        return sorted((s, 1 << o) for o, starts in self._free.items() for s in starts)


ALLOCATORS: dict[str, type[FirstFitSpace] | type[BuddySpace]] = {
    "buddy": BuddySpace,
    "first-fit": FirstFitSpace,
}
