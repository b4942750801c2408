"""Strategies the differential machine draws from: layouts (the groups, the pool, the engine
settings) and traffic (prompts, system prompts, salts).

A ``Layout`` is one drawn configuration; ``layouts(family)`` draws one of a layout family
(``FAMILIES``). The traffic strategies draw what a scheduler sends: fresh prompts, prompts that
share a system prompt, cache salts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from hybridkv.conformance.adapters import EngineOptions
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
    spec_kind,
)

SIZES: dict[str, int] = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
SYSTEM_PROMPTS: tuple[tuple[int, ...], ...] = (
    (7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
    (7, 7, 1, 2, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    (30, 31, 32),
    (7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53),
    tuple(range(100, 132)),
)


# --- Models (the planner's input) -------------------------------------------------------------


MODEL_SIZES = {"num_kv_heads": 2, "head_size": 4, "dtype_bytes": 2}
"""The attention layers' heads and element size in the planner's models (Mamba layers give
their state size instead)."""

Model = tuple[dict[str, KVCacheSpec], dict[str, str]]
"""A model for the planner: layer name → spec, and KV sharing (layer → the layer it reads)."""


def document_models() -> list[Model]:
    """The document's models: 10 full + 20 sliding, Gemma-3-27b, Mamba hybrid, KV sharing."""
    full = FullAttentionSpec(block_size=16, **MODEL_SIZES)
    sliding = SlidingWindowSpec(block_size=16, sliding_window=32, **MODEL_SIZES)
    case2: dict[str, KVCacheSpec] = {f"full.{i}": full for i in range(10)}
    case2 |= {f"sw.{i}": sliding for i in range(20)}
    gemma: dict[str, KVCacheSpec] = {}
    for i in range(62):
        gemma[f"layer.{i}"] = full if i % 6 == 5 else sliding
    mamba = MambaSpec(block_size=16, state_bytes=5000)
    case4: dict[str, KVCacheSpec] = {
        f"layer.{i}": (full if i % 4 == 0 else mamba) for i in range(12)
    }
    case5: dict[str, KVCacheSpec] = {f"layer.{i}": (full if i % 2 else sliding) for i in range(8)}
    sharing = {"layer.6": "layer.4", "layer.7": "layer.5"}
    return [(case2, {}), (gemma, {}), (case4, {}), (case5, sharing)]


def random_models(rng: random.Random, count: int) -> list[Model]:
    """``count`` random models of 1–40 layers of up to four types (one block size), some layers
    sharing another's KV cache."""
    models = []
    for _ in range(count):
        b = rng.choice([1, 4, 16])
        kinds: list[KVCacheSpec] = [
            FullAttentionSpec(block_size=b, **MODEL_SIZES),
            SlidingWindowSpec(block_size=b, sliding_window=rng.randint(2, 64), **MODEL_SIZES),
            ChunkedLocalAttentionSpec(
                block_size=b, attention_chunk_size=rng.randint(1, 64), **MODEL_SIZES
            ),
            MambaSpec(block_size=b, state_bytes=rng.randint(1, 5000)),
        ]
        use = rng.sample(kinds, rng.randint(1, 4))
        layers = {f"l{i}": rng.choice(use) for i in range(rng.randint(1, 40))}
        sharing: dict[str, str] = {}
        for name in layers:
            targets = [
                t
                for t in layers
                if t != name
                and layers[t] == layers[name]
                and t not in sharing
                and name not in sharing.values()
            ]
            if targets and rng.random() < 0.15:
                sharing[name] = rng.choice(targets)
        if len(sharing) < len(layers):
            models.append((layers, sharing))
    return models


