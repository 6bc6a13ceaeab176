"""One "machine" of the tier tests: runs the example engine on a shared Redis, prints JSON.

``python tests/tier_node.py --redis URL --role A|B``: A serves requests that share a long system
prompt, B later admits others with the same prompt. Both run the same seeded tiny Llama with
their own manager and caches. The last stdout line is the result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from test_llama_e2e import cb

from pagedkv.tier.redis_store import RedisStore

BLOCK_SIZE = 16
HASH_KEY = bytes(range(32))  # shared by both machines: hashes must agree across processes
SYSTEM = [(7 * i + 3) % 120 + 1 for i in range(96)]  # 6 full blocks
OTHER_SYSTEM = [(11 * i + 5) % 120 + 1 for i in range(64)]  # 4 full blocks


def requests_for(role: str) -> list[Any]:
    """The requests machine `role` serves."""
    r = cb.Request
    if role == "A":
        return [
            r([*SYSTEM, 1, 2, 3, 4, 5], 6),
            r([*SYSTEM, 9, 8, 7], 6, arrival_step=2),
            r([*OTHER_SYSTEM, 42, 43], 6, arrival_step=3),
        ]
    return [
        r([*SYSTEM, 20, 21, 22, 23], 8),
        r([*SYSTEM, 30, 31], 8, arrival_step=1),
        r([*SYSTEM, 40, 41, 42, 43, 44, 45], 8, arrival_step=1),
        r([*OTHER_SYSTEM, 50], 8, arrival_step=6),  # after the first requests' decode steps
    ]


def run(role: str, store: Any) -> dict[str, Any]:
    """Serve `role`'s requests through `store`; tokens and what the run did, as plain data."""
    model = cb.tiny_llama(seed=0)
    reqs = requests_for(role)
    result = cb.generate(
        model,
        reqs,
        block_size=BLOCK_SIZE,
        num_blocks=64,
        backend="torch",
        store=store,
        hash_key=HASH_KEY,
    )
    return {
        "tokens": [samples[0] for samples in result.tokens],
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "tier": dataclasses.asdict(result.tier),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--role", choices=["A", "B"], required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.role, RedisStore(args.redis, timeout=5.0))))


if __name__ == "__main__":
    main()
