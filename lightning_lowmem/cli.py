"""The ``lowmem`` command: LightningCLI's ``fit|validate|test|predict`` plus ``estimate`` and ``demo``.

Examples::

    lowmem fit --config examples/configs/pruning.yaml
    lowmem estimate --config examples/configs/pruning.yaml --budget 8GiB
    lowmem demo --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

import torch

ESTIMATE_USAGE = """usage: lowmem estimate [--budget SIZE] [--device {cuda,cpu}] [--json] [--real-weights]
                       [--fine-tune] (--config CONFIG.yaml | --model CLASS_PATH [--data CLASS_PATH]) [...]

Predict the peak memory of one training step without allocating it, and (with --budget) plan the
cheapest technique mix that fits. Takes the same model / data / trainer options as `lowmem fit`."""


def _lightning_cli(args: list[str] | None, run: bool = True, meta_model: bool = False) -> Any:
    from lightning.pytorch.cli import LightningCLI

    class LowMemCLI(LightningCLI):
        def instantiate_classes(self) -> None:  # noqa: D102 - see LightningCLI
            if not meta_model:
                return super().instantiate_classes()
            try:  # build the model without allocating its weights; data is read later, outside
                with torch.device("meta"):
                    return super().instantiate_classes()
            except Exception:  # noqa: BLE001 - some modules cannot be built on meta: build them for real
                return super().instantiate_classes()

    return LowMemCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def _first_batch(datamodule: Any) -> Any:
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def estimate_main(argv: list[str]) -> int:
    """``lowmem estimate``: Rich table of candidates and the chosen plan (``--json`` for machines)."""
    parser = argparse.ArgumentParser(prog="lowmem estimate", usage=ESTIMATE_USAGE, add_help=False)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--real-weights", action="store_true")
    parser.add_argument("--fine-tune", action="store_true", help="add LoRA / QLoRA candidates")
    parser.add_argument("-h", "--help", action="store_true")
    own, rest = parser.parse_known_args(argv)
    if own.help:
        print(ESTIMATE_USAGE)
        return 0
    if not any(a.startswith(("--config", "--model", "-c")) for a in rest):
        print(
            "lowmem estimate needs a model: give the same YAML as `lowmem fit` (--config path.yaml) or a "
            "model class, e.g.\n  lowmem estimate --model lightning_lowmem.demo.CharLM --data "
            "lightning_lowmem.demo.CharLMDataModule --budget 8GiB",
            file=sys.stderr,
        )
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = _lightning_cli(rest, run=False, meta_model=not own.real_weights)
    if cli.datamodule is None:
        print("lowmem estimate needs data to take a batch from: add --data CLASS_PATH or a `data:` section.", file=sys.stderr)
        return 2
    batch = _first_batch(cli.datamodule)
    precision = str(cli.config.get("trainer", {}).get("precision") or "32-true")
    precision = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(precision, precision)
    from rich.console import Console

    from lightning_lowmem.memory import format_bytes
    from lightning_lowmem.memory.estimate import estimate_memory
    from lightning_lowmem.memory.plan import plan_memory

    console = Console()
    if own.budget is None:
        report = estimate_memory(cli.model, batch, precision=precision, device=own.device)
        if own.json:
            print(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            console.print(report.to_table(title=f"Estimated training step ({precision}, {own.device})"))
        return 0
    loras = [None, {"r": 8}, {"r": 8, "quantize_base": "int8"}] if own.fine_tune else None
    try:
        plan = plan_memory(cli.model, batch, own.budget, precision=precision, device=own.device, loras=loras)
    except ValueError as err:
        if own.json:
            print(json.dumps({"error": str(err)}))
        else:
            console.print(str(err), style="bold red", markup=False)
        return 1
    if own.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        console.print(plan.to_table())
        console.print(
            f"chosen: [bold]{plan.config.describe()}[/bold] -> predicted peak "
            f"{format_bytes(plan.predicted_peak_bytes)} (budget {format_bytes(plan.budget_bytes)})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowmem`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "estimate":
        return estimate_main(argv[1:])
    if argv and argv[0] == "demo":
        from lightning_lowmem.demo.run import main as demo_main

        return demo_main(argv[1:])
    if not argv:
        print(__doc__.strip())
        print("\nSubcommands: fit, validate, test, predict (LightningCLI), estimate, demo. Use `lowmem fit --help`.")
        return 2
    _lightning_cli(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