# --- Layouts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One drawn configuration: the groups' specs, the pool, the model length, the switches, and
    the engine's settings (retention, EAGLE flags and options, full-prompt admission)."""

    specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    max_model_len: int
    enable_caching: bool
    enable_events: bool
    retention: int | None = None
    eagle_groups: tuple[bool, ...] = ()
    engine: EngineOptions = field(default_factory=EngineOptions)
    full_prompt_admission: bool = False
    """The scheduler admits some waiting requests with ``full_sequence_must_fit=True``."""

    @property
    def block_size(self) -> int:
        """The scheduler block: the lcm of the groups' block sizes."""
        return rules.scheduler_block_size([spec.block_size for spec in self.specs])

    def config(self) -> KVCacheConfig:
        flags = self.eagle_groups or (False,) * len(self.specs)
        groups = tuple(
            KVCacheGroup((f"layer{gid}",), spec, is_eagle_group=flag)
            for gid, (spec, flag) in enumerate(zip(self.specs, flags, strict=True))
        )
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            groups=groups,
            prefix_cache_retention_interval=self.retention,
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(spec_kind(spec) for spec in self.specs)

    @property
    def mamba_align_block(self) -> int | None:
        """The Mamba ``"align"`` block size when a group has that mode (chunks end on it)."""
        for spec in self.specs:
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
                return spec.block_size
        return None

    def features(self) -> tuple[str, ...]:
        """The engine features this layout exercises (for the run summary)."""
        found: list[str] = []
        mambas = [spec for spec in self.specs if isinstance(spec, MambaSpec)]
        if any(m.mamba_cache_mode == "none" for m in mambas):
            found.append("mamba_none")
        if any(m.mamba_cache_mode == "align" for m in mambas):
            found.append("mamba_align")
        if any(m.num_prefill_checkpoint_blocks for m in mambas):
            found.append("mamba_checkpoint")
        if any(m.num_speculative_blocks for m in mambas):
            found.append("mamba_speculative_blocks")
        if len({spec.block_size for spec in self.specs}) > 1:
            found.append("mixed_block_sizes")
        if self.retention is not None:
            found.append("retention_0" if self.retention == 0 else "retention_positive")
        if self.engine.use_eagle:
            found.append("use_eagle_flagged" if any(self.eagle_groups) else "use_eagle_all")
        if self.engine.num_hash_lookahead_tokens:
            found.append("lookahead_hashing")
        if self.full_prompt_admission:
            found.append("full_prompt_admission")
        return tuple(found)


FAMILIES: tuple[str, ...] = (
    "hybrid",
    "no_full_attention",
    "one_type",
    "uncached",
    "mamba",
    "mamba_align",
    "mixed_block_sizes",
)
"""Layout families; a run splits its examples evenly between them, so that every family is
covered however Hypothesis spreads its draws:

* ``hybrid``: prefix caching, 2–4 groups, full attention and at least one other type;
* ``no_full_attention``: prefix caching, 2–4 groups of sliding window and chunked local only;
* ``one_type``: prefix caching, one group (unitary coordinator) or equal-spec groups;
* ``uncached``: no prefix caching, any attention mix;
* ``mamba``: no prefix caching, Mamba ``"none"`` groups (the attention block size or another,
  up to one spanning ``max_model_len``; with or without speculative blocks) among attention
  groups;
* ``mamba_align``: prefix caching, 1–2 Mamba ``"align"`` groups (the hash block size; with or
  without prefill checkpoint blocks and speculative blocks) alone or with attention groups;
* ``mixed_block_sizes``: prefix caching, full-attention and sliding-window groups of block sizes
  b, 2b and 4b (hits on their lcm, hashes on their gcd).

Every caching family also draws the engine's settings: the retention interval (``None``, 0 or a
multiple of the scheduler block), ``use_eagle`` (with and without ``is_eagle_group`` flags) or
lookahead hashing (``num_hash_lookahead_tokens=1``), and full-prompt admission with
``max_in_flight_tokens``. Only layouts the reference accepts are drawn
(``reference/validation.py``, ``_check_caching_layout``).
"""


