"""Spawned multi-process fits in the tests (gloo on CPU).

A known exit-time abort: about one spawned 2-rank fit in five, under a loaded machine, has a rank abort while its
interpreter exits, after the fit returned ("terminate called without an active exception": a C++ thread still
joinable in a destructor). It was seen in the FSDP, DDP-pruning and DDP-distillation tests, never alone on an idle
machine (12 of 12 runs passed), and destroying the process group first did not help. Two guards: the tests whose
results are saved files tolerate it here (:func:`fit_saving_results`), and ``make test`` reruns a test once when,
and only when, it failed with ``terminated with signal SIGABRT`` (pytest-rerunfailures, the Makefile's
``RERUN_ABORTED_RANKS``): the rerun must pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch


def fit_saving_results(fit: Callable[[], object], saved: Iterable[Path]) -> None:
    """Run ``fit``; a rank's SIGABRT at interpreter exit *after* every rank saved its results is tolerated.

    Known, not yet understood (seen since 2026-12-05 in about one run of five of a spawned 2-rank fit): a rank aborts
    while its interpreter exits ("terminate called without an active exception": a C++ thread still joinable in a
    destructor); destroying the process group first did not help. What these tests check is in the saved results;
    an abort before they were written, or any other failure, still fails.
    """
    try:
        fit()
    except torch.multiprocessing.ProcessExitedException as err:
        if err.signal_name != "SIGABRT" or not all(Path(path).exists() for path in saved):
            raise
