"""Record the extra-key golden traces from vLLM 0.33's own ``KVCacheManager``.

``python scripts/record_extra_key_traces.py [OUT_DIR]`` (default ``tests/fixtures/extra_keys``)
drives vLLM's manager, constructed directly (``hybridkv.conformance.adapters.vllm``), with
requests that carry LoRA adapters, multimodal items, prompt embeddings and cache salts, under a
small scheduler (chunked prefill under a token budget, decode, preemption when an allocation
fails, frees), and writes one trace per layout in the format of ``conformance/vectors/README.md``
("Extra-key traces"): each operation with what vLLM observed, the request's block hashes after
``add``/``append`` and every KV event after each step. ``tests/test_golden_extra_keys.py``
replays them on both backends. Needs vLLM 0.33 and torch; deterministic (seeded).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"  # events carry the 32-byte hashes

import torch

from hybridkv.conformance.adapters import EngineOptions, hash_block_size_of
from hybridkv.conformance.adapters.vllm import VllmAdapter, make_adapter
from hybridkv.conformance.golden_keyed import KeyedTraceReplay
from hybridkv.reference.request_keys import LoRA, MultiModalFeature, PromptEmbeds
from hybridkv.spec import KVCacheConfig

Json = dict[str, Any]
BLOCK = 4
HIDDEN = 2  # embedding width (float32): 8 bytes per token


class KeyedVllmAdapter(VllmAdapter):
    """vLLM's adapter whose requests carry a LoRA adapter, multimodal items and embeddings."""

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
        lora: LoRA | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        prompt_embeds: PromptEmbeds | None = None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalKwargsItem,
            PlaceholderRange,
        )
        from vllm.v1.request import Request

        embeds = None
        if prompt_embeds is not None:
            raw = bytearray(prompt_embeds.data)
            embeds = torch.frombuffer(raw, dtype=torch.float32).reshape(
                prompt_embeds.num_tokens, -1
            )
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=self.max_model_len),
            None,
            prompt_embeds=embeds,
            mm_features=[
                MultiModalFeatureSpec(
                    data=MultiModalKwargsItem.dummy(),
                    modality="image",
                    identifier=f.identifier,
                    mm_position=PlaceholderRange(offset=f.offset, length=f.length),
                )
                for f in mm_features
            ]
            or None,
            lora_request=None if lora is None else LoRARequest(lora.name, lora.id, lora.path),
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )
        self.requests.append(request)
        return request


def keyed_factory(
    config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    events: bool,
    engine: EngineOptions,
) -> KeyedVllmAdapter:
    base = make_adapter(config, max_model_len, enable_caching, events, engine)
    return KeyedVllmAdapter(
        base.manager,
        hash_block_size_of(config, enable_caching),
        engine.num_hash_lookahead_tokens,
        max_model_len,
    )


@dataclass
class Spec:
    """A request to send: its ``add`` operation, when it arrives and how many tokens it
    generates."""

    add: Json
    arrival: int
    output_len: int
    generated: int = field(default=0)


def _embeds(rows: list[list[float]]) -> Json:
    data = torch.tensor(rows, dtype=torch.float32).numpy().tobytes()
    return {"num_tokens": len(rows), "dtype": "float32", "data": data.hex()}


