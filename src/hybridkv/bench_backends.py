"""The benchmark's backends and the work they are timed on: the Gemma-3-27b-like layout
(``gemma_like``), Zipf-like token ids (``tokens``), vLLM 0.33's manager with its ``Request`` and
hasher (``vllm_backend``), hybridkv's reference and optimized backend and the stand-in for vLLM
(``hybridkv_backends``), and the check that every backend returned the baseline's results
(``check_same``: otherwise ``Mismatch``, and nothing is timed). ``hybridkv.bench`` describes the
scenarios.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import random
import warnings
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_hash import hash_full_blocks, hash_full_blocks_cbor2
from hybridkv.reference.request import BlockHasher, RequestLike
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

BLOCK = 16
WINDOW = 1024
VOCAB = 262_144
GROUPS = 7

SCALING_BATCHES = (64, 128, 256, 512, 1024, 2048, 4096)
SCALING_POOLS = (10**4, 10**5, 10**6)
SCALING_PROMPT = 100


class BenchRequest(RequestLike, Protocol):
    """What the benchmark does to a request of any backend (vLLM's included)."""

    num_computed_tokens: int

    def append_output_token_ids(self, token_ids: int) -> None: ...


class Blocks(Protocol):
    def get_block_ids(self) -> Sequence[Sequence[int]]: ...


class Manager(Protocol):
    def new_step_starts(self) -> None: ...

    def get_computed_blocks(self, request: Any) -> tuple[Blocks, int, int]: ...

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
    ) -> Blocks | None: ...

    def free(self, request: Any) -> None: ...


@dataclass(frozen=True)
class Backend:
    """One manager implementation and the requests and hash function it is driven with."""

    name: str
    kind: str  # "vllm", "reference" or "optimized": what is built
    make: Callable[[KVCacheConfig, int, int], Manager]
    """``(config, max_model_len, max_num_reqs)`` → a manager (vLLM's ignores the last)."""
    request: Callable[[str, list[int]], BenchRequest]
    hash_job: Callable[[list[int]], Callable[[], Sequence[bytes]]]
    """A prompt → a call that hashes all of its full blocks (the timed part)."""
    request_for: Callable[[Manager, str, list[int]], BenchRequest] | None = None
    """How a scheduler builds a request for a given manager, when that differs from
    ``request`` (the optimized backend's explicit way: with the manager's ``block_hasher``)."""
    request_job: Callable[[list[int]], Callable[[], Sequence[bytes]]] | None = None
    """A prompt → a call that builds a request of it and returns its block hashes, as a manager
    meeting the request with nothing cached gets them (the default request path)."""

    def request_of(self, manager: Manager, request_id: str, prompt: list[int]) -> BenchRequest:
        """A request for ``manager``, built as a scheduler would."""
        if self.request_for is None:
            return self.request(request_id, prompt)
        return self.request_for(manager, request_id, prompt)


@dataclass(frozen=True)
class Way:
    """A backend and how a decode step calls it: per request, or ``allocate_slots_batch``;
    with ``columns``, on requests whose computed counts live in a ``StepColumns`` (the
    optimized backend's ``StepColumns.request``, built as the default request otherwise)."""

    backend: Backend
    batched: bool = False
    columns: bool = False

    @property
    def label(self) -> str:
        label = f"{self.backend.name}, batched" if self.batched else self.backend.name
        return f"{label}, step columns" if self.columns else label


class Mismatch(RuntimeError):
    """A backend returned something else than the baseline: the timings would not compare."""


# --- Layout, tokens, backends -----------------------------------------------------------------


def gemma_like(num_blocks: int) -> KVCacheConfig:
    sizes = {"block_size": BLOCK, "num_kv_heads": 16, "head_size": 128, "dtype_bytes": 2}
    full = KVCacheGroup(tuple(f"full.{i}" for i in range(10)), FullAttentionSpec(**sizes))
    spec = SlidingWindowSpec(sliding_window=WINDOW, **sizes)
    sliding = tuple(
        KVCacheGroup(tuple(f"sw.{j}" for j in range(10 * i, min(10 * i + 10, 52))), spec)
        for i in range(6)
    )
    return KVCacheConfig(num_blocks, (full, *sliding))


def tokens(rng: random.Random, count: int) -> list[int]:
    """Zipf-like token ids; ``array.tolist`` makes fresh ``int`` objects for every list."""
    return array("q", [int(VOCAB * rng.random() ** 3) for _ in range(count)]).tolist()


