"""`RedisStore`: the tier's store on Redis, or any server speaking its protocol (Valkey, ...).

Needs redis-py (`pip install pagedkv[redis]`). Each batched call is one round trip: a pipeline
of `EXISTS` for `exists_prefix`, a pipeline of `SET` for `put_many` (with `ex=` when values
expire), `MGET` for `get_many`. Eviction is the server's: run it with `maxmemory` and
`maxmemory-policy allkeys-lru`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from pagedkv.tier.store import StoreError, StoreTimeout, leading_run

T = TypeVar("T")

# Values larger than this go to the socket as their own buffers, never copied into a command.
_INLINE_BYTES = 6000


def _encode(arg: bytes | memoryview | str | int | float) -> bytes | memoryview:
    """A command argument as the bytes that go on the wire (keys and values pass as they are)."""
    if isinstance(arg, (bytes, memoryview)):
        return arg
    return str(arg).encode()


class RedisStore:
    """A `Store` on a Redis server at `url` (`redis://host:port/db`, `rediss://`, `unix://`).

    `timeout` bounds connecting and each socket read or write (seconds); a call's own timeout
    replaces it for that call. `ttl` (seconds), when set, makes stored blocks expire.
    """

    def __init__(self, url: str, *, timeout: float = 0.5, ttl: int | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if ttl is not None and ttl < 1:
            raise ValueError(f"ttl must be >= 1 second, got {ttl}")
        self.url = url
        self.timeout = timeout
        self.ttl = ttl
        self._clients: dict[float, redis.Redis] = {}
        self._lock = threading.Lock()
        self.client()  # a bad URL fails here, not at the first call

    def client(self, timeout: float | None = None) -> redis.Redis:
        """The redis-py client the store uses, its sockets timing out after `timeout` seconds
        (the store's own by default); one connection pool per timeout."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            client = self._clients.get(timeout)
            if client is None:
                # No retries: redis-py's default retries with backoff would hold a call far
                # past its timeout, and a miss is cheaper than waiting. Replies are parsed by
                # hiredis when installed; commands are packed by redis-py's Python packer,
                # which sends a large value as it is, where hiredis' packer copies it twice.
                client = redis.Redis.from_url(
                    self.url,
                    socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),
                    command_packer=PythonRespSerializer(_INLINE_BYTES, _encode),
                )
                self._clients[timeout] = client
            return client

    def _call(self, timeout: float, op: Callable[[redis.Redis], T]) -> T:
        try:
            return op(self.client(timeout))
        except redis.TimeoutError as e:
            raise StoreTimeout(f"redis at {self.url}: {e}") from e
        except (redis.RedisError, OSError) as e:
            raise StoreError(f"redis at {self.url}: {e}") from e

    def exists_prefix(self, keys: Sequence[bytes], timeout: float) -> int:
        """How many of `keys`, from the first on, are all present (one pipeline of EXISTS)."""
        if not keys:
            return 0

        def op(r: redis.Redis) -> int:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return leading_run(pipe.execute())

        return self._call(timeout, op)

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], timeout: float) -> None:
        """Store every `(key, value)` pair (one pipeline of SET)."""
        if not items:
            return

        def op(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl)
            pipe.execute()

        self._call(timeout, op)

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        """The value of each key, or None where it is missing (one MGET)."""
        if not keys:
            return []
        values = self._call(timeout, lambda r: r.mget(keys))
        # Without decode_responses the server's values arrive as bytes; anything else is no KV.
        return [v if isinstance(v, bytes) else None for v in values]

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
