"""A request as the KV cache manager sees it: token ids, computed tokens and block hashes.

The manager reads ``request_id``, ``num_tokens``, ``all_token_ids``, ``num_computed_tokens``
and ``block_hashes``, and the engine attributes ``num_prompt_tokens``,
``num_in_flight_tokens``, ``shared_prefix_boundary``, ``skip_reading_prefix_cache``,
``cache_salt``, ``session_id`` and ``num_preemptions`` (``RequestLike``). ``Request`` has them
all, with their defaults; so does vLLM's ``Request``, which the vLLM integration passes in, so a
scheduler's own request objects of that shape work too. What only ``Request`` carries (its
hash block size, lookahead, block hasher and packed token ids) is read from a ``Request``
alone.
``num_computed_tokens`` and ``shared_prefix_boundary`` belong to the scheduler: it advances the
first after each step and stores the third result of ``get_computed_blocks`` in the second, as
vLLM's scheduler does.
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Iterable, Sequence
from operator import countOf
from typing import Protocol, cast

from hybridkv.reference.block_hash import BlockHash, hash_full_blocks, hash_full_blocks_lookahead
from hybridkv.reference.request_keys import LoRA, MultiModalFeature, PromptEmbeds, RequestKeys
from hybridkv.spec.errors import check_non_negative, check_positive


class RequestLike(Protocol):
    """What the manager reads from a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    # The engine attributes (``Request.__init__`` gives each its default).

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_in_flight_tokens(self) -> int: ...

    @property
    def shared_prefix_boundary(self) -> int: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def session_id(self) -> str | None: ...

    @property
    def num_preemptions(self) -> int: ...


class BlockHasher(Protocol):
    """A function with the signature and results of ``hash_full_blocks``."""

    def __call__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]: ...


class PackedBlockHasher(BlockHasher, Protocol):
    """A block hasher that can also take the ids packed (``Request.packed_token_ids``).

    A ``Request`` whose hasher has ``hash_packed`` calls it, with its packed copy, instead of
    the hasher itself, so that the hasher need not convert the ids again; any other hasher is
    called as ``hash_full_blocks`` is. Same results as ``__call__``.
    """

    def hash_packed(
        self,
        token_ids: Sequence[int],
        packed: array[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]: ...


def check_token_ids(field: str, token_ids: Iterable[object]) -> list[int]:
    """Return the token ids as a list, or raise ``ValueError`` naming the first bad one
    (``pack_token_ids`` without the packed copy)."""
    return pack_token_ids(field, token_ids)[0]


def pack_token_ids(field: str, token_ids: Iterable[object]) -> tuple[list[int], array[int] | None]:
    """Return the token ids as a list and packed (unsigned 64-bit; ``None`` when one is 2**64 or
    more), or raise ``ValueError`` naming the first bad one.

    Plain ints are checked at C speed: below 2**31 by ``all_small_plain_ints``, else by how many
    have type ``int``; then their conversion to unsigned 64-bit ints (which refuses a negative
    one) is the packed copy. Anything else (another type, an int subclass, a negative id, an id
    from 2**64) takes the token-by-token loop, which accepts int subclasses but ``bool`` and
    names the first bad token."""
    tokens = list(token_ids)
    if all_small_plain_ints(tokens) or countOf(map(type, tokens), int) == len(tokens):
        ints = cast("list[int]", tokens)
        packed = array("Q")
        try:
            packed.fromlist(ints)  # a list's items read in place (the constructor iterates)
        except OverflowError:
            pass
        else:
            return ints, packed
    checked: list[int] = []
    for index, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"{field}[{index}] must be a non-negative int, got {token!r}")
        checked.append(token)
    if any(token >= 1 << 64 for token in checked):
        return checked, None
    return checked, array("Q", [int(token) for token in checked])


def all_small_plain_ints(tokens: list[object]) -> bool:
    """Whether every item has type ``int`` (not a subclass) and lies in ``[0, 2**31)``: one C
    loop over the items (``marshal``), no Python call per item.

    ``marshal`` (format version 2) writes a list as ``[``, its length in 4 bytes, then each
    item: one of type ``int`` exactly (a subclass is refused, ``True`` and ``False`` have codes
    of their own) in ``[-2**31, 2**31)`` as ``i`` and its 4 bytes, little endian; any other item
    otherwise. Reading the output from the start, item ``k`` begins at byte ``5 + 5k`` once the
    ``k`` items before it are ``i`` items, so an output of ``5 + 5n`` bytes with ``i`` at each
    of those bytes holds ``n`` such ints; they are non-negative when no 4th value byte has its
    sign bit set."""
    count = len(tokens)
    try:
        encoded = marshal.dumps(tokens, 2)
    except ValueError:  # an object marshal cannot write (an int subclass, say)
        return False
    return (
        len(encoded) == 5 + 5 * count
        and encoded[:5] == b"[" + count.to_bytes(4, "little")
        and encoded[5::5] == b"i" * count
        and encoded[9::5].isascii()
    )


