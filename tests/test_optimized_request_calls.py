"""``make_request`` and ``trust_hash_counts``: the optimized manager's calls about requests.

A running request's step counts its block hashes against its full blocks (more hashes than
full blocks: hashed at another block size), unless it is a ``Request`` hashed at the manager's
size or of a type whose owner guarantees its hashes (``trust_hash_counts``: the vLLM
integration names vLLM's ``Request``).
"""

from __future__ import annotations

import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


class OwnedRequest(Request):
    """A request type of another owner (any class but ``Request`` itself)."""


def _manager() -> TorchKVCacheManager:
    config = KVCacheConfig(
        40,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**SIZES)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=8, **SIZES)),
        ),
    )
    return TorchKVCacheManager(config, 64)


def _running(manager: TorchKVCacheManager, hash_block_size: int) -> OwnedRequest:
    """An ``OwnedRequest`` of 6 tokens hashed at ``hash_block_size``, admitted and computed."""
    request = OwnedRequest("r", list(range(6)), hash_block_size=hash_block_size)
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    return request


def test_make_request_hashes_at_the_managers_size_with_its_memo() -> None:
    manager = _manager()
    request = manager.make_request("r", list(range(9)))
    assert request.hash_block_size == 4
    assert request.block_hasher is manager.block_hasher
    assert len(request.block_hashes) == 2


def test_an_untrusted_type_hashed_at_another_size_is_refused_at_its_step() -> None:
    manager = _manager()
    request = _running(manager, 4)
    request.append_output_token_ids(6)
    assert manager.allocate_slots(request, 1) is not None  # its hashes are sound: a quiet step
    wrong = OwnedRequest("w", list(range(6)), hash_block_size=2)  # 3 hashes, 1 full block
    wrong.num_computed_tokens = 0
    with pytest.raises(ValueError, match="has 3 block_hashes, expected 1"):
        manager.allocate_slots(wrong, 6)


def test_a_trusted_type_is_not_counted_at_its_step() -> None:
    manager = _manager()
    manager.trust_hash_counts(OwnedRequest)
    assert manager.trusted == frozenset({OwnedRequest})
    request = _running(manager, 4)
    # Hashed at 2 now (one hash more than its full blocks): the owner's guarantee is taken at
    # its word on the decode path, where an untrusted type would be refused.
    request.hash_block_size = 2
    request.append_output_token_ids(6)
    assert manager.allocate_slots(request, 1) is not None
    untrusted = _manager()
    plain = _running(untrusted, 4)
    plain.hash_block_size = 2
    plain.append_output_token_ids(6)
    with pytest.raises(ValueError, match="has 3 block_hashes, expected 1"):
        untrusted.allocate_slots(plain, 1)


def test_trusting_something_not_a_class_is_refused_by_name() -> None:
    manager = _manager()
    with pytest.raises(TypeError, match="request_type must be a class, got 5"):
        manager.trust_hash_counts(5)  # type: ignore[arg-type]
    assert manager.trusted == frozenset()
