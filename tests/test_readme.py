"""The README's quick start runs, and `.ci/run` runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_quick_start_runs() -> None:
    code = README.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["num_hit_tokens"] == 0


def test_the_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    commands = re.findall(r"```sh\n(.*?)\n```", README, flags=re.DOTALL)
    assert len(commands) == 2
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert ci_lines[-1] == commands[1]
