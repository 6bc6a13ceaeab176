"""KV-cache groups from per-layer attention and from real `transformers` configs (built small,
nothing downloaded)."""

from __future__ import annotations

import re

import pytest

from pagedkv import Attention
from pagedkv.groups import MAX_GROUPS, KVGroups, kv_groups, layer_attention

transformers = pytest.importorskip("transformers")

FULL = Attention.full()


def sw(window: int) -> Attention:
    return Attention.sliding_window(window)


def chunked(chunk: int) -> Attention:
    return Attention.chunked_local(chunk)


def check_layout(groups: KVGroups, layers: list[Attention]) -> None:
    """Every layer sits in exactly one slot of a group of its own kind; the rest is padding."""
    seen = sorted(layer for slots in groups.layers for layer in slots if layer >= 0)
    assert seen == list(range(len(layers)))
    assert {len(slots) for slots in groups.layers} == {groups.layers_per_group}
    for layer, attention in enumerate(layers):
        g, s = groups.group_of(layer), groups.slot_of(layer)
        assert groups.layers[g][s] == layer
        assert groups.attention[g] == attention
    padding = sum(slots.count(-1) for slots in groups.layers)
    assert groups.padding_layers == padding
    assert groups.num_layers == len(layers)
    if FULL in layers:
        assert groups.attention[0] == FULL


def test_gemma3_27b_shape_full_group_first_and_unpadded() -> None:
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=62, sliding_window=1024, hidden_size=64, intermediate_size=128
    )
    layers = layer_attention(config)
    assert [i for i, a in enumerate(layers) if a == FULL] == list(range(5, 62, 6))
    assert set(layers) == {FULL, sw(1024)}
    groups = kv_groups(config)
    check_layout(groups, layers)
    # gcd(10, 52) = 2 would make 31 groups: 5 per group keeps the full groups unpadded and
    # pads 3 slots, within MAX_GROUPS; 10 per group would make 7 groups but pad 8.
    assert (groups.layers_per_group, groups.num_groups, groups.padding_layers) == (5, 13, 3)
    assert groups.layers[:2] == (tuple(range(5, 32, 6)), tuple(range(35, 62, 6)))
    assert groups.layers[-1] == (60, 61, -1, -1, -1)
    assert kv_groups(config, layers_per_group=10).padding_layers == 8


def test_gpt_oss_alternates_in_two_unpadded_groups() -> None:
    config = transformers.GptOssConfig(num_hidden_layers=36, hidden_size=64, sliding_window=128)
    groups = kv_groups(config)
    check_layout(groups, layer_attention(config))
    assert groups.attention == (FULL, sw(128))
    assert groups.layers == (tuple(range(1, 36, 2)), tuple(range(0, 36, 2)))


def test_llama4_scout_chunked_every_fourth_full() -> None:
    config = transformers.Llama4TextConfig(num_hidden_layers=48, hidden_size=64)
    layers = layer_attention(config)
    assert [i for i, a in enumerate(layers) if a == FULL] == list(range(3, 48, 4))
    groups = kv_groups(config)
    check_layout(groups, layers)
    assert groups.attention == (FULL, *[chunked(8192)] * 3)
    assert groups.padding_layers == 0


def test_qwen2_and_mistral() -> None:
    qwen = transformers.Qwen2Config(
        num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=4
    )
    assert layer_attention(qwen) == [FULL] * 4 + [sw(64)] * 2
    plain = transformers.Qwen2Config(num_hidden_layers=6)
    assert kv_groups(plain).layers == (tuple(range(6)),)
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=32)
    groups = kv_groups(mistral)
    assert groups.attention == (sw(32),)  # no full layer: group 0 slides
    assert layer_attention(
        transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)
    ) == [
        FULL,
        FULL,
    ]


def test_multimodal_configs_use_their_text_config() -> None:
    gemma = transformers.Gemma3Config(text_config={"num_hidden_layers": 12, "sliding_window": 16})
    assert layer_attention(gemma) == ([sw(16)] * 5 + [FULL]) * 2


