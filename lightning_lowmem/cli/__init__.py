"""The ``lowmem`` command: LightningCLI's ``fit|validate|test|predict`` plus ``estimate`` and ``demo``.

Examples::

    lowmem fit --config examples/configs/pruning.yaml
    lowmem estimate --config examples/configs/full_stack.yaml --budget 8GiB
    lowmem demo --quick

A mistake in a config (an unknown class path or argument, a value a constructor rejects) is reported as
one ``error:`` line on stderr with exit code 2; ``LOWMEM_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from lightning_lowmem.cli.errors import ConfigError, did_you_mean
from lightning_lowmem.cli.estimate import estimate_main, parse_batch_shape
from lightning_lowmem._quiet import quiet_startup_logs
from lightning_lowmem.cli.runner import LIGHTNING_SUBCOMMANDS, print_error

__all__ = ["console", "main", "parse_batch_shape", "quiet_startup_logs"]

SUBCOMMANDS = {
    "fit": "train a model: --config x.yaml, or --model / --data / --trainer.* options (LightningCLI)",
    "validate": "run the validation loop once (LightningCLI)",
    "test": "run the test loop once (LightningCLI)",
    "predict": "run prediction (LightningCLI)",
    "estimate": "predict a training step's peak memory without allocating it; --budget plans a mix that fits",
    "demo": "baseline vs the low-memory stack on the embedded workloads (--quick: about one minute)",
}
OVERVIEW = """usage: lowmem {fit,validate,test,predict,estimate,demo} [options]

Memory-saving training for PyTorch Lightning: LightningCLI plus `estimate` and `demo`.

subcommands:
%s

Run `lowmem <subcommand> --help` for its options. Examples:
  lowmem fit --config examples/configs/full_stack.yaml
  lowmem estimate --config examples/configs/full_stack.yaml --budget 8GiB
  lowmem demo --quick"""


# ----------------------------------------------------------------------------- entry point
def console() -> None:
    """The ``lowmem`` console script and ``python -m lightning_lowmem.cli``: :func:`main`, then the process ends.

    After ``estimate`` the process ends without tearing the interpreter down: its output flushed, it has nothing
    else to finish, and freeing the planner's few hundred thousand fake-tensor objects one by one took about a
    second of the 8B question's answer. Every other subcommand (training: loggers, checkpoints) exits as usual.
    """
    code = main()
    if sys.argv[1:2] == ["estimate"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowmem`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_startup_logs()
    # Lightning 2.6 on torch >= 2.13 warns about its own use of torch's pytree on every fit
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    if not argv or argv[0] in ("-h", "--help"):
        print(OVERVIEW % "\n".join(f"  {name:<9} {text}" for name, text in SUBCOMMANDS.items()))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lightning_lowmem import __version__

        print(f"lowmem (lightning_lowmem) {__version__}")
        return 0
    command = argv[0]
    if command == "estimate":
        return estimate_main(argv[1:])
    if command == "demo":
        from lightning_lowmem.demo.run import main as demo_main

        return demo_main(argv[1:])
    if not command.startswith("-") and command not in LIGHTNING_SUBCOMMANDS:
        print_error(
            f"unknown subcommand {command!r}{did_you_mean(command, SUBCOMMANDS)}; choose one of {', '.join(SUBCOMMANDS)}",
            "see `lowmem --help`",
        )
        return 2
    try:
        from lightning_lowmem.cli.lowmem_cli import lightning_cli

        lightning_cli(argv)
    except ConfigError as err:
        sub = command if command in LIGHTNING_SUBCOMMANDS else "fit"
        print_error(str(err), err.hint or f"see `lowmem {sub} --help`; LOWMEM_DEBUG=1 shows the full error")
        return 2
    return 0
