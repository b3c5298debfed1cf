"""``python -m lightning_lowmem.cli``: the ``lowmem`` command (for ``torchrun``, SLURM scripts and subprocesses)."""

from lightning_lowmem.cli import console

console()