class Request:
    """A prompt plus the output tokens appended so far, with the hashes of its full blocks.

    ``hash_block_size`` is the manager's hash block size (the block size of the KV cache
    groups, their gcd when they differ); ``cache_salt`` isolates the request's prefix cache
    entries from requests with another salt. ``block_hasher`` computes the hashes of new full
    blocks; any function with ``hash_full_blocks``' signature that returns the same hashes may
    be named (e.g. the optimized backend's ``hybridkv.optimized.hashing.hash_full_blocks_torch``);
    one that also has ``hash_packed`` (a ``PackedBlockHasher``, as
    ``TorchKVCacheManager.block_hasher``) is called through it, with ``packed_token_ids``, while
    the request keeps that packed copy. Named, it hashes the prompt at once. Not named, the
    request's hasher is still open: the first manager to meet the request may offer its own
    (``offer_block_hasher``: the optimized backend's memo, which adopts the hashes of cached
    prefixes), and ``hash_full_blocks`` hashes otherwise, when ``block_hashes`` is first read.
    Either way the hashes are the same; only the time spent on them differs, so the obvious
    ``Request(rid, tokens, hash_block_size=16)`` takes a backend's fast path with no keyword.

    Engine settings: ``skip_reading_prefix_cache`` makes every lookup report no hit (the request
    still writes the cache: a request that needs prompt logprobs, say);
    ``num_hash_lookahead_tokens`` (EAGLE/MTP with lookahead hashes) makes each block hash cover
    the tokens after the block too (``hash_full_blocks_lookahead``). ``shared_prefix_boundary``
    is the scheduler's copy of the third result of ``get_computed_blocks`` (0 until set);
    ``num_preemptions`` counts the times the scheduler preempted the request (it increments it),
    so that the prefix-cache statistics count a readmission apart. ``session_id`` names the
    session the request belongs to; the manager only reports it in the KV events of the blocks
    the request stores (``BlockStored.session_id``, as vLLM's).

    Keys besides the tokens (``hybridkv.reference.request_keys``), as vLLM's: ``lora`` (a
    ``LoRA`` adapter: on every block's hash, ``lora_id``/``lora_name`` in its events),
    ``mm_features`` (``MultiModalFeature`` items, sorted and not overlapping: on each block
    they overlap, with their offset) and ``prompt_embeds`` (``PromptEmbeds``, one row per prompt
    token: each block's digest). A request with any of them (``request_keys``) is hashed by
    their definition, never by ``block_hasher``.
    """

    request_keys: RequestKeys | None = None
    """LoRA, multimodal items and embeddings with the salt; ``None`` without the first three."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hash_block_size: int,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
        num_hash_lookahead_tokens: int = 0,
        block_hasher: BlockHasher | None = None,
        session_id: str | None = None,
        lora: LoRA | None = None,
        mm_features: Sequence[MultiModalFeature] | None = (),
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        check_positive("hash_block_size", hash_block_size)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if not isinstance(skip_reading_prefix_cache, bool):
            raise ValueError(
                f"skip_reading_prefix_cache must be a bool, got {skip_reading_prefix_cache!r}"
            )
        check_non_negative("num_hash_lookahead_tokens", num_hash_lookahead_tokens)
        if session_id is not None and not isinstance(session_id, str):
            raise ValueError(f"session_id must be a str or None, got {session_id!r}")
        self.request_id = request_id
        self.session_id = session_id
        prompt, packed = pack_token_ids("prompt_token_ids", prompt_token_ids)
        self._num_prompt_tokens = len(prompt)
        if lora is not None or prompt_embeds is not None or mm_features != ():
            keys = RequestKeys.of(lora, mm_features, prompt_embeds, cache_salt, len(prompt))
            self.request_keys = keys  # else the class's None: no store on the plain path
        self._prompt_token_ids: tuple[int, ...] | None = None
        self.hash_block_size = hash_block_size
        # An empty salt is no salt (vLLM salts the first block only when the salt is truthy).
        self.cache_salt = cache_salt or None
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.block_hasher: BlockHasher = hash_full_blocks if block_hasher is None else block_hasher
        # True until the hashes are first needed, while no hasher was named: a manager may
        # still offer one (``offer_block_hasher``).
        self._hasher_open = block_hasher is None
        self.num_computed_tokens = 0
        self.shared_prefix_boundary = 0
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0
        self._all_token_ids: list[int] = prompt
        self._packed_token_ids: array[int] | None = packed
        self._block_hashes: list[BlockHash] = []
        if not self._hasher_open:
            self._hash_new_full_blocks()

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (the start of ``all_token_ids``, which only grows): a tuple
        made when first read, as the manager never reads it."""
        prompt = self._prompt_token_ids
        if prompt is None:
            prompt = tuple(self._all_token_ids[: self._num_prompt_tokens])
            self._prompt_token_ids = prompt
        return prompt

    @property
    def lora(self) -> LoRA | None:
        return None if self.request_keys is None else self.request_keys.lora

    @property
    def mm_features(self) -> tuple[MultiModalFeature, ...]:
        return () if self.request_keys is None else self.request_keys.mm_features

    @property
    def prompt_embeds(self) -> PromptEmbeds | None:
        return None if self.request_keys is None else self.request_keys.prompt_embeds

    @property
    def all_token_ids(self) -> Sequence[int]:
        """The prompt followed by every output token appended so far."""
        return self._all_token_ids

    @property
    def packed_token_ids(self) -> array[int] | None:
        """``all_token_ids`` packed as unsigned 64-bit ints, kept in step with it (``None`` once
        an id does not fit): a manager may compare two requests' tokens in one memory
        comparison instead of int by int."""
        return self._packed_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """One hash per full block of ``all_token_ids``; grows as tokens are appended."""
        if self._hasher_open:
            self._close_hasher()
        return self._block_hashes

    def offer_block_hasher(self, hasher: BlockHasher) -> None:
        """A manager meeting the request offers ``hasher`` (one returning
        ``hash_full_blocks``' hashes): taken if the request was built without a hasher and has
        not hashed yet; either way the hashes of every full block are up to date afterwards."""
        if self._hasher_open:
            self.block_hasher = hasher
            self._close_hasher()

    def _close_hasher(self) -> None:
        self._hasher_open = False
        self._hash_new_full_blocks()

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append output tokens; every block they fill gets its hash at once."""
        if type(token_ids) is int and 0 <= token_ids < 1 << 64:
            # One plain token (a decode step's): no list to check or pack.
            self._all_token_ids.append(token_ids)
            if self._packed_token_ids is not None:
                self._packed_token_ids.append(token_ids)
            self._hash_new_full_blocks()
            return
        new_tokens = [token_ids] if isinstance(token_ids, int) else token_ids
        tokens, packed = pack_token_ids("token_ids", new_tokens)
        self._all_token_ids.extend(tokens)
        if packed is None or self._packed_token_ids is None:
            self._packed_token_ids = None
        else:
            self._packed_token_ids.extend(packed)
        self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        if self._hasher_open:
            return  # hashed when first needed, by the hasher then chosen
        hashable = (len(self._all_token_ids) - self.num_hash_lookahead_tokens) // (
            self.hash_block_size
        )
        if hashable <= len(self._block_hashes):
            return  # no block filled (most decode steps): the hasher is not called
        parent = self._block_hashes[-1] if self._block_hashes else None
        if self.request_keys is not None:
            self._block_hashes.extend(
                self.request_keys.hash_blocks(
                    self._all_token_ids,
                    self.hash_block_size,
                    start_block=len(self._block_hashes),
                    parent_hash=parent,
                    num_lookahead_tokens=self.num_hash_lookahead_tokens,
                )
            )
            return
        if self.num_hash_lookahead_tokens:
            self._block_hashes.extend(
                hash_full_blocks_lookahead(
                    self._all_token_ids,
                    self.hash_block_size,
                    start_block=len(self._block_hashes),
                    parent_hash=parent,
                    cache_salt=self.cache_salt,
                    num_lookahead_tokens=self.num_hash_lookahead_tokens,
                )
            )
            return
        hash_packed = getattr(self.block_hasher, "hash_packed", None)
        if hash_packed is not None and self._packed_token_ids is not None:
            # A ``PackedBlockHasher``: handed the packed copy too.
            self._block_hashes.extend(
                hash_packed(
                    self._all_token_ids,
                    self._packed_token_ids,
                    self.hash_block_size,
                    start_block=len(self._block_hashes),
                    parent_hash=parent,
                    cache_salt=self.cache_salt,
                )
            )
            return
        self._block_hashes.extend(
            self.block_hasher(
                self._all_token_ids,
                self.hash_block_size,
                start_block=len(self._block_hashes),
                parent_hash=parent,
                cache_salt=self.cache_salt,
            )
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
