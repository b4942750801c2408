"""What the cost model needs from a model: its active parameters and its attended KV bytes.

A step's fixed cost and its cost per prefill token follow from the parameters a token passes
through (a mixture-of-experts model's *active* ones, not its total); its cost per attended
token from the KV bytes one token holds in the layers that attend, and how far each layer
looks back (a sliding window or an attention chunk caps it, full attention does not).

The active-parameter counts are the ones the model cards publish (Hugging Face model pages
and their technical reports), keyed by the catalogue's names.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.spec import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

ACTIVE_PARAMETERS: dict[str, float] = {
    "meta-llama/Llama-3.1-8B": 8.0e9,  # model card: 8B dense
    "google/gemma-2-9b": 9.24e9,  # model card: 9B (9.24B parameters)
    "google/gemma-2-27b": 27.2e9,  # model card: 27B
    "google/gemma-3-1b-it": 1.0e9,  # Gemma 3 technical report, table 1: 1B
    "google/gemma-3-4b-it": 4.3e9,  # Gemma 3 technical report: 4B (4.3B with vision)
    "google/gemma-3-12b-it": 12.2e9,  # Gemma 3 technical report: 12B
    "google/gemma-3-27b-it": 27.4e9,  # Gemma 3 technical report: 27B
    "google/gemma-3n-E4B-it": 4.0e9,  # model card: 4B effective of 8B raw
    "openai/gpt-oss-20b": 3.6e9,  # model card: 3.6B active of 21B
    "openai/gpt-oss-120b": 5.1e9,  # model card: 5.1B active of 117B
    "meta-llama/Llama-4-Scout-17B-16E": 17e9,  # model card: 17B active of 109B
    "meta-llama/Llama-4-Maverick-17B-128E": 17e9,  # model card: 17B active of 400B
    "mistralai/Ministral-8B-Instruct-2410": 8.0e9,  # model card: 8B dense
    "CohereForAI/c4ai-command-r7b-12-2024": 7e9,  # model card: 7B
    "CohereForAI/c4ai-command-a-03-2025": 111e9,  # model card: 111B
    "ai21labs/Jamba-v0.1": 12e9,  # model card: 12B active of 52B
    "ai21labs/AI21-Jamba-1.5-Mini": 12e9,  # model card: 12B active of 52B
    "ibm-ai-platform/Bamba-9B": 9e9,  # model card: 9B dense
    "ibm-granite/granite-4.0-h-tiny": 1e9,  # model card: 1B active of 7B
    "ibm-granite/granite-4.0-h-small": 9e9,  # model card: 9B active of 32B
    "MiniMaxAI/MiniMax-Text-01": 45.9e9,  # model card: 45.9B active of 456B
    "Qwen/Qwen3-Next-80B-A3B-Instruct": 3e9,  # model card: 3B active of 80B
    "nvidia/Nemotron-H-8B-Base-8K": 8e9,  # model card: 8B
    "tiiuae/Falcon-H1-7B-Instruct": 7e9,  # model card: 7B
    "deepseek-ai/DeepSeek-V3": 37e9,  # model card: 37B active of 671B
}
"""Published active parameters per catalogue model (total parameters for dense models)."""


def active_parameters(model: str) -> float | None:
    """The model's published active parameters, or ``None`` for a model not in the table."""
    return ACTIVE_PARAMETERS.get(model)


AttentionMix = tuple[tuple[float, int | None], ...]


def attended_kv(groups: Iterable[tuple[KVCacheSpec, int]]) -> tuple[float, AttentionMix]:
    """KV bytes per attended token, all layers, and each attention kind's share of them with
    its look-back (``None`` for full attention), from ``(spec, layers holding KV)`` per group.

    A Mamba group reads a fixed state, not its context: it adds no attended bytes. A model of
    Mamba groups only gets ``(0.0, ((1.0, None),))``: no context cost at all.
    """
    per_window: dict[int | None, float] = {}
    for spec, layers in groups:
        if isinstance(spec, MambaSpec):
            continue
        window: int | None = None
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            window = spec.attention_chunk_size
        bytes_per_token = spec.page_size_bytes / spec.block_size * layers
        per_window[window] = per_window.get(window, 0.0) + bytes_per_token
    total = sum(per_window.values())
    if not total:
        return 0.0, ((1.0, None),)
    mix = tuple((value / total, window) for window, value in per_window.items())
    return total, mix
