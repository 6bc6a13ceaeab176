"""Bad sizes and bad arguments end in a clear exception, never an abort or a silent wrong answer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pagedkv import BlockManager, KVCache, PagedAttention, Plan
from pagedkv.cli import main

# ---- configurations too large for memory ----------------------------------------------------

ADDRESS_SPACE_LIMIT = 2 * 2**30


def run_limited(body: str) -> str:
    """Run `body` in a fresh interpreter limited to 2 GiB of address space; return its stdout.

    Fails the test if the child dies (an abort, as Rust's allocation failure used to cause).
    """
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE_LIMIT}, {ADDRESS_SPACE_LIMIT}))
        import numpy as np
        from pagedkv import BlockManager
        """
    ) + textwrap.dedent(body)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert child.returncode == 0, f"child died ({child.returncode}): {child.stderr[-2000:]}"
    return child.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ("8, 1, num_cpu_blocks=2**31 - 1", "num_cpu_blocks = 2147483647"),
        ("1, 2**31 - 1", "num_blocks * block_size = 2147483647"),
        ("2**31 - 1, 1", "num_blocks = 2147483647"),
    ],
)
def test_bookkeeping_too_large_for_memory_raises(args: str, named: str) -> None:
    out = run_limited(
        f"""
        try:
            BlockManager({args})
        except ValueError as exc:
            print(exc)
        else:
            print("constructed")
        """
    )
    assert named in out
    assert "too large: its bookkeeping cannot be allocated" in out


def test_one_long_sequence_does_not_pad_the_whole_batch() -> None:
    # batch x longest would be 101 x 3M int32 = 1.2 GB per padded array.
    out = run_limited(
        """
        long = 3_000_000
        mgr = BlockManager(long + 300, 1, enable_prefix_caching=False)
        mgr.allocate(0, np.zeros(long, dtype=np.uint32))
        for seq in range(1, 101):
            mgr.allocate(seq, [1])
        ids = list(range(101))
        prefill = mgr.plan(ids, [long] + [1] * 100)
        print(prefill.kv_indices.shape[0], prefill.block_size)
        del prefill
        step = mgr.step(ids, [2] * 101)
        print(step.kv_indices.shape[0], step.kv_indptr[-1])
        """
    )
    assert out.split() == ["3000100", "1", "3000201", "3000201"]


def test_block_tables_are_built_from_the_pages_on_access() -> None:
    mgr = BlockManager(8, 2)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.allocate(2, [6])
    plan = mgr.plan([1, 2], [5, 1])
    tables = plan.block_tables
    assert tables.dtype == np.int32
    assert tables.tolist() == [[0, 1, 2], [3, -1, -1]]
    tables[0, 0] = 7  # a fresh array each time, not a view of the plan
    assert plan.block_tables[0, 0] == 0
    assert plan.kv_indices.tolist() == [0, 1, 2, 3]


# ---- block size checked end to end ----------------------------------------------------------


def plan_of_block_size(block_size: int) -> Plan:
    mgr = BlockManager(16, block_size)
    mgr.allocate(1, [1, 2, 3])
    return mgr.plan([1], [3])


def test_kv_cache_rejects_a_plan_of_another_block_size() -> None:
    cache = KVCache(1, 16, 16, 1, 2, dtype=torch.float32)
    k = torch.zeros(3, 1, 2)
    message = "plan has block_size=4 but this KVCache has block_size=16"
    with pytest.raises(ValueError, match=message):
        cache.write(0, k, k, plan_of_block_size(4))
    cache.write(0, k, k, plan_of_block_size(16))


def test_attention_rejects_a_plan_of_another_block_size() -> None:
    attn = PagedAttention(2, 1, 2, 16, backend="torch", dtype=torch.float32)
    with pytest.raises(
        ValueError, match="plan has block_size=4 but this PagedAttention has block_size=16"
    ):
        attn.plan(plan_of_block_size(4))
    attn.plan(plan_of_block_size(16))
    cache = KVCache(1, 16, 4, 1, 2, dtype=torch.float32)
    with pytest.raises(
        ValueError, match="the cache has block_size=4 but the plan has block_size=16"
    ):
        attn.run(torch.zeros(3, 2, 2), cache, 0)


def test_kv_cache_write_names_what_slots_may_be() -> None:
    cache = KVCache(1, 4, 4, 1, 2, dtype=torch.float32)
    k = torch.zeros(2, 1, 2)
    with pytest.raises(ValueError, match=r"slots must be a Plan, .* got list"):
        cache.write(0, k, k, [0, 1])  # type: ignore[arg-type]


# ---- argument conversion --------------------------------------------------------------------


class Index:
    """An integer only through `__index__`."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class Raises:
    """An `__index__` that raises `exc`."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __index__(self) -> int:
        raise self.exc


