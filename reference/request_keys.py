"""A request's LoRA adapter, multimodal items and prompt embeddings: the keys besides its tokens
and cache salt that enter its block hashes and its KV events, exactly as vLLM 0.33's
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys`` and
``to_event_extra_keys``; ``vllm/v1/core/block_pool.py``, ``_build_block_stored_event``).

The extra keys of the block of tokens ``start … end − 1`` are, in this order (``None`` when
there are none):

- ``("lora", name, path)`` on every block of a request with a LoRA adapter;
- ``("mm", identifier, offset − start)`` for each multimodal item whose placeholder range
  ``offset … offset + length − 1`` overlaps the block, in the items' order (the offset is
  negative for an item that began in an earlier block);
- ``("cache_salt", salt)`` on the block that starts at token 0;
- ``("prompt_embeds", digest)``: SHA-256 of the bytes of the embedding rows ``start … end − 1``
  (vLLM's ``tensor_data``: the rows' raw bytes in row-major order; a block past the prompt
  hashes the short or empty slice, as slicing a tensor gives it).

The hash of a block is ``sha256_cbor((parent or NONE_HASH, tokens, extra_keys))``; with
``num_hash_lookahead_tokens`` ``L`` the window of the keys reaches ``end + L`` and the third
element becomes ``(extra_keys, *the L tokens after the block)``. Events publish each block's keys
untagged (the name, ``(identifier, offset)``, the salt, the digest) with ``lora_id`` and
``lora_name``.

A request without LoRA, multimodal items or embeddings has no ``RequestKeys`` and is hashed
by the fast paths (``hybridkv.reference.block_hash``, the optimized backend's hashers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.reference.block_hash import NONE_HASH, BlockHash, sha256_cbor
from hybridkv.spec.errors import check_non_negative, check_positive


def _check_str(field: str, value: object, *, non_empty: bool = False) -> None:
    if not isinstance(value, str) or (non_empty and not value):
        kind = "a non-empty str" if non_empty else "a str"
        raise ValueError(f"{field} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter, as the fields of vLLM's ``LoRARequest`` that the cache reads:
    ``name`` (``lora_name``, hashed and published as ``lora_name``), ``id`` (``lora_int_id``,
    published as ``lora_id``: a positive int) and ``path`` (``lora_path``, hashed: re-pointing
    a name at another adapter does not reuse its KV; non-empty, as vLLM requires)."""

    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        _check_str("lora.name", self.name)
        check_positive("lora.id", self.id)
        _check_str("lora.path", self.path, non_empty=True)


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal item: its ``identifier`` (vLLM's ``MultiModalFeatureSpec.identifier``,
    with the LoRA prefix if any) and its placeholder range in the prompt (``mm_position``:
    ``offset`` and ``length`` tokens)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_str("mm_feature.identifier", self.identifier)
        check_non_negative("mm_feature.offset", self.offset)
        check_positive("mm_feature.length", self.length)

    @property
    def end(self) -> int:
        """The token after the placeholder range."""
        return self.offset + self.length


@dataclass(frozen=True)
class PromptEmbeds:
    """Prompt embeddings as their raw bytes: ``num_tokens`` rows of ``len(data) // num_tokens``
    bytes each, row-major (what vLLM's ``tensor_data`` reads from the tensor, whatever its
    dtype). ``of`` takes any C buffer whose first dimension is the tokens (a numpy array, a
    ``torch`` tensor's ``.numpy()``; a bfloat16 tensor's ``.view(torch.uint8).numpy()``)."""

    data: bytes
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            raise ValueError(f"prompt_embeds.data must be bytes, got {type(self.data).__name__}")
        check_non_negative("prompt_embeds.num_tokens", self.num_tokens)
        rows = max(self.num_tokens, 1)
        if len(self.data) % rows or (self.num_tokens == 0 and self.data):
            raise ValueError(
                f"prompt_embeds.data must hold num_tokens={self.num_tokens} rows of equal size, "
                f"got {len(self.data)} bytes"
            )

    @classmethod
    def of(cls, rows: Any) -> PromptEmbeds:
        """The embeddings of a buffer of shape ``(num_tokens, …)``."""
        try:
            view = memoryview(rows)
        except TypeError:
            raise ValueError(
                f"prompt_embeds must support the buffer protocol, got {type(rows).__name__}"
            ) from None
        if view.ndim == 0:
            raise ValueError("prompt_embeds must have a token dimension, got a scalar")
        return cls(view.tobytes(), view.shape[0] if view.shape else 0)

    def digest(self, start: int, end: int) -> bytes:
        """SHA-256 of the bytes of rows ``start … end − 1`` (clipped to the rows there are)."""
        row = len(self.data) // self.num_tokens if self.num_tokens else 0
        return hashlib.sha256(self.data[start * row : end * row]).digest()


