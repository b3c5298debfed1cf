"""`lightning_lowmem.checkpoints`: provenance records and their check; the docstring examples of the modules
that make checkpoints trustworthy run."""

from __future__ import annotations


import pytest

from lightning_lowmem.checkpoints import CheckpointMismatchError, check, record, records


def test_record_and_check():
    checkpoint: dict = {}
    record(checkpoint, writer="Opt", format="adamw8bit", needs="callbacks=[Opt('adamw8bit')]", needed_for=["fit"])
    record(checkpoint, writer="Lora", format="adapters-only", version=2, r=4)
    assert records(checkpoint)["Lora"] == {"format": "adapters-only", "version": 2, "needs": "Lora", "r": 4}
    check(checkpoint, {"Opt": None, "Lora": None})
    check(checkpoint, {"Lora": None}, stage="validate")  # the optimizer record matters to fit only
    with pytest.raises(
        CheckpointMismatchError,
        match=r"written with Opt \(format 'adamw8bit', version 1\), which the "
        r"loading side lacks: add callbacks=\[Opt\('adamw8bit'\)\]\.",
    ):
        check(checkpoint, {"Lora": None}, stage="fit")
    with pytest.raises(
        CheckpointMismatchError, match=r"written with Lora \(format 'adapters-only', version 2\): too new"
    ):
        check(checkpoint, {"Opt": None, "Lora": lambda entry: "too new" if entry["version"] > 1 else None})
    check({}, {})  # a checkpoint without records: nothing to check
    with pytest.raises(TypeError, match=r"`format` must be a non-empty string, got ''"):
        record(checkpoint, writer="X", format="")
