"""The scheduler loop, the workloads and traces, and ``hybridkv simulate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.reference import KVCacheManager
from hybridkv.reference.planner import plan_kv_cache
from hybridkv.simulate import (
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SimulationResult,
    TraceError,
    load_trace,
    make_workload,
)
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec

TINY = {"layers.0": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=1)}
"""One layer, 4-token blocks of 8 bytes: a pool small enough to reason about by hand."""


def simulate(
    requests: list[RequestSpec], num_blocks: int, *, batched: int = 16
) -> SimulationResult:
    config = plan_kv_cache(TINY, num_blocks * 8)
    manager = KVCacheManager(config, max_model_len=64)
    limits = SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=4, max_model_len=64)
    return Scheduler(manager, requests, block_size=4, config=limits).run()


def test_a_shared_prompt_hits_the_cache_and_requests_finish() -> None:
    """Step 0 admits A (8 tokens) and B (same prompt): B hits one block (its hit stops at 7
    tokens, whole blocks: 4) and computes 4. Step 1 decodes both; each has its 2 tokens."""
    prompt = tuple(range(1, 9))
    requests = [RequestSpec("A", prompt, (90, 91)), RequestSpec("B", prompt, (92, 93))]
    result = simulate(requests, num_blocks=11)
    assert result.summary(timing=False) == {
        "requests": 2, "finished": 2, "rejected": 0, "steps": 2, "preemptions": 0,
        "prompt_tokens": 16, "hit_tokens": 4, "hit_rate": 0.25, "computed_tokens": 14,
        "saved_tokens": 4, "peak_usage": 0.3, "mean_usage": 0.15,
    }  # fmt: skip
    assert result.usage_per_step == pytest.approx([0.3, 0.0])


def test_a_full_pool_preempts_the_latest_request_and_everything_still_finishes() -> None:
    requests = [
        RequestSpec("A", tuple(range(1, 9)), tuple(range(100, 106))),
        RequestSpec("B", tuple(range(11, 19)), tuple(range(200, 206))),
    ]
    result = simulate(requests, num_blocks=5)
    assert result.preemptions >= 1
    assert (result.num_finished, result.num_rejected) == (2, 0)
    assert result.peak_usage == 1.0


def test_a_request_larger_than_the_pool_is_rejected_not_retried_forever() -> None:
    """Chunks of 4 tokens fit until the third; alone, it would preempt itself for ever."""
    result = simulate([RequestSpec("big", tuple(range(16)), (1, 2))], num_blocks=3, batched=4)
    assert (result.num_finished, result.num_rejected) == (0, 1)
    assert result.preemptions == 1


def test_a_follow_up_turn_arrives_after_its_parent_finishes() -> None:
    first = RequestSpec("chat.0", tuple(range(1, 9)), (50, 51))
    second = RequestSpec(
        "chat.1", (*range(1, 9), 50, 51, 7, 7), (52,), arrival_step=3, parent="chat.0"
    )
    result = simulate([first, second], num_blocks=11)
    assert result.num_finished == 2
    assert result.hit_tokens == 8  # the first turn's two full blocks


@pytest.mark.parametrize("kind", ["chat", "rag", "agent", "mixed"])
def test_workloads_are_seeded_and_fit_the_model(kind: str) -> None:
    first = make_workload(kind, 30, seed=7, max_model_len=8192)
    assert first == make_workload(kind, 30, seed=7, max_model_len=8192)
    assert first != make_workload(kind, 30, seed=8, max_model_len=8192)
    assert len(first) == 30
    assert all(len(r.prompt_token_ids) + len(r.output_token_ids) <= 8192 for r in first)


def test_chat_turns_extend_their_parents_context() -> None:
    requests = {r.request_id: r for r in make_workload("chat", 40, seed=1, max_model_len=16384)}
    children = [r for r in requests.values() if r.parent is not None]
    assert children
    for child in children:
        parent = requests[child.parent or ""]
        context = parent.prompt_token_ids + parent.output_token_ids
        assert child.prompt_token_ids[: len(context)] == context


def test_rag_questions_share_documents() -> None:
    requests = make_workload("rag", 20, seed=0, max_model_len=16384)
    prefixes = {r.prompt_token_ids[:512] for r in requests}
    assert len(prefixes) < len(requests)


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("batch", 3, seed=0, max_model_len=1024)


# --- traces -----------------------------------------------------------------------------------


def write_trace(path: Path, *lines: dict[str, Any]) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_trace_lines_with_one_prefix_id_share_their_prefix(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        {"prompt_len": 40, "prefix_id": "sys", "prefix_len": 32, "output_len": 4},
        {"id": "q", "prompt_len": 50, "prefix_id": "sys", "prefix_len": 32, "output_len": 2,
         "arrival_step": 5},
        {"prompt_token_ids": [1, 2, 3], "output_len": 1, "arrival_step": 2},
    )  # fmt: skip
    a, c, b = load_trace(path, seed=0, max_model_len=1024).requests
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32]
    assert a.prompt_token_ids[32:] != b.prompt_token_ids[32:40]
    assert (len(a.prompt_token_ids), len(b.prompt_token_ids)) == (40, 50)
    assert (b.request_id, b.arrival_step, len(b.output_token_ids)) == ("q", 5, 2)
    assert c.prompt_token_ids == (1, 2, 3)
    assert load_trace(path, seed=0, max_model_len=1024).requests == (a, c, b)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt_len": 8}, "trace line 1: 'output_len' must be a positive int"),
        ({"output_len": 2}, "'prompt_len' must be a positive int"),
        ({"prompt_len": 8, "prefix_id": "x", "prefix_len": 9, "output_len": 1}, "exceeds"),
        ({"prompt_token_ids": [1, -2], "output_len": 1}, "'prompt_token_ids' must be"),
        ({"prompt_len": 8, "output_len": 1, "arrival_step": -1}, "'arrival_step' must be"),
        (
            {"prompt_len": 1000, "output_len": 100},
            r"every request of .*t.jsonl is longer than max_model_len 1024 \(prompt \+ "
            r"output_len; lines 1\): raise --max-model-len",
        ),
        (
            {"prompt_len": 8, "output_len": 1, "arival_step": 2},
            "trace line 1: unknown key 'arival_step'; did you mean 'arrival_step'[?] a trace line "
            "has the keys id, arrival_step, prompt_token_ids, prompt_len, prefix_id, prefix_len, "
            "output_len",
        ),
        (
            {"prompt_len": 8, "prompt_token_ids": [1, 2], "output_len": 1},
            "trace line 1: 'prompt_token_ids' and 'prompt_len' both give the prompt",
        ),
        (
            {"prompt_token_ids": [1, 2], "prefix_id": "a", "prefix_len": 1, "output_len": 1},
            "trace line 1: 'prompt_token_ids' and 'prefix_id' both give the prompt",
        ),
        (
            {"prompt_len": 8, "prefix_len": 4, "output_len": 1},
            "trace line 1: 'prefix_id' and 'prefix_len' go together",
        ),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write_trace(tmp_path / "t.jsonl", line), seed=0, max_model_len=1024)


class RecordingManager(KVCacheManager):
    """The reference manager, recording each ``allocate_slots``'s request and token count."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((request.request_id, num_new_tokens))
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