def requests(rng: random.Random) -> list[Spec]:
    """The scenario's requests: LoRA (two adapters, one name re-pointed at another path),
    images (across block boundaries, the same image at another offset, another image at the
    same place), salts, embeddings (equal, sharing a prefix, different), a combination, and
    plain requests with the same tokens."""
    p1 = [rng.randrange(1, 500) for _ in range(22)]
    p2 = [rng.randrange(1, 500) for _ in range(26)]
    e1 = [[rng.uniform(-1, 1) for _ in range(HIDDEN)] for _ in range(18)]
    e2 = e1[:9] + [[rng.uniform(-1, 1) for _ in range(HIDDEN)] for _ in range(9)]
    lora_a = {"name": "adapter-a", "id": 1, "path": "/adapters/a"}
    lora_b = {"name": "adapter-b", "id": 2, "path": "/adapters/b"}
    lora_a2 = {"name": "adapter-a", "id": 3, "path": "/adapters/a-v2"}
    cat, dog = {"identifier": "img-cat", "length": 7}, {"identifier": "img-dog", "length": 4}
    images = [{**cat, "offset": 2}, {**dog, "offset": 13}]
    adds: list[Json] = [
        {"prompt": p1},
        {"prompt": p1, "lora": lora_a},
        {"prompt": p2, "mm_features": images},
        {"prompt": p1, "cache_salt": "x"},
        {"prompt": [0] * 18, "prompt_embeds": _embeds(e1)},
        {"prompt": [*p1, *p2[:6]], "lora": lora_a},
        {"prompt": p2, "mm_features": images},
        {"prompt": [*p1, 7, 8, 9], "cache_salt": "x"},
        {"prompt": [0] * 18, "prompt_embeds": _embeds(e1)},
        {"prompt": [0] * 18, "prompt_embeds": _embeds(e2)},
        {"prompt": p1, "lora": lora_b},
        {"prompt": p1, "lora": lora_a2},
        {"prompt": p2, "mm_features": [{**cat, "offset": 3}, {**dog, "offset": 13}]},
        {"prompt": p2, "mm_features": [{**cat, "identifier": "img-cow", "offset": 2}]},
        {"prompt": p1, "cache_salt": "y"},
        {"prompt": p2, "lora": lora_a, "mm_features": images, "cache_salt": "z"},
        {"prompt": p2, "lora": lora_a, "mm_features": images, "cache_salt": "z"},
        {"prompt": [*p1, 1, 2, 3, 4]},
        {"prompt": p2},
    ]
    return [
        Spec({"op": "add", "rid": f"r{i}", **add}, arrival=i // 2, output_len=rng.randrange(2, 9))
        for i, add in enumerate(adds)
    ]


class Recorder:
    """Runs operations on vLLM's manager through ``KeyedTraceReplay`` and keeps them with
    their observations."""

    def __init__(self, scenario: Json) -> None:
        self.ops: list[Json] = []
        self.observations: list[Json] = []
        self.scenario = {**scenario, "ops": self.ops}
        trace = {"scenario": self.scenario, "observations": self.observations}
        self.replay = KeyedTraceReplay(trace, keyed_factory)

    def do(self, op: Json) -> Json:
        observed = self.replay.observe(op)
        self.ops.append(op)
        self.observations.append(observed)
        return observed

    def allocate(self, rid: str, n: int | None, budget: int, use_hit: bool) -> Json:
        return self.do(
            {
                "op": "allocate",
                "rid": rid,
                "num_new_tokens": n,
                "token_budget": budget,
                "use_hit": use_hit,
                "num_lookahead_tokens": 0,
            }
        )


def run(scenario: Json, seed: int, budget: int = 24, max_steps: int = 120) -> Json:
    """One trace: the scenario's requests scheduled step by step on vLLM's manager."""
    rng = random.Random(seed)
    rec = Recorder(scenario)
    pending = deque(requests(rng))
    waiting: deque[Spec] = deque()
    running: dict[str, Spec] = {}
    step = 0
    while (pending or waiting or running) and step < max_steps:
        rec.do({"op": "new_step"})
        left = budget
        while pending and pending[0].arrival <= step:
            spec = pending.popleft()
            rec.do(spec.add)
            waiting.append(spec)
        for rid, spec in list(running.items()):
            state = rec.replay.requests[rid]
            if state.num_computed_tokens >= state.num_tokens:  # decoding
                rec.do({"op": "append", "rid": rid, "tokens": [rng.randrange(1, 500)]})
                spec.generated += 1
                if spec.generated >= spec.output_len:
                    rec.do({"op": "free", "rid": rid})
                    del running[rid]
                    continue
                seen = rec.allocate(rid, 1, left, False)
            elif left > 0:
                seen = rec.allocate(rid, None, min(left, 8), False)
            else:
                continue
            if seen["new_block_ids"] is None:
                rec.do({"op": "preempt", "rid": rid})
                del running[rid]
                waiting.appendleft(spec)
            else:
                left -= seen.get("num_new_tokens", 1)  # recorded when the replay chose n
        while waiting and left > 0:
            spec = waiting[0]
            rid = spec.add["rid"]
            rec.do({"op": "lookup", "rid": rid})
            seen = rec.allocate(rid, None, left, True)
            if seen["new_block_ids"] is None:
                break
            waiting.popleft()
            running[rid] = spec
            left -= seen["num_new_tokens"]
        rec.do({"op": "events"})
        if step % 5 == 4:
            rec.do({"op": "state", "detail": True})
        step += 1
    for rid in list(running) + [spec.add["rid"] for spec in waiting]:
        rec.do({"op": "free", "rid": rid})
    rec.do({"op": "events"})
    rec.do({"op": "state", "detail": True})
    import vllm

    return {
        "scenario": rec.scenario,
        "observations": rec.observations,
        "recorded_with": {
            "vllm": vllm.__version__,
            "script": "scripts/record_extra_key_traces.py",
            "seed": seed,
            "token_budget": budget,
        },
    }


def _group(kind: str, **fields: Any) -> Json:
    return {"kind": kind, "block_size": BLOCK, "num_layers": 1, **fields}


SCENARIOS: list[tuple[Json, int]] = [
    (
        {
            "name": "keys_full_swa",
            "groups": [_group("full"), _group("sliding_window", sliding_window=10)],
            "num_blocks": 73,
            "max_model_len": 96,
            "enable_caching": True,
        },
        1,
    ),
    (
        {
            "name": "keys_full_swa_lookahead",
            "groups": [_group("full"), _group("sliding_window", sliding_window=7)],
            "num_blocks": 73,
            "max_model_len": 96,
            "enable_caching": True,
            "num_hash_lookahead_tokens": 1,
        },
        2,
    ),
    (
        {
            "name": "keys_full_chunked",
            "groups": [_group("full"), _group("chunked_local", attention_chunk_size=8)],
            "num_blocks": 65,
            "max_model_len": 96,
            "enable_caching": True,
        },
        3,
    ),
    (
        {
            "name": "keys_full_mamba",
            "groups": [_group("full"), _group("mamba", mamba_cache_mode="align")],
            "num_blocks": 65,
            "max_model_len": 96,
            "enable_caching": True,
            "prefix_cache_retention_interval": None,
        },
        4,
    ),
]


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "tests/fixtures/extra_keys")
    out.mkdir(parents=True, exist_ok=True)
    for scenario, seed in SCENARIOS:
        trace = run(scenario, seed)
        path = out / f"{scenario['name']}.json.gz"
        text = json.dumps(trace, separators=(",", ":"))
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
        ops = trace["scenario"]["ops"]
        print(f"{path}: {len(ops)} ops, {path.stat().st_size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