ExtraKeys = tuple[tuple[Any, ...], ...] | None
"""One block's extra keys, tagged (``("lora", name, path)``, ``("mm", id, offset)``, …)."""


@dataclass(frozen=True)
class RequestKeys:
    """What a request's block hashes key on besides its tokens (see the module docstring)."""

    lora: LoRA | None
    mm_features: tuple[MultiModalFeature, ...]
    prompt_embeds: PromptEmbeds | None
    cache_salt: str | None

    @classmethod
    def of(
        cls,
        lora: object,
        mm_features: object,
        prompt_embeds: object,
        cache_salt: str | None,
        num_prompt_tokens: int,
    ) -> RequestKeys | None:
        """The keys of a request, checked (``ValueError`` naming the field and the value);
        ``None`` when it has no LoRA, multimodal item or embeddings."""
        if lora is not None and not isinstance(lora, LoRA):
            raise ValueError(f"lora must be a LoRA or None, got {lora!r}")
        features = _check_features(mm_features)
        if prompt_embeds is not None:
            if not isinstance(prompt_embeds, PromptEmbeds):
                raise ValueError(
                    f"prompt_embeds must be a PromptEmbeds or None, got {prompt_embeds!r}"
                )
            if prompt_embeds.num_tokens != num_prompt_tokens:
                raise ValueError(
                    f"prompt_embeds must have one row per prompt token ({num_prompt_tokens}), "
                    f"got {prompt_embeds.num_tokens}"
                )
        if lora is None and not features and prompt_embeds is None:
            return None
        return cls(lora, features, prompt_embeds, cache_salt or None)

    def block_keys(self, start: int, end: int) -> ExtraKeys:
        """The tagged extra keys of tokens ``start … end − 1`` (vLLM's
        ``generate_block_hash_extra_keys``; ``end`` reaches past the block with lookahead)."""
        keys: list[tuple[Any, ...]] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.path))
        for feature in self.mm_features:
            if feature.offset >= end:
                break
            if feature.end > start:
                keys.append(("mm", feature.identifier, feature.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        if self.prompt_embeds is not None:
            keys.append(("prompt_embeds", self.prompt_embeds.digest(start, end)))
        return tuple(keys) or None

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        num_lookahead_tokens: int = 0,
    ) -> list[BlockHash]:
        """The chained hashes of the full blocks of ``token_ids`` from ``start_block`` on (each
        with ``num_lookahead_tokens`` tokens after it known), by the definition."""
        hashes: list[BlockHash] = []
        parent = parent_hash
        look = num_lookahead_tokens
        for index in range(start_block, (len(token_ids) - look) // block_size):
            start, end = index * block_size, (index + 1) * block_size
            extra: object = self.block_keys(start, end + look)
            if look:
                extra = (extra, *token_ids[end : end + look])
            tokens = tuple(token_ids[start:end])
            parent = BlockHash(
                sha256_cbor((NONE_HASH if parent is None else parent, tokens, extra))
            )
            hashes.append(parent)
        return hashes

    def event_keys(
        self, positions: Sequence[int], block_size: int, num_lookahead_tokens: int
    ) -> list[tuple[Any, ...] | None]:
        """The ``extra_keys`` of a ``BlockStored`` of the blocks at ``positions`` (of
        ``block_size``): each block's keys untagged (vLLM's ``to_event_extra_keys``), over the
        same window as its hash."""
        published: list[tuple[Any, ...] | None] = []
        for position in positions:
            start = position * block_size
            keys = self.block_keys(start, start + block_size + num_lookahead_tokens)
            published.append(
                None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
            )
        return published


def _check_features(mm_features: object) -> tuple[MultiModalFeature, ...]:
    """The items as a tuple, each a ``MultiModalFeature``, sorted by offset and not overlapping
    (as a prompt's placeholders are: vLLM's key generation assumes it)."""
    if mm_features is None:  # vLLM's default
        return ()
    if isinstance(mm_features, str | bytes) or not isinstance(mm_features, Sequence):
        raise ValueError(
            f"mm_features must be a sequence of MultiModalFeature, got {mm_features!r}"
        )
    features = tuple(mm_features)
    for index, feature in enumerate(features):
        if not isinstance(feature, MultiModalFeature):
            raise ValueError(f"mm_features[{index}] must be a MultiModalFeature, got {feature!r}")
        if index and feature.offset < features[index - 1].end:
            raise ValueError(
                f"mm_features[{index}] must start at or after the end of mm_features[{index - 1}] "
                f"({features[index - 1].end}): items are sorted and do not overlap, got offset "
                f"{feature.offset}"
            )
    return features
