"""LoRA, multimodal and prompt-embedding keys in a ``Request``'s block hashes and events, one rule
per test on a tiny example, as vLLM 0.33 computes them (``generate_block_hash_extra_keys``,
``hash_block_tokens``, ``to_event_extra_keys``; compared with vLLM's own functions where it is
installed)."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest

from hybridkv.reference.block_hash import NONE_HASH, BlockHash, sha256_cbor
from hybridkv.reference.request import Request
from hybridkv.reference.request_keys import LoRA, MultiModalFeature, PromptEmbeds, RequestKeys
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

if TYPE_CHECKING:
    from conftest import ManagerFactory

LORA = LoRA("adapter-a", 7, "/adapters/a")
TAG = ("lora", "adapter-a", "/adapters/a")


def chain(tokens: Sequence[int], block_size: int, keys: Sequence[object]) -> list[BlockHash]:
    """The definition: ``sha256_cbor((parent or NONE_HASH, tokens, keys[i]))``, chained."""
    hashes: list[BlockHash] = []
    parent = NONE_HASH
    for index, extra in enumerate(keys):
        block = tuple(tokens[index * block_size : (index + 1) * block_size])
        parent = BlockHash(sha256_cbor((parent, block, extra)))
        hashes.append(parent)
    return hashes


def block_keys(request: Request, block_size: int) -> list[object]:
    keys = request.request_keys
    assert keys is not None
    return [keys.block_keys(i * block_size, (i + 1) * block_size) for i in range(4)]


def test_lora_is_on_every_block() -> None:
    request = Request("r", list(range(1, 17)), hash_block_size=4, lora=LORA)
    assert block_keys(request, 4) == [(TAG,)] * 4
    assert list(request.block_hashes) == chain(request.all_token_ids, 4, [(TAG,)] * 4)
    assert request.lora == LORA


def test_an_image_across_a_block_boundary_is_on_each_block_it_overlaps_with_its_offset() -> None:
    image = MultiModalFeature("img-cat", 2, 7)  # tokens 2 … 8: blocks 0, 1 and 2
    request = Request("r", list(range(1, 17)), hash_block_size=4, mm_features=[image])
    expected = [(("mm", "img-cat", 2),), (("mm", "img-cat", -2),), (("mm", "img-cat", -6),), None]
    assert block_keys(request, 4) == expected
    assert list(request.block_hashes) == chain(request.all_token_ids, 4, expected)
    assert request.mm_features == (image,)


def test_several_images_in_one_block_each_have_a_key_in_order() -> None:
    images = [MultiModalFeature("a", 1, 2), MultiModalFeature("b", 3, 3)]
    request = Request("r", list(range(1, 17)), hash_block_size=4, mm_features=images)
    assert block_keys(request, 4)[:3] == [
        (("mm", "a", 1), ("mm", "b", 3)),
        (("mm", "b", -1),),
        None,
    ]


def test_the_salt_is_on_block_zero_only_after_lora_and_images() -> None:
    image = MultiModalFeature("img", 0, 5)
    request = Request(
        "r", list(range(1, 17)), hash_block_size=4, lora=LORA, mm_features=[image], cache_salt="s"
    )
    assert block_keys(request, 4) == [
        (TAG, ("mm", "img", 0), ("cache_salt", "s")),
        (TAG, ("mm", "img", -4)),
        (TAG,),
        (TAG,),
    ]


def test_prompt_embeds_are_the_digest_of_each_blocks_rows() -> None:
    data = bytes(range(10 * 8))  # 10 rows of 8 bytes
    embeds = PromptEmbeds(data, 10)
    request = Request("r", [0] * 10, hash_block_size=4, prompt_embeds=embeds, cache_salt="s")
    digest = [hashlib.sha256(data[a:b]).digest() for a, b in ((0, 32), (32, 64), (64, 80))]
    expected = [
        (("cache_salt", "s"), ("prompt_embeds", digest[0])),
        (("prompt_embeds", digest[1]),),
    ]
    assert block_keys(request, 4)[:2] == expected
    request.append_output_token_ids([5, 6])  # block 2 runs past the prompt: its short slice
    assert list(request.block_hashes) == chain(
        request.all_token_ids, 4, [*expected, (("prompt_embeds", digest[2]),)]
    )
    assert embeds.digest(12, 16) == hashlib.sha256(b"").digest()


def test_lookahead_keys_cover_the_next_tokens_and_their_images() -> None:
    image = MultiModalFeature("img", 4, 2)  # in block 1, and in block 0's lookahead window
    request = Request(
        "r", list(range(1, 11)), hash_block_size=4, num_hash_lookahead_tokens=1, lora=LORA
    )
    keyed = Request(
        "k", list(range(1, 11)), hash_block_size=4, num_hash_lookahead_tokens=1, mm_features=[image]
    )
    assert list(request.block_hashes) == chain(request.all_token_ids, 4, [((TAG,), 5), ((TAG,), 9)])
    assert list(keyed.block_hashes) == chain(
        keyed.all_token_ids, 4, [((("mm", "img", 4),), 5), ((("mm", "img", 0),), 9)]
    )


def test_events_publish_the_keys_untagged() -> None:
    keys = RequestKeys(LORA, (MultiModalFeature("img", 2, 4),), PromptEmbeds(bytes(16), 8), "s")
    digest = hashlib.sha256(bytes(8)).digest()
    assert keys.event_keys([0, 1, 3], 4, 0) == [
        ("adapter-a", ("img", 2), "s", digest),
        ("adapter-a", ("img", -2), digest),
        ("adapter-a", hashlib.sha256(b"").digest()),
    ]


def test_a_request_without_keys_has_none() -> None:
    request = Request("r", [1, 2, 3, 4], hash_block_size=4, cache_salt="s", mm_features=[])
    assert request.request_keys is None
    assert (request.lora, request.mm_features, request.prompt_embeds) == (None, (), None)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LoRA("a", 0, "/a"), r"^lora.id must be a positive int, got 0$"),
        (lambda: LoRA("a", 1, ""), r"^lora.path must be a non-empty str, got ''$"),
        (lambda: LoRA(3, 1, "/a"), r"^lora.name must be a str, got 3$"),  # type: ignore[arg-type]
        (
            lambda: MultiModalFeature("x", -1, 2),
            r"^mm_feature.offset must be a non-negative int, got -1$",
        ),
        (
            lambda: MultiModalFeature("x", 0, 0),
            r"^mm_feature.length must be a positive int, got 0$",
        ),
        (
            lambda: PromptEmbeds(bytes(7), 2),
            r"^prompt_embeds.data must hold num_tokens=2 rows of equal size, got 7 bytes$",
        ),
        (
            lambda: Request("r", [1, 2], hash_block_size=2, lora="a"),  # type: ignore[arg-type]
            r"^lora must be a LoRA or None, got 'a'$",
        ),
        (
            lambda: Request("r", [1], hash_block_size=2, mm_features=[("x", 0, 1)]),  # type: ignore[list-item]
            r"^mm_features\[0\] must be a MultiModalFeature, got \('x', 0, 1\)$",
        ),
        (
            lambda: Request(
                "r",
                [1] * 8,
                hash_block_size=2,
                mm_features=[MultiModalFeature("a", 0, 4), MultiModalFeature("b", 3, 1)],
            ),
            r"^mm_features\[1\] must start at or after the end of mm_features\[0\] \(4\)",
        ),
        (
            lambda: Request(
                "r", [1, 2], hash_block_size=2, prompt_embeds=PromptEmbeds(bytes(3), 3)
            ),
            r"^prompt_embeds must have one row per prompt token \(2\), got 3$",
        ),
    ],
)
def test_bad_keys_are_refused_with_field_and_value(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def _config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4)
    return KVCacheConfig(num_blocks=32, groups=(KVCacheGroup(("l0",), spec),))


def test_both_managers_hash_keyed_requests_apart_and_publish_their_keys(
    make_manager: ManagerFactory,
) -> None:
    """``make_request`` takes the keys; a plain request made after a LoRA request with its
    tokens was cached neither hits its blocks nor adopts its hashes (the optimized backend's memo
    keeps plain requests only), and the events carry ``lora_id``, ``lora_name`` and the
    untagged keys."""
    manager: Any = make_manager(_config(), 64, enable_kv_cache_events=True)
    tokens = list(range(1, 14))
    image = MultiModalFeature("img", 3, 2)
    keyed: dict[str, Any] = {"lora": LORA, "mm_features": [image], "cache_salt": "s"}
    made = {}
    hits = []
    for rid, keys in (("k", keyed), ("l", {"lora": LORA}), ("p", {}), ("a", keyed)):
        request = made[rid] = manager.make_request(rid, tokens, **keys)
        blocks, hit, _ = manager.get_computed_blocks(request)
        hits.append(hit)
        assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
        request.num_computed_tokens = request.num_tokens
    assert hits == [0, 0, 0, 12]
    assert list(made["p"].block_hashes) == chain(tokens, 4, [None] * 3)
    assert list(made["l"].block_hashes) == chain(tokens, 4, [(TAG,)] * 3)
    assert list(made["k"].block_hashes) == chain(
        tokens, 4, [(TAG, ("mm", "img", 3), ("cache_salt", "s")), (TAG, ("mm", "img", -1)), (TAG,)]
    )
    stored = [e for e in manager.take_events() if type(e).__name__ == "BlockStored"]
    assert [(e.lora_id, e.lora_name, e.extra_keys) for e in stored] == [
        (
            7,
            "adapter-a",
            (("adapter-a", ("img", 3), "s"), ("adapter-a", ("img", -1)), ("adapter-a",)),
        ),
        (7, "adapter-a", (("adapter-a",),) * 3),
        (None, None, (None, None, None)),
    ]


def _vllm() -> Any:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")


CASES = [
    # (tokens, block size, lookahead, LoRA, images, salt, embedding rows)
    (20, 4, 0, True, [("cat", 2, 7), ("dog", 12, 3)], None, False),
    (20, 4, 0, False, [("cat", 0, 4), ("dog", 4, 1), ("cow", 5, 9)], "s", True),
    (23, 4, 1, True, [("cat", 4, 2)], "s", True),
    (17, 2, 2, False, [("cat", 1, 3)], None, False),
    (12, 4, 0, True, [], "t", False),
]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", CASES)
def test_hashes_keys_and_event_keys_equal_vllms(case: tuple[Any, ...]) -> None:
    _vllm()
    torch = pytest.importorskip("torch")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        get_request_block_hasher,
        init_none_hash,
        to_event_extra_keys,
    )
    from vllm.v1.request import Request as VllmRequest

    n, bs, look, lora, images, salt, has_embeds = case
    init_none_hash(vllm_sha256_cbor)
    tokens = [(7 * i) % 50 for i in range(n)]
    embeds = torch.linspace(-1, 1, n * 3, dtype=torch.float32).reshape(n, 3) if has_embeds else None
    theirs = VllmRequest(
        "r",
        tokens,
        SamplingParams(max_tokens=8),
        None,
        prompt_embeds=embeds,
        mm_features=[
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                modality="image",
                identifier=i,
                mm_position=PlaceholderRange(offset=o, length=length),
            )
            for i, o, length in images
        ],
        lora_request=LoRARequest(LORA.name, LORA.id, LORA.path) if lora else None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(bs, vllm_sha256_cbor, look),
    )
    ours = Request(
        "r",
        tokens,
        hash_block_size=bs,
        num_hash_lookahead_tokens=look,
        lora=LORA if lora else None,
        mm_features=[MultiModalFeature(*image) for image in images],
        prompt_embeds=None if embeds is None else PromptEmbeds.of(embeds.numpy()),
        cache_salt=salt,
    )
    for token in (3, 4, 5, 6, 7):  # output blocks too: LoRA on them, embeddings past the prompt
        theirs.append_output_token_ids([token])
        ours.append_output_token_ids(token)
    assert list(ours.block_hashes) == list(theirs.block_hashes)
    keys = ours.request_keys
    assert keys is not None
    blocks = range(ours.num_tokens // bs)
    vllm_keys = [generate_block_hash_extra_keys(theirs, b * bs, (b + 1) * bs, 0)[0] for b in blocks]
    assert [keys.block_keys(b * bs, (b + 1) * bs) for b in blocks] == vllm_keys
    assert keys.event_keys(list(blocks), bs, 0) == to_event_extra_keys(vllm_keys)


def test_the_embedding_digest_is_vllms_for_float32_and_bfloat16_tensors() -> None:
    torch = pytest.importorskip("torch")
    rows = torch.randn(9, 5, generator=torch.Generator().manual_seed(0))
    for tensor, form in (
        (rows, PromptEmbeds.of(rows.numpy())),
        (
            rows.to(torch.bfloat16),
            PromptEmbeds.of(rows.to(torch.bfloat16).view(torch.uint8).numpy()),
        ),
    ):
        for start, end in ((0, 4), (4, 8), (8, 12), (12, 16)):
            raw = tensor[start:end].flatten().contiguous().view(torch.uint8).numpy().tobytes()
            assert form.digest(start, end) == hashlib.sha256(raw).digest()
