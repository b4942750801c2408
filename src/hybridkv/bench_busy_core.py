"""``--busy-core``: a separate process spinning on one core while the benchmark measures
(``BusyCore``), to see the backends under a loaded machine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import warnings


def _spin(parent: int) -> None:
    """Keep a core busy until stopped or until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while os.getppid() == parent:
        for _ in range(200_000):
            pass


class BusyCore:
    """A context manager: a separate process spins on one core while it is open, and is
    stopped on leaving (on an exception or Ctrl-C too; it also exits when its parent dies)."""

    def __init__(self) -> None:
        self.process: multiprocessing.process.BaseProcess | None = None

    def __enter__(self) -> BusyCore:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.process is not None:
            return
        # fork: the child only spins, so the parent's threads do not matter to it.
        fork = "fork" in multiprocessing.get_all_start_methods()
        context = (
            multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            process = context.Process(
                target=_spin, args=(os.getpid(),), name="hybridkv-busy-core", daemon=True
            )
            process.start()
        self.process = process

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