def test_older_config_json_fields() -> None:
    gemma3 = {"num_hidden_layers": 7, "sliding_window": 8, "sliding_window_pattern": 3}
    assert layer_attention(gemma3) == [sw(8), sw(8), FULL, sw(8), sw(8), FULL, sw(8)]
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096}
    assert layer_attention(gemma2) == [sw(4096), FULL, sw(4096), FULL]
    llama4 = {"num_hidden_layers": 4, "attention_chunk_size": 64, "no_rope_layers": [1, 1, 1, 0]}
    assert layer_attention(llama4) == [chunked(64)] * 3 + [FULL]
    qwen = {"num_hidden_layers": 3, "use_sliding_window": False, "sliding_window": 4096}
    assert layer_attention(qwen) == [FULL] * 3


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]},
            "layer_types[1]",
        ),
        ({"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, "sliding_window"),
        (
            {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 0},
            "sliding_window",
        ),
        ({"num_hidden_layers": 1, "layer_types": ["chunked_attention"]}, "attention_chunk_size"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"]}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    ],
)
def test_bad_configs_name_the_field(config: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        kv_groups(config)


def test_real_config_with_unknown_layer_type() -> None:
    config = transformers.Gemma3TextConfig(num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\].*linear_attention"):
        kv_groups(config)


def test_from_layers_explicit_size_and_padding() -> None:
    layers = [sw(4), FULL, chunked(32), sw(4), FULL, sw(4), sw(4), sw(4)]
    groups = KVGroups.from_layers(layers, layers_per_group=2)
    check_layout(groups, layers)
    assert groups.attention == (FULL, sw(4), sw(4), sw(4), chunked(32))
    assert groups.layers == ((1, 4), (0, 3), (5, 6), (7, -1), (2, -1))
    assert groups.padding_layers == 2
    one = KVGroups.from_layers(layers, layers_per_group=10)
    assert one.num_groups == 3 and one.padding_layers == 22
    with pytest.raises(ValueError, match=r"^layers_per_group"):
        KVGroups.from_layers(layers, layers_per_group=0)
    with pytest.raises(ValueError, match=r"^layers_per_group"):
        KVGroups.from_layers(layers, layers_per_group=True)
    with pytest.raises(ValueError, match=r"^layers:"):
        KVGroups.from_layers([])
    with pytest.raises(ValueError, match=r"^layers\[1\]"):
        KVGroups.from_layers([FULL, ("full", None)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^layer:"):
        groups.group_of(8)
    with pytest.raises(ValueError, match=r"^layer:"):
        groups.slot_of(-1)


def brute_force_size(counts: list[int], full: list[bool]) -> int:
    """The default rule, spelled out: within MAX_GROUPS groups, no full padding, least padding,
    fewest groups (and if nothing fits MAX_GROUPS, the fewest groups over it first)."""
    best: tuple[tuple[int, int, int, int], int] | None = None
    for size in range(1, max(counts) + 1):
        groups = [-(-n // size) for n in counts]
        pad = [g * size - n for g, n in zip(groups, counts, strict=True)]
        key = (
            max(0, sum(groups) - MAX_GROUPS),
            sum(p for p, f in zip(pad, full, strict=True) if f),
            sum(pad),
            sum(groups),
        )
        if best is None or key < best[0]:
            best = (key, size)
    assert best is not None
    return best[1]


@pytest.mark.parametrize(
    ("full", "window", "expected"),
    [
        (10, 52, 5),
        (18, 18, 18),
        (12, 36, 12),
        (4, 22, 2),
        (7, 50, 7),
        (0, 9, 9),
        (5, 0, 5),
        (3, 50, 4),
    ],
)
def test_default_size(full: int, window: int, expected: int) -> None:
    layers = [FULL] * full + [sw(64)] * window
    groups = KVGroups.from_layers(layers)
    check_layout(groups, layers)
    assert groups.layers_per_group == expected
    counts = [n for n in (full, window) if n]
    assert expected == brute_force_size(counts, [True, False][: len(counts)] if full else [False])
    assert groups.num_groups <= MAX_GROUPS


def test_many_kinds_make_one_group_each() -> None:
    layers = [sw(w) for w in range(1, MAX_GROUPS + 3)] + [FULL]
    groups = KVGroups.from_layers(layers)
    check_layout(groups, layers)
    assert groups.num_groups == len(layers) and groups.layers_per_group == 1


def test_module_example() -> None:
    import doctest

    import pagedkv.groups

    assert doctest.testmod(pagedkv.groups).failed == 0


def test_direct_construction_is_checked() -> None:
    ok = KVGroups((FULL, sw(8)), ((1, -1), (0, 2)))
    assert ok.group_of(2) == 1 and ok.padding_layers == 1
    for attention, layers, field in (
        ((FULL,), ((0,), (1,)), "attention"),
        ((), (), "attention"),
        ((FULL, FULL), ((0,), (1, 2)), "layers"),
        ((FULL, FULL), ((0, 1), (1, -1)), "layers"),
        ((FULL,), ((0, -2),), "layers"),
    ):
        with pytest.raises(ValueError, match=f"^{field}:"):
            KVGroups(attention, layers)