def vllm_version() -> str | None:
    """vLLM's version when its KV cache manager imports, else ``None``."""
    if importlib.util.find_spec("vllm") is None:
        return None
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("vllm.v1.core.kv_cache_manager")
    except ImportError:
        return None
    return importlib.metadata.version("vllm")


def vllm_backend() -> Backend:
    """vLLM 0.33's ``KVCacheManager`` with vLLM's ``Request`` and its ``sha256_cbor`` hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest

    from hybridkv.integrations.vllm import to_vllm_config

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)

    def make(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        manager: Manager = VllmManager(
            to_vllm_config(config),
            max_model_len,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
        )
        return manager

    def request(request_id: str, prompt: list[int]) -> BenchRequest:
        made: BenchRequest = VllmRequest(request_id, prompt, params, None, block_hasher=hasher)
        return made

    def hash_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        unhashed = VllmRequest("hash", prompt, params, None)
        return functools.partial(hasher, unhashed)

    def request_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        return lambda: request("hash", prompt).block_hashes

    return Backend("vLLM", "vllm", make, request, hash_job, request_job=request_job)


def _hybridkv_backend(
    name: str,
    kind: str,
    make: Callable[[KVCacheConfig, int, int], Manager],
    hasher: BlockHasher,
    explicit: bool = False,
) -> Backend:
    """Requests built without a hasher (the default path: the optimized manager offers its
    memo) or, with ``explicit`` or a reference ``hasher`` to time, naming one."""
    named = explicit or kind == "reference"

    def request(request_id: str, prompt: list[int]) -> BenchRequest:
        if named:
            return Request(request_id, prompt, hash_block_size=BLOCK, block_hasher=hasher)
        return Request(request_id, prompt, hash_block_size=BLOCK)

    def request_for(manager: Manager, request_id: str, prompt: list[int]) -> BenchRequest:
        if explicit and isinstance(manager, TorchKVCacheManager):
            return Request(
                request_id, prompt, hash_block_size=BLOCK, block_hasher=manager.block_hasher
            )
        return request(request_id, prompt)

    def hash_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        return functools.partial(
            hasher, prompt, BLOCK, start_block=0, parent_hash=None, cache_salt=None
        )

    def request_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        memo = HashMemo(BLOCK)  # an optimized manager's, with nothing cached

        def build() -> Sequence[bytes]:
            if named:
                return Request(
                    "hash", prompt, hash_block_size=BLOCK, block_hasher=hasher
                ).block_hashes
            made = Request("hash", prompt, hash_block_size=BLOCK)
            made.offer_block_hasher(memo)
            return made.block_hashes

        return build

    return Backend(name, kind, make, request, hash_job, request_for, request_job)


def hybridkv_backends(device: str) -> tuple[Backend, Backend, Backend, Backend]:
    """The stand-in for vLLM (the reference, hashing by the definition), the reference, the
    optimized backend with requests built the obvious way (``Request(rid, ids,
    hash_block_size=16)``) and the optimized backend with the explicit
    ``block_hasher=manager.block_hasher``."""

    def reference(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        return KVCacheManager(config, max_model_len)

    def optimized(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        return TorchKVCacheManager(config, max_model_len, device=device, max_num_reqs=max_num_reqs)

    return (
        _hybridkv_backend("stand-in", "reference", reference, hash_full_blocks_cbor2),
        _hybridkv_backend("reference", "reference", reference, hash_full_blocks),
        _hybridkv_backend("optimized", "optimized", optimized, hash_full_blocks_torch),
        _hybridkv_backend(
            "optimized, explicit", "optimized", optimized, hash_full_blocks_torch, explicit=True
        ),
    )


# --- The equality check -----------------------------------------------------------------------


def block_ids(blocks: Blocks) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in blocks.get_block_ids())


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def check_same(what: str, results: Sequence[tuple[str, object]]) -> None:
    """``Mismatch`` unless every ``(backend, result)`` equals the first (the baseline's)."""
    if not results:
        return
    baseline, expected = results[0]
    for name, got in results[1:]:
        if got != expected:
            detail = ""
            if isinstance(got, Sequence) and isinstance(expected, Sequence):
                index = next(
                    (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                    min(len(expected), len(got)),
                )
                detail = f" (first difference at [{index}]"
                detail += f": {baseline} {_short(expected[index : index + 1])}"
                detail += f", {name} {_short(got[index : index + 1])})"
            raise Mismatch(
                f"{what}: {name} returned {_short(got)}, {baseline} {_short(expected)}{detail}; "
                "the backends would not be timed on the same work"
            )