def test_a_mamba_align_prefill_stops_at_the_last_block_boundary_before_the_prompt_end() -> None:
    """Prefix caching, Case 3: a state is cached only where a chunk ends on a Mamba block
    boundary, so the 55-token prompt is computed as 48 + 7 (one 55-token chunk would cache no
    state); the resend then hits those 48 tokens, and the scheduler calls ``new_step_starts``
    every step (the state cached in step 0 is adopted in a later step)."""
    kv = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 1}
    config = KVCacheConfig(
        64,
        (
            KVCacheGroup(("attn",), FullAttentionSpec(block_size=16, **kv)),
            KVCacheGroup(
                ("ssm",), MambaSpec(block_size=16, state_bytes=32, mamba_cache_mode="align")
            ),
        ),
    )
    manager = RecordingManager(config, max_model_len=128)
    prompt = tuple(range(1, 56))
    requests = [RequestSpec("A", prompt, (90,)), RequestSpec("B", prompt, (91,), arrival_step=3)]
    limits = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)
    result = Scheduler(manager, requests, block_size=16, config=limits, mamba_block_size=16).run()
    assert manager.calls[:2] == [("A", 48), ("A", 7)]
    assert result.hit_tokens == 48
    assert result.num_finished == 2


def test_a_trace_line_longer_than_max_model_len_is_skipped_and_counted(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        {"prompt_len": 8, "output_len": 1},
        {"prompt_len": 1000, "output_len": 100},
        {"prompt_len": 16, "output_len": 2},
    )
    trace = load_trace(path, seed=0, max_model_len=1024)
    assert [request.request_id for request in trace.requests] == ["t1", "t3"]
    assert trace.too_long == (2,)
