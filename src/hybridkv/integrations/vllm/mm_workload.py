"""``vllm-check --workload multimodal``: requests with images, LoRA adapters, cache salts and
prompt embeddings, scheduled by vLLM 0.33's real scheduler with its encoder budget and encoder
cache, on vLLM's manager and on each hybridkv backend, every step compared.

The scheduler runs the check's tiny text model with a LoRA config (``max_loras`` 2, three
adapters in the workload) and, as vLLM's own scheduler tests do for a text model
(``test_max_loras_counts_running_request_skipped_for_encoder_budget``), an encoder compute
budget of ``ENCODER_BUDGET`` embeddings per step and an ``EncoderCacheManager`` of
``ENCODER_CACHE`` embeddings: a multimodal model's budget needs its processor, which an offline
config directory lacks. Images are ``MultiModalFeatureSpec`` items (``PlaceholderRange`` over
image-token placeholders, some across block boundaries, the same image at other offsets), so the
budget and the encoder cache decide what each step schedules: a chunked prefill stops before an
image that does not fit, an image already in the encoder cache is not encoded again, and a
prefix-cache hit into an image's placeholders still needs the image.

The workload opens with scripted requests whose outcomes the tests pin (``ANCHORS``: an image
that waits a step for the budget, a shared image, the same image prompt again, the same prompt
with another image, LoRA prompts again under the same and another adapter, salted prompts,
prompt embeddings again and others), then a seeded mix of ``num_requests`` such requests with
resends, priorities and aborts, and one prefix-cache reset. Each step's record adds the
scheduled encoder inputs per request and the encoder cache entries freed to the check's record.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.integrations.vllm.run_config import DEFAULTS, VOCAB, Arrival, RunConfig, Workload

WORKLOADS = ("tokens", "multimodal")
LAYOUTS = ("gemma3", "llama4")
RUNS = ("sync", "async")
ENCODER_BUDGET = 64
"""Encoder embeddings a step may compute (the scheduler's ``max_num_encoder_input_tokens``)."""
ENCODER_CACHE = 96
"""Encoder embeddings the encoder cache holds."""
MAX_LORAS = 2
NUM_BLOCKS = 160
"""The pool's blocks by default: the scripted requests sent again find theirs still cached."""
IMAGE_TOKEN = VOCAB - 1
"""The placeholder token of every image position (as a model's image token)."""
IMAGES = {"cat": 24, "owl": 56, "dog": 40, "fox": 12, "cow": 24, "elk": 32}
"""Every image's placeholder length (one identifier, one length, as vLLM requires)."""
ADAPTERS = ("a", "b", "c")


@dataclass(frozen=True)
class Spec:
    """One request: its text tokens around the images, the images ``(identifier, offset)``,
    its LoRA adapter, salt and prompt embeddings (a seed; ``None``: token ids)."""

    request_id: str
    step: int
    prompt: tuple[int, ...]
    images: tuple[tuple[str, int], ...] = ()
    adapter: str | None = None
    salt: str | None = None
    embeds: int | None = None
    max_tokens: int = 4
    priority: int = 0
    abort_after: int | None = None


def _tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB - 1) for _ in range(n))


def _with_images(tokens: Sequence[int], images: Sequence[tuple[str, int]]) -> tuple[int, ...]:
    """``tokens`` with each image's placeholder positions set to ``IMAGE_TOKEN``."""
    out = list(tokens)
    for identifier, offset in images:
        out[offset : offset + IMAGES[identifier]] = [IMAGE_TOKEN] * IMAGES[identifier]
    return tuple(out)


_A = _tokens(1, 120)  # the image prompt
_B = _tokens(2, 90)  # another prompt with the owl
_L = _tokens(3, 80)  # the LoRA prompt
_S = _tokens(4, 48)  # the salted prompt
# cat over blocks 0-2, owl over 3-7 (24 + 56 embeddings > the budget); a hit of 7 blocks ends
# inside the owl
_IMG_A = (("cat", 10), ("owl", 60))
_COW_A = (("cow", 10), ("owl", 60))