@pytest.mark.parametrize("name", ["num_blocks", "block_size", "num_cpu_blocks"])
def test_constructor_names_an_argument_out_of_range(name: str) -> None:
    args = {"num_blocks": 8, "block_size": 4, "num_cpu_blocks": 0, name: 2**63}
    with pytest.raises(ValueError, match=rf"^{name} must be in \[0, 2\*\*32\), got {2**63}$"):
        BlockManager(**args)


def test_index_objects_are_integers() -> None:
    mgr = BlockManager(Index(8), Index(2), num_cpu_blocks=Index(4))  # type: ignore[arg-type]
    assert (mgr.num_blocks, mgr.block_size, mgr.num_cpu_blocks) == (8, 2, 4)
    mgr.allocate(Index(3), [Index(5), Index(6), 7])  # type: ignore[list-item, arg-type]
    assert mgr.token_ids(3).tolist() == [5, 6, 7]
    assert Index(3) in mgr


def test_bytes_like_token_ids_are_rejected() -> None:
    mgr = BlockManager(8, 2)
    for raw in (b"hi", bytearray(b"hi"), memoryview(b"hi")):
        with pytest.raises(ValueError, match="token ids must be a sequence of ints, not"):
            mgr.allocate(2, raw)  # type: ignore[arg-type]
    assert len(mgr) == 0


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [
        (np.int8, -2),
        (np.int16, -2),
        (np.int32, -2),
        (np.int64, -2),
        (np.int64, 2**32),
        (np.uint64, 2**32),
    ],
)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_token_arrays_name_their_first_value_out_of_range(
    dtype: type, bad: int, strided: bool
) -> None:
    values = np.array([5, bad, 7, bad + 1], dtype=dtype)
    if strided:
        values = np.repeat(values, 2)[::2]
    mgr = BlockManager(8, 2)
    with pytest.raises(ValueError, match=rf"^token ids must be in \[0, 2\*\*32\), got {bad}$"):
        mgr.allocate(1, values)
    assert len(mgr) == 0
    mgr.allocate(1, values[:1])
    assert mgr.token_ids(1).tolist() == [5]
    mgr.check()


def test_huge_sequence_id_is_out_of_range_not_a_non_int() -> None:
    mgr = BlockManager(8, 2)
    with pytest.raises(ValueError, match=rf"sequence id must be in \[0, 2\*\*64\), got {2**200}"):
        mgr.allocate(2**200, [1])
    with pytest.raises(ValueError, match=r"sequence id must be in \[0, 2\*\*64\), got -1"):
        mgr.free(-1)
    with pytest.raises(ValueError, match="sequence id must be an int, got str"):
        mgr.free("1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda mgr, bad: mgr.allocate(bad, [1]),
        lambda mgr, bad: mgr.allocate(1, [1, bad]),
        lambda mgr, bad: mgr.step([bad], [1]),
        lambda mgr, bad: BlockManager(bad),
        lambda mgr, bad: BlockManager(8, 2, num_cpu_blocks=bad),
    ],
    ids=["seq-id", "token-id", "seq-ids", "num-blocks", "num-cpu-blocks"],
)
def test_index_errors_are_chained_and_interrupts_propagate(call: object) -> None:
    mgr = BlockManager(8, 2)
    cause = LookupError("no such token")
    with pytest.raises(ValueError, match="must be an int, got Raises") as info:
        call(mgr, Raises(cause))  # type: ignore[operator]
    assert info.value.__cause__ is cause
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as caught:
        call(mgr, Raises(interrupt))  # type: ignore[operator]
    assert caught.value is interrupt
    assert len(mgr) == 0


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("1e30GB", "the block manager addresses at most 2147483647"),
        ("1e9GB", "the block manager addresses at most 2147483647"),
        ("1e400GB", "size '1e400GB' is too large"),
    ],
)
def test_huge_kv_memory_is_a_one_line_error(
    size: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--trace", "alpaca", "--num-requests", "4", "--quiet"]
    code = main([*argv, "--kv-memory", size])
    out, err = capsys.readouterr()
    assert code in (1, 2)
    assert out == ""
    assert err.count("\n") == 1 and "error:" in err
    assert message in err


@pytest.mark.parametrize("value", [1000, -5])
def test_block_tables_of_a_plan_whose_csr_was_overwritten_is_an_error(value: int) -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    plan = mgr.plan([1], [5])
    plan.kv_indptr[1] = value  # the views are writable
    with pytest.raises(ValueError, match="kv_indptr was written through its view"):
        _ = plan.block_tables
    plan.kv_indptr[1] = 2
    assert plan.block_tables.tolist() == [[0, 1]]
