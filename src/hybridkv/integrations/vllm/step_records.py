"""What the step-by-step checks (``check``, ``connector_check``) record of one scheduler step,
and the fake model's reply to it.

Two runs of vLLM's scheduler, one over vLLM's manager and one over a hybridkv backend, are
equal when every step's record is: the tokens scheduled per request, the block ids handed to
the worker per group, preemptions, finishes, blocks to zero, speculative and encoder inputs
(``output_record``), the manager's KV events (``event_record``, as plain builtins) and its
prefix-cache statistics (``stats_record``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.integrations.vllm.run_config import VOCAB


def event_record(event: Any) -> Any:
    """A KV event as its class name and its fields in builtins (comparable across managers)."""
    import msgspec

    return (type(event).__name__, msgspec.to_builtins(event))


def recording(take: Callable[[], Any], log: list[Any]) -> Callable[[], list[Any]]:
    """``take`` (a ``take_events``), every event it returns noted in ``log``."""

    def recording_take() -> list[Any]:
        taken = list(take() or ())
        log.extend(event_record(e) for e in taken)
        return taken

    return recording_take


def stats_record(stats: Any) -> Any:
    """The prefix-cache statistics a manager made for a step (``None`` without ``log_stats``)."""
    if stats is None:
        return None
    return (
        stats.requests,
        stats.queries,
        stats.hits,
        stats.preempted_requests,
        stats.preempted_queries,
        stats.preempted_hits,
        stats.reset,
    )


def output_record(output: Any) -> dict[str, Any]:
    """A ``SchedulerOutput`` as what the worker reads of it: tokens per request, each new and
    running request's block ids per group, draft tokens, preemptions, finishes, blocks to
    zero, encoder inputs and the encoder outputs to free."""
    cached = output.scheduled_cached_reqs
    return {
        "scheduled": sorted(output.num_scheduled_tokens.items()),
        "new": [
            (r.req_id, r.num_computed_tokens, [list(g) for g in r.block_ids])
            for r in output.scheduled_new_reqs
        ],
        "cached": [
            (
                req_id,
                cached.num_computed_tokens[i],
                None
                if cached.new_block_ids[i] is None
                else [list(g) for g in cached.new_block_ids[i]],
                req_id in cached.resumed_req_ids,
            )
            for i, req_id in enumerate(cached.req_ids)
        ],
        "spec": sorted((k, list(v)) for k, v in output.scheduled_spec_decode_tokens.items()),
        "preempted": sorted(output.preempted_req_ids or ()),
        "finished": sorted(output.finished_req_ids),
        "zero": getattr(output, "new_block_ids_to_zero", None),
        "encoder": sorted((r, list(v)) for r, v in output.scheduled_encoder_inputs.items()),
        "free_encoder": sorted(output.free_encoder_mm_hashes),
    }


def sampled_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position`` of a request: a function of the two alone, so the
    same on every manager and in every step order."""
    value = 0
    for ch in f"{request_id}:{position}":
        value = (value * 131 + ord(ch)) % 1_000_003
    return value % VOCAB


def runner_output(req_ids: list[str], sampled: list[list[int]], **extra: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` of a step: ``sampled[i]`` the tokens of ``req_ids[i]``
    (empty for a prefill chunk that does not end the prompt); ``extra``, e.g. a connector's
    ``kv_connector_output``."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **extra,
    )


def engine_output_record(out: Any) -> Any:
    """One request's ``EngineCoreOutput`` of a step: its new tokens, finish reason and, at its
    first token, how many prompt tokens came from the prefix cache, locally or through a KV
    connector, and how many were computed."""
    prefill = out.prefill_stats
    return (
        out.request_id,
        list(out.new_token_ids),
        None if out.finish_reason is None else int(out.finish_reason),
        None
        if prefill is None
        else (
            prefill.num_cached_tokens,
            prefill.num_local_cached_tokens,
            prefill.num_external_cached_tokens,
            prefill.num_cache_creation_tokens,
        ),
    )