ANCHORS = (
    Spec("img-a", 0, _with_images(_A, _IMG_A), _IMG_A),
    Spec("lora-a", 0, _L, adapter="a"),
    Spec("img-b", 2, _with_images(_B, [("owl", 20)]), (("owl", 20),)),
    Spec("lora-b", 2, _L, adapter="b"),
    Spec("lora-c", 2, _L[:64] + _tokens(5, 20), adapter="c"),
    Spec("salt-x", 3, _S, salt="x"),
    Spec("embeds", 3, (0,) * 40, embeds=1),
    Spec("img-a.again", 12, _with_images(_A, _IMG_A) + _tokens(6, 8), _IMG_A),
    Spec("img-a.cow", 12, _with_images(_A, _COW_A), _COW_A),
    Spec("lora-a.again", 13, _L + _tokens(7, 10), adapter="a"),
    Spec("salt-x.again", 13, _S, salt="x"),
    Spec("salt-y", 13, _S, salt="y"),
    Spec("embeds.again", 14, (0,) * 40, embeds=1),
    Spec("embeds.other", 14, (0,) * 40, embeds=2),
)
"""The scripted opening, whose outcomes the tests pin."""
FIRST_RANDOM_STEP = 20


def _random_specs(cfg: RunConfig) -> list[Spec]:
    """``cfg.num_requests`` seeded requests: images at random offsets behind shared system
    prompts, LoRA adapters, salts, prompt embeddings, plain prompts and resends."""
    rng = random.Random(cfg.seed)
    systems = [_tokens(10 + i, n) for i, n in enumerate((16, 37, 64))]
    specs: list[Spec] = []
    step = FIRST_RANDOM_STEP
    for i in range(cfg.num_requests):
        step += rng.choice((0, 0, 1, 1, 2, 3))
        request_id = f"m{i}"
        kind = rng.random()
        max_tokens, priority = rng.randrange(1, 24), rng.randrange(0, 2)
        abort_after = rng.randrange(1, 10) if rng.random() < 0.1 else None
        if kind < 0.15 and specs:
            spec = dataclasses.replace(rng.choice(specs), request_id=request_id, step=step)
        elif kind < 0.3:
            n = rng.randrange(17, 70)
            spec = Spec(request_id, step, (0,) * n, embeds=rng.randrange(3, 6))
        else:
            text = rng.choice(systems) if rng.random() < 0.7 else ()
            images: list[tuple[str, int]] = []
            at = len(text)
            for _ in range(rng.choice((0, 1, 1, 2)) if kind < 0.8 else 0):
                at += rng.randrange(0, 20)
                identifier = rng.choice(sorted(IMAGES))
                images.append((identifier, at))
                at += IMAGES[identifier]
            n = at + rng.randrange(1, 60)
            prompt = _with_images(text + _tokens(rng.randrange(1 << 30), n - len(text)), images)
            adapter = rng.choice((None, None, *ADAPTERS))
            salt = rng.choice(("x", "y")) if rng.random() < 0.15 else None
            spec = Spec(request_id, step, prompt, tuple(images), adapter, salt)
        specs.append(
            dataclasses.replace(
                spec, max_tokens=max_tokens, priority=priority, abort_after=abort_after
            )
        )
    return specs