def _mamba_align(rng: random.Random, b: int) -> MambaSpec:
    checkpoint = rng.random() < 0.5
    return MambaSpec(
        block_size=b,
        state_bytes=16,
        mamba_cache_mode="align",
        num_speculative_blocks=rng.choice([0, 0, 1, 2]),
        num_prefill_checkpoint_blocks=int(checkpoint),
        prefill_checkpoint_alignment=rng.choice([None, 1, b]) if checkpoint else None,
    )


def _mamba_none(rng: random.Random, b: int, max_model_len: int) -> MambaSpec:
    return MambaSpec(
        block_size=rng.choice([b, b, 2 * b, max_model_len]),
        state_bytes=16,
        num_speculative_blocks=rng.choice([0, 0, 1, 2]),
    )


def _blocks_per_request(spec: KVCacheSpec, max_model_len: int) -> int:
    """Roughly the most blocks one request holds in a group (to size the pool)."""
    if isinstance(spec, MambaSpec):
        states = 3 if spec.mamba_cache_mode == "align" else 2
        return min(states, rules.cdiv(max_model_len, spec.block_size)) + spec.num_speculative_blocks
    return rules.cdiv(max_model_len, spec.block_size)


def _engine(
    rng: random.Random, specs: list[KVCacheSpec], max_model_len: int, b: int
) -> dict[str, Any]:
    """Engine settings for a caching layout (only combinations the reference accepts)."""
    sparse = any(spec.sparse_retention for spec in specs)
    retention: int | None = rng.choice([None, None, 0, 0, -1] if sparse else [None, None, 0])
    if retention == -1:
        retention = rng.randint(1, 4) * b
    chunked = [not spec.supports_eagle_drop for spec in specs]
    use_eagle, lookahead = False, 0
    flags: tuple[bool, ...] = ()
    mode = rng.choice(["none", "none", "eagle", "lookahead"])
    if mode == "lookahead":
        lookahead = 1
    elif mode == "eagle":
        flagged = tuple(not c and rng.random() < 0.5 for c in chunked)
        if any(flagged) or not any(chunked):
            use_eagle, flags = True, flagged if any(flagged) else ()
    full = rng.random() < 0.6  # what engines run (the engine traces); the rest unit-test style
    # An engine's in-flight budget is far below its model length: then a window's cap matters.
    small = rng.randint(1, max(1, max_model_len // 8))
    budgets = [None, small, small, rng.randint(1, max_model_len)]
    in_flight = rng.choice(budgets) if full else None
    return {
        "retention": retention,
        "eagle_groups": flags,
        "engine": EngineOptions(in_flight, use_eagle, lookahead),
        "full_prompt_admission": full,
    }


def _family_specs(
    rng: random.Random, family: str, b: int, max_model_len: int, big: bool
) -> tuple[list[KVCacheSpec], int]:
    """The groups' specs of a ``family`` layout with block size ``b`` (see ``layouts``), and
    its model length (a mixed-block-size layout draws its own when not ``big``)."""
    full = FullAttentionSpec(block_size=b, **SIZES)
    others: list[KVCacheSpec] = [
        SlidingWindowSpec(block_size=b, sliding_window=rng.randint(2, 4 * b + 2), **SIZES),
        SlidingWindowSpec(block_size=b, sliding_window=rng.randint(2, 4 * b + 2), **SIZES),
        ChunkedLocalAttentionSpec(
            block_size=b,
            attention_chunk_size=rng.choice([b, 2 * b, 4 * b, b + 1, 3 * b - 1]),
            **SIZES,
        ),
    ]
    specs: list[KVCacheSpec]
    if family == "hybrid":
        specs = [full, rng.choice(others)]
        specs += [rng.choice([full, *others]) for _ in range(rng.randint(0, 2))]
        rng.shuffle(specs)
    elif family == "no_full_attention":
        specs = [rng.choice(others) for _ in range(rng.randint(2, 4))]
    elif family == "one_type":
        specs = [rng.choice([full, *others])] * rng.choice([1, 1, 2, 3])
    elif family == "mamba_align":
        mamba = _mamba_align(rng, b)
        mambas = (
            [mamba] * rng.choice([1, 1, 2]) if rng.random() < 0.7 else [mamba, _mamba_align(rng, b)]
        )
        specs = [*mambas, *(rng.choice([full, full, *others]) for _ in range(rng.randint(0, 2)))]
        rng.shuffle(specs)
    elif family == "mixed_block_sizes":
        if not big:
            max_model_len = rng.randint(8 * b, min(32 * b, 96))
        sizes = [b, 2 * b, 4 * b]
        options: list[list[KVCacheSpec]] = [
            [
                FullAttentionSpec(block_size=size, **SIZES),
                SlidingWindowSpec(
                    block_size=size, sliding_window=rng.randint(2, 2 * size + 2), **SIZES
                ),
            ]
            for size in rng.sample(sizes, rng.randint(1, 3))
        ]
        specs = [
            FullAttentionSpec(block_size=rng.choice(sizes), **SIZES),
            *(rng.choice(pair) for pair in options),
        ]
        if len({spec.block_size for spec in specs}) == 1:
            specs.append(
                FullAttentionSpec(block_size=4 * b if specs[0].block_size != 4 * b else b, **SIZES)
            )
        rng.shuffle(specs)
    else:
        specs = [rng.choice([full, *others]) for _ in range(rng.randint(1, 3))]
        if family == "mamba":
            for _ in range(rng.choice([1, 1, 2]) if len(specs) < 3 else 1):
                specs.insert(rng.randint(0, len(specs)), _mamba_none(rng, b, max_model_len))
    return specs, max_model_len


@st.composite
def layouts(
    draw: st.DrawFn, family: str = "hybrid", *, roomy: bool = False, big: bool = False
) -> Layout:
    """A layout of ``family``: 1–4 groups; windows and chunks that are and are not multiples of
    the block size; equal specs may repeat (jointly looked-up groups); pools from a fraction of
    one longest request (allocations fail, caches evict) to a few of them, or with ``roomy``
    from two to twelve of them (prefills and decodes succeed, hits stay cached). ``big``: serving
    sizes, block sizes 8 and 16, a model length of 512–4,096 tokens and pools of one to twelve
    longest requests (hundreds to thousands of blocks)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    if big:
        b = rng.choice([4, 8] if family == "mixed_block_sizes" else [8, 16])
        max_model_len = rng.randint(512, 4096)
    else:
        b = rng.choice([1, 2, 4] if family == "mixed_block_sizes" else [1, 2, 3, 4, 8])
        max_model_len = rng.randint(max(4, 2 * b), min(16 * b, 96))
    specs, max_model_len = _family_specs(rng, family, b, max_model_len, big)
    caching = family not in ("uncached", "mamba")
    longest = sum(_blocks_per_request(spec, max_model_len) for spec in specs)
    quarters = rng.choice(
        [4, 8, 16, 48] if big else [8, 16, 24, 48] if roomy else [1, 2, 4, 6, 8, 12, 24]
    )
    num_blocks = 1 + max(1, longest * quarters // 4)
    events = caching and rng.random() < 0.5
    scheduler_block = rules.scheduler_block_size([spec.block_size for spec in specs])
    extra = _engine(rng, specs, max_model_len, scheduler_block) if caching else {}
    if family in ("hybrid", "no_full_attention", "one_type") and rng.random() < 0.5:
        # Half the first set's layouts keep vLLM's unit-test defaults (dense retention, no
        # drafter), the settings every backend implements.
        extra = {
            "full_prompt_admission": extra["full_prompt_admission"],
            "engine": EngineOptions(extra["engine"].max_in_flight_tokens),
        }
    return Layout(tuple(specs), num_blocks, max_model_len, caching, events, **extra)
