"""``hybridkv simulate --eviction``: either backend under the policy named, the same numbers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from hybridkv.__main__ import main

ARGS = ("gpt-oss-20b", "--requests", "12", "--memory", "256MiB", "--workload", "agent")


def _numbers(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["simulate", *ARGS, *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    numbers: dict[str, Any] = json.loads(result.output)
    return {k: v for k, v in numbers.items() if not k.startswith("manager_") and k != "backend"}


@pytest.mark.parametrize("policy", ["hybrid", "arc", "test_eviction_seam:NewestFirst"])
def test_a_policy_gives_the_same_numbers_on_both_backends(policy: str) -> None:
    pytest.importorskip("torch")
    reference = _numbers("--eviction", policy)
    assert reference == _numbers("--eviction", policy, "--backend", "optimized")
    assert reference["finished"] == 12
    assert reference["hit_tokens"] > 0


def test_an_unknown_policy_is_refused_by_name() -> None:
    result = CliRunner().invoke(main, ["simulate", "--eviction", "fifo"])
    assert result.exit_code != 0
    assert "eviction_policy 'fifo' is not a policy name" in result.output
