"""Strategies the differential machine draws from: layouts (the groups, the pool, the engine
settings) and traffic (prompts, system prompts, salts).

A ``Layout`` is one drawn configuration; ``layouts(family)`` draws one of a layout family
(``FAMILIES``). The traffic strategies draw what a scheduler sends: fresh prompts, prompts that
share a system prompt, cache salts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st

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
)


# --- Layouts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One drawn configuration: the groups' specs, the pool, the model length, the switches."""

    specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    max_model_len: int
    enable_caching: bool
    enable_events: bool

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    def config(self) -> KVCacheConfig:
        groups = tuple(KVCacheGroup((f"layer{gid}",), spec) for gid, spec in enumerate(self.specs))
        return KVCacheConfig(num_blocks=self.num_blocks, groups=groups)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(spec_kind(spec) for spec in self.specs)


FAMILIES: tuple[str, ...] = ("hybrid", "no_full_attention", "one_type", "uncached", "mamba")
"""Layout families; a run splits its examples evenly between them, so that every family is
covered however Hypothesis spreads its draws:

* ``hybrid``: prefix caching, 2–4 groups, full attention and at least one other type;
* ``no_full_attention``: prefix caching, 2–4 groups of sliding window and chunked local only;
* ``one_type``: prefix caching, one group (unitary coordinator) or equal-spec groups;
* ``uncached``: no prefix caching, any attention mix;
* ``mamba``: no prefix caching, Mamba groups among attention groups.
"""


@st.composite
def layouts(draw: st.DrawFn, family: str = "hybrid") -> Layout:
    """A layout of ``family``: one block size shared by 1–4 groups; windows and chunks that are
    and are not multiples of it; equal specs may repeat (jointly looked-up groups); pools from a
    fraction of one longest request (allocations fail, caches evict) to a few of them."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    b = rng.choice([1, 2, 3, 4, 8])
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
    if family == "hybrid":
        specs = [full, rng.choice(others)]
        specs += [rng.choice([full, *others]) for _ in range(rng.randint(0, 2))]
        rng.shuffle(specs)
    elif family == "no_full_attention":
        specs = [rng.choice(others) for _ in range(rng.randint(2, 4))]
    elif family == "one_type":
        specs = [rng.choice([full, *others])] * rng.choice([1, 1, 2, 3])
    else:
        specs = [rng.choice([full, *others]) for _ in range(rng.randint(1, 3))]
        if family == "mamba":
            specs.insert(rng.randint(0, len(specs)), MambaSpec(block_size=b, state_bytes=16))
    caching = family not in ("uncached", "mamba")
    max_model_len = rng.randint(max(4, 2 * b), min(16 * b, 96))
    longest = sum(
        1 if isinstance(spec, MambaSpec) else rules.cdiv(max_model_len, b) for spec in specs
    )
    quarters = rng.choice([1, 2, 4, 6, 8, 12, 24])
    num_blocks = 1 + max(1, longest * quarters // 4)
    events = caching and rng.random() < 0.5
    return Layout(tuple(specs), num_blocks, max_model_len, caching, events)
