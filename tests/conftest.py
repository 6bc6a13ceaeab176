"""Shared fixtures: a private `redis-server` on a free 127.0.0.1 port."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from redis_server import RedisServer, start_redis_server

# Triton chooses its CPU interpreter when it is first imported (it builds its standard library
# then), so the choice is made here, before any test module can import it: without CUDA, the
# Triton kernel tests (test_triton_attention.py) run on the CPU in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty `redis-server`, killed after the test.

    Without the binary the test is skipped, except in CI (`CI` set), where it fails.
    """
    try:
        server = start_redis_server()
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    try:
        yield server
    finally:
        server.kill()
