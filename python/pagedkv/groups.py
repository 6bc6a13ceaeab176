"""KV-cache groups of a hybrid model: which layers share a block table, and how they are padded.

A `HybridManager` draws every group's pages from one pool of pages of equal bytes, so every
group holds the same number of layers (`layers_per_group`); a kind whose layer count is not a
multiple of it fills its last group with padding slots (memory that holds nothing).

Example:
    >>> from transformers import Gemma3TextConfig
    >>> groups = kv_groups(Gemma3TextConfig(num_hidden_layers=62, sliding_window=1024))
    >>> groups.layers_per_group, groups.num_groups, groups.padding_layers
    (5, 13, 3)
    >>> groups.attention[0].kind, groups.attention[2].window
    ('full', 1024)
    >>> groups.group_of(5), groups.slot_of(11), groups.group_of(0), groups.slot_of(0)
    (0, 1, 2, 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedkv import Attention

__all__ = ["MAX_GROUPS", "KVGroups", "kv_groups", "layer_attention"]

# Groups a default `layers_per_group` may make: each group adds a plan (CSR, slot mapping) to
# every step, host work that stays a small part of a GPU step at this many.
MAX_GROUPS = 16

_UNSET = object()


@dataclass(frozen=True)
class KVGroups:
    """Layer groups of one pool: `attention[g]` and the model layers of group `g`'s slots.

    `layers[g][s]` is the model layer in slot `s` of group `g`, or -1 for a padding slot.
    Full-attention groups come first (group 0 is full attention when the model has any: it is
    the group whose blocks events announce); then each other kind in order of its first layer.
    """

    attention: tuple[Attention, ...]
    layers: tuple[tuple[int, ...], ...]
    _where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) == 0 or len(self.attention) != len(self.layers):
            raise ValueError(
                f"attention: one per group of `layers` ({len(self.layers)}, at least one), "
                f"got {len(self.attention)}"
            )
        if len({len(slots) for slots in self.layers}) != 1 or len(self.layers[0]) == 0:
            raise ValueError("layers: every group has the same number of slots, at least one")
        where = {
            layer: (g, s)
            for g, slots in enumerate(self.layers)
            for s, layer in enumerate(slots)
            if layer >= 0
        }
        real = [layer for slots in self.layers for layer in slots if layer != -1]
        if len(where) != len(real) or any(layer < 0 for layer in real):
            raise ValueError("layers: each model layer once, padding slots as -1")
        object.__setattr__(self, "_where", where)

    @classmethod
    def from_layers(
        cls, layers: Sequence[Attention], *, layers_per_group: int | None = None
    ) -> KVGroups:
        """Groups for a model whose layer `i` attends as `layers[i]`.

        Layers of one attention kind fill groups of `layers_per_group` slots in layer order;
        the last group of a kind is padded. The default size is, among 1 to the largest
        kind's layer count, the one that (in this order of priority) makes at most
        MAX_GROUPS groups, pads no full-attention group (a full group's padding slot costs
        every token of the context; a windowed group's at most a window and a block), pads
        the fewest slots, and makes the fewest groups. Gemma 3 27B (10 full, 52 sliding
        layers): 5 layers per group, 13 groups (2 full, 11 sliding), 3 padding slots in the
        last sliding group; gpt-oss (18 and 18): 18, 2 groups; Llama 4 Scout (12 full, 36
        chunked): 12, 4 groups; neither padded.
        """
        if len(layers) == 0:
            raise ValueError("layers: a model has at least one layer")
        by_kind: dict[Attention, list[int]] = {}
        for i, attention in enumerate(layers):
            if not isinstance(attention, Attention):
                raise ValueError(f"layers[{i}]: expected an Attention, got {attention!r}")
            by_kind.setdefault(attention, []).append(i)
        kinds = sorted(by_kind, key=lambda a: (a.kind != "full", by_kind[a][0]))
        counts = [len(by_kind[k]) for k in kinds]
        full = [k.kind == "full" for k in kinds]
        if layers_per_group is None:
            size = _default_size(counts, full)
        elif isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int):
            raise ValueError(f"layers_per_group: expected an integer, got {layers_per_group!r}")
        elif layers_per_group < 1:
            raise ValueError(f"layers_per_group must be at least 1, got {layers_per_group}")
        else:
            size = layers_per_group
        group_attention: list[Attention] = []
        groups: list[tuple[int, ...]] = []
        for kind in kinds:
            members = by_kind[kind]
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                group_attention.append(kind)
                groups.append((*chunk, *([-1] * (size - len(chunk)))))
        return cls(tuple(group_attention), tuple(groups))

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return len(self.layers)

    @property
    def layers_per_group(self) -> int:
        """Slots of every group: a page holds a block of tokens for this many layers."""
        return len(self.layers[0])

    @property
    def num_layers(self) -> int:
        """Model layers (padding slots aside)."""
        return len(self._where)

    @property
    def padding_layers(self) -> int:
        """Padding slots over all groups."""
        return self.num_groups * self.layers_per_group - self.num_layers

    def group_of(self, layer: int) -> int:
        """The group holding model layer `layer`."""
        return self._locate(layer)[0]

    def slot_of(self, layer: int) -> int:
        """The slot (layer index within its group's page) of model layer `layer`."""
        return self._locate(layer)[1]

    def _locate(self, layer: int) -> tuple[int, int]:
        found = self._where.get(layer)
        if found is None:
            raise ValueError(f"layer: {layer} is not a layer of this {self.num_layers}-layer model")
        return found


def _default_size(counts: list[int], full: list[bool]) -> int:
    """See `KVGroups.from_layers`."""

    def cost(size: int) -> tuple[int, int, int, int]:
        groups = [-(-n // size) for n in counts]
        padding = [g * size - n for g, n in zip(groups, counts, strict=True)]
        full_padding = sum(p for p, f in zip(padding, full, strict=True) if f)
        total = sum(groups)
        return max(0, total - MAX_GROUPS), full_padding, sum(padding), total

    return min(range(1, max(counts) + 1), key=cost)


def kv_groups(config: object, *, layers_per_group: int | None = None) -> KVGroups:
    """The groups of a `transformers` config (or its `config.json` as a dict).

    See `layer_attention` for the fields read and `KVGroups.from_layers` for the default
    `layers_per_group`.
    """
    return KVGroups.from_layers(layer_attention(config), layers_per_group=layers_per_group)


def layer_attention(config: object) -> list[Attention]:
    """What each layer of a `transformers` config attends to.

    `layer_types` entries `full_attention` (or `attention`), `sliding_attention` (window
    `sliding_window`) and `chunked_attention` (chunk `attention_chunk_size`). Configs without
    `layer_types`: Gemma 2/3's `sliding_window_pattern` p (layer i is full when (i + 1) % p
    is 0; Gemma 2 alternates, p = 2), Llama 4's `no_rope_layers` (0: full, else chunked),
    Qwen2's `use_sliding_window` (layers from `max_window_layers` on slide), Mistral's
    `sliding_window` (every layer slides); none of these: every layer is full. Anything else,
    or a missing window or chunk: `ValueError` naming the field.
    """
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config()
    num_layers = _field(config, "num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_hidden_layers: expected a positive integer, got {num_layers!r}")
    types = _field(config, "layer_types", None)
    if types is None:
        types = _legacy_layer_types(config, num_layers)
    if isinstance(types, str) or not isinstance(types, Sequence):
        raise ValueError(f"layer_types: expected a list of layer types, got {types!r}")
    if len(types) != num_layers:
        raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers = {num_layers}")
    out: list[Attention] = []
    for i, kind in enumerate(types):
        if kind in ("full_attention", "attention"):
            out.append(Attention.full())
        elif kind == "sliding_attention":
            out.append(Attention.sliding_window(_positive(config, "sliding_window")))
        elif kind == "chunked_attention":
            out.append(Attention.chunked_local(_positive(config, "attention_chunk_size")))
        else:
            raise ValueError(
                f"layer_types[{i}]: unknown layer type {kind!r} (pagedkv knows "
                "full_attention, sliding_attention and chunked_attention)"
            )
    return out


def _legacy_layer_types(config: object, n: int) -> list[str]:
    """`layer_types` for configs written before transformers had the field."""
    pattern = _field(config, "sliding_window_pattern", None)
    if pattern is None:
        pattern = _field(config, "_sliding_window_pattern", None)
    if pattern is None and _field(config, "model_type", None) == "gemma2":
        pattern = 2
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(
                f"sliding_window_pattern: expected a positive integer, got {pattern!r}"
            )
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    no_rope = _field(config, "no_rope_layers", None)
    if no_rope is not None and _field(config, "attention_chunk_size", None) is not None:
        if not isinstance(no_rope, Sequence) or len(no_rope) != n:
            raise ValueError(f"no_rope_layers: expected {n} entries, got {no_rope!r}")
        return ["chunked_attention" if r else "full_attention" for r in no_rope]
    use_sliding = _field(config, "use_sliding_window", None)
    if use_sliding is not None:
        first = _field(config, "max_window_layers", 0) if use_sliding else n
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers: expected an integer, got {first!r}")
        slides = bool(use_sliding) and _field(config, "sliding_window", None) is not None
        return [
            "sliding_attention" if slides and i >= first else "full_attention" for i in range(n)
        ]
    if _field(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _field(config: object, name: str, default: object = _UNSET) -> object:
    """`config.name` or `config[name]`; a missing required field is a ValueError naming it."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    if value is _UNSET:
        raise ValueError(f"{name}: the config has no such field")
    return value


def _positive(config: object, name: str) -> int:
    value = _field(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer for this layer type, got {value!r}")
    return value