def make_workload(cfg: RunConfig) -> Workload:
    """The scripted opening and ``cfg.num_requests`` seeded requests, as the check's arrivals
    (fresh feature, adapter and embedding objects on every call: one per run), and one reset."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}

    def arrival(spec: Spec) -> Arrival:
        kwargs: dict[str, Any] = {}
        if spec.images:
            kwargs["mm_features"] = [
                MultiModalFeatureSpec(
                    data=MultiModalKwargsItem.dummy(),
                    mm_position=PlaceholderRange(offset=offset, length=IMAGES[identifier]),
                    identifier=identifier,
                    modality="image",
                )
                for identifier, offset in spec.images
            ]
        if spec.adapter is not None:
            name = f"adapter-{spec.adapter}"
            kwargs["lora_request"] = LoRARequest(name, ids[spec.adapter], f"/adapters/{name}")
        if spec.embeds is not None:
            n = len(spec.prompt)
            embeds = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) + spec.embeds
            kwargs.update(prompt_token_ids=None, prompt_embeds=embeds)
        return Arrival(
            spec.step,
            spec.request_id,
            list(spec.prompt),
            spec.max_tokens,
            spec.priority,
            spec.salt,
            spec.abort_after,
            request_kwargs=kwargs,
        )

    specs = [*ANCHORS, *_random_specs(cfg)]
    reset = random.Random(cfg.seed + 2).randrange(FIRST_RANDOM_STEP + 20, FIRST_RANDOM_STEP + 60)
    return Workload([arrival(spec) for spec in specs], {reset})


def configs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[RunConfig]:
    """The runs ``vllm-check --workload multimodal`` asks for: layouts ``LAYOUTS`` and runs
    ``RUNS`` unless given, a pool of ``NUM_BLOCKS`` unless ``--num-blocks``."""
    if args.model is not None:
        parser.error("argument --workload multimodal: takes --layout, not --model")
    base = RunConfig(
        seed=args.seed,
        num_requests=args.requests,
        num_blocks=args.num_blocks or NUM_BLOCKS,
        workload="multimodal",
    )
    return [
        dataclasses.replace(base, layout=layout, run=run, defaults=defaults)
        for layout in args.layout or LAYOUTS
        for run in args.run or RUNS
        for defaults in args.defaults or DEFAULTS
    ]


def lora_config() -> Any:
    """The scheduler's LoRA config: ``MAX_LORAS`` adapters a step."""
    from vllm.config import LoRAConfig

    return LoRAConfig(max_loras=MAX_LORAS)


def equip(scheduler: Any) -> None:
    """An encoder budget and an encoder cache for the text model's scheduler, as vLLM's own
    scheduler tests give one."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    scheduler.max_num_encoder_input_tokens = ENCODER_BUDGET
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=ENCODER_CACHE)


# --- What a run shows --------------------------------------------------------------------------


def encoder_steps(records: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, list[int]]]]:
    """Per request, ``(step, encoder input indices)`` of every step that scheduled some."""
    steps: dict[str, list[tuple[int, list[int]]]] = {}
    for record in records:
        for request_id, inputs in record["encoder"]:
            steps.setdefault(request_id, []).append((record["step"], list(inputs)))
    return steps


def hits(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Per request, the prefix-cache hit tokens of its first prefill (the engine's
    ``num_cached_tokens``)."""
    found: dict[str, int] = {}
    for record in records:
        for request_id, _, _, prefill in record["outputs"]:
            if prefill is not None:
                found.setdefault(request_id, prefill[0])
    return found


def summarize(records: Sequence[dict[str, Any]]) -> str:
    """The encoder inputs scheduled, the events with a LoRA adapter or image keys, and the
    hits of the scripted requests sent again."""
    inputs = sum(len(v) for r in records for _, v in r["encoder"])
    stored = [e[1] for r in records for e in r["events"] if e[0] == "BlockStored"]
    lora = sum(1 for e in stored if e.get("lora_name"))
    keyed = sum(1 for e in stored if e.get("extra_keys"))
    found = hits(records)
    again = " ".join(
        f"{s.request_id}={found.get(s.request_id)}" for s in ANCHORS if "." in s.request_id
    )
    return (
        f"{inputs} encoder inputs scheduled, {lora} stored events with a LoRA adapter, "
        f"{keyed} with extra keys; hits {again}"
    )
