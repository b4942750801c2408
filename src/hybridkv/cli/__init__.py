"""The ``hybridkv`` command: ``plan``, ``policies``, ``simulate``, ``replay``, ``models``,
``conformance``, ``bench``, ``vllm-check``.

Built on click; tables, the layout picture and progress bars come from rich. Each subcommand
imports what it needs when it runs.
"""

from __future__ import annotations

import click

from hybridkv import __version__
from hybridkv.cli.forward import bench, conformance, vllm_check
from hybridkv.cli.plan_cmd import models, plan
from hybridkv.cli.policies_cmd import policies
from hybridkv.cli.replay_cmd import replay
from hybridkv.cli.simulate_cmd import simulate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hybridkv")
def main() -> None:
    """Plan a hybrid model's KV cache, replay workloads through the manager, run the suite.

    Start with `hybridkv plan`: Gemma-3-27B in 40 GiB at 128K tokens.
    """


for _command in (plan, policies, simulate, replay, models, conformance, bench, vllm_check):
    main.add_command(_command)

__all__ = ["main"]
