"""Contiguous KV allocation: each sequence gets one region of a linear slot address space.

This is how servers stored KV before paging (Orca, FasterTransformer): a region is reserved
at admission for the most tokens the sequence may reach and is freed whole when it finishes.
An `AddressSpace` places the regions, so free memory can be split into gaps too small for
the next request: the external fragmentation the paged system does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.simulate.address_space import AddressSpace
from pagedkv.simulate.engine import Active
from pagedkv.simulate.metrics import Composition
from pagedkv.simulate.trace import Request

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

    def __init__(
        self, name: str, space: AddressSpace, policy: ReservationPolicy, max_len: int
    ) -> None:
        self.name = name
        self.capacity = space.capacity
        self._policy = policy
        self._max_len = max_len
        self._space = space
        self._regions: dict[int, tuple[list[int], int]] = {}  # request -> (starts, slots held)

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
        held = size
        for _ in range(active.width):
            region = self._space.allocate(size)
            if region is None:
                for start in starts:
                    self._space.free(start)
                return None
            starts.append(region[0])
            held = region[1]  # the same for every region of one size
        self._regions[active.index] = (starts, held)
        return active.request.prompt_len

    def decode(self, running: Sequence[Active]) -> list[Active]:
        """Nothing to allocate: the regions were reserved for the whole request."""
        return []

    def release(self, active: Active) -> None:
        """Free the request's regions."""
        starts, _ = self._regions.pop(active.index)
        for start in starts:
            self._space.free(start)

    def composition(self, running: Sequence[Active]) -> Composition:
        """Token states, reservation up to the final length, and every held slot beyond it
        (the policy's over-reservation and the allocator's rounding alike)."""
        token = reserved = internal = held = 0
        for active in running:
            _, size = self._regions[active.index]
            w = active.width
            token += w * active.length
            reserved += w * active.remaining
            internal += w * (size - active.request.final_len)
            held += w * size
        return Composition(token, reserved, internal, self.capacity - held, logical=held)
