"""``hybridkv`` and ``python -m hybridkv``: plan KV caches, replay workloads, run the suite.

``main`` is the click command group itself, so tests drive the real entry point with click's
``CliRunner``. Everything heavy (rich, the planner, the manager) is imported by the subcommand
that needs it, which keeps ``hybridkv plan`` fast.
"""

from hybridkv.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main(prog_name="hybridkv")
