"""`TrainingConfig`: the registered techniques' configs composed into one technique mix, with their shorthands.

What it composes is :mod:`lightning_lowmem.functional.registry`'s list, the one source: each technique's field,
its default, the shorthands it owns, its ``describe()`` label and its ``to_dict()`` keywords are registered with
its handler (the built-ins in :mod:`lightning_lowmem.functional.handlers`, the others in
:mod:`lightning_lowmem.functional.techniques`, one module each). Nothing here names a technique: a
technique registered later is composed exactly as the built-ins (``TrainingConfig(myfield=...)``,
``config.myfield``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import lightning_lowmem.functional.techniques  # noqa: F401  (registers the built-ins, then every technique module)
from lightning_lowmem.functional.registry import technique_for, techniques

__all__ = ["TrainingConfig"]


@dataclass(frozen=True, init=False, repr=False)
class TrainingConfig:
    """One technique mix: what a training step is estimated, planned and run with.

    Each registered technique is a keyword and an attribute (its ``field``): its config, or ``None`` when the
    technique is off. The constructor also takes the flat shorthands users write and turns them into those
    configs, e.g. ``precision="bf16-true"``, ``activation_checkpointing="auto"`` (with ``nested_checkpointing``),
    ``activation_compression="int8"`` (with ``compression_min_bytes``), ``optimizer="adamw8bit"`` (with
    ``optimizer_kwargs``), ``micro_batch_size=4``, ``lora={"r": 8}``, ``quantization="int8_weight_only"``,
    ``sharding="fsdp", world_size=8``, ``cross_entropy="chunked"``, ``pruning={...}``, ``qat="intx4_weight_only"``;
    :meth:`keywords` lists every field with the flat keywords it owns.

    ``precision=None`` / ``optimizer=None`` mean "as configured elsewhere" (the Trainer's precision,
    ``configure_optimizers``' optimizer): the strategies use them for what the user did not set. Their defaults
    (``"32-true"``, ``"adamw"``) are registered with them.

    Raises:
        ValueError / TypeError: from the per-technique configs; a technique given both as a field and
            as its shorthand; a keyword no registered technique owns.

    Example::

        >>> config = TrainingConfig(optimizer="adamw8bit", micro_batch_size=4, lora={"r": 8})
        >>> config.microbatch, config.lora.r
        (MicrobatchConfig(size=4), 8)
        >>> config.describe()
        '32-true + lora(r=8) + adamw8bit + mb 4'
    """

    _configs: tuple[tuple[str, Any], ...] = field(default=())  # the techniques that are on, in registration order

    def __init__(self, **arguments: Any) -> None:
        values: dict[str, Any] = {}
        for technique in techniques():
            flat = {name: arguments.pop(name) for name in technique.flat if name in arguments}
            values[technique.field] = technique.build(arguments.pop(technique.field, technique.default), **flat)
        if arguments:
            known = [name for names in self.keywords().items() for name in (names[0], *names[1])]
            unknown = min(arguments)
            close = difflib.get_close_matches(unknown, known, n=1)
            raise TypeError(
                f"TrainingConfig got an unknown argument `{unknown}`; the registered techniques take {known}"
                + (f". Did you mean {close[0]!r}?" if close else " (register_technique adds one)")
            )
        object.__setattr__(
            self, "_configs", tuple((name, value) for name, value in values.items() if value is not None)
        )

    @staticmethod
    def keywords() -> dict[str, tuple[str, ...]]:
        """Every registered technique's field, with the flat keywords its shorthand owns (registration order).

        Example::

            >>> TrainingConfig.keywords()["checkpointing"]
            ('activation_checkpointing', 'nested_checkpointing')
        """
        return {t.field: t.flat for t in techniques()}

    def __repr__(self) -> str:
        return f"TrainingConfig({', '.join(f'{name}={value!r}' for name, value in self._configs)})"

    @classmethod
    def of(cls, *configs: Any) -> "TrainingConfig":
        """The mix of these technique configs alone (``None`` skipped); precision and optimizer "as configured
        elsewhere" unless given.

        Raises:
            TypeError: an object no technique is registered for. ValueError: a technique given twice.

        Example::

            >>> from lightning_lowmem.functional.config import LoRAConfig, MicrobatchConfig
            >>> TrainingConfig.of(LoRAConfig(r=4), MicrobatchConfig(2)).describe()
            'configured precision + lora(r=4) + configured optimizer + mb 2'
        """
        given = [config for config in configs if config is not None]
        fields = [technique_for(config).field for config in given]
        repeated = sorted({field for field in fields if fields.count(field) > 1})
        if repeated:
            raise ValueError(f"the {repeated[0]!r} technique is given more than once: {given!r}; give each once")
        return cls(**{"precision": None, "optimizer": None, **dict(zip(fields, given, strict=True))})

    def __getattr__(self, name: str) -> Any:
        """A registered technique's config, or ``None`` when it is off."""
        if name.startswith("__") or name == "_configs":
            raise AttributeError(name)
        configs = dict(self.__dict__.get("_configs", ()))
        if name in configs:
            return configs[name]
        if any(t.field == name for t in techniques()):
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def configs(self) -> dict[str, Any]:
        """Every registered technique's config (``None``: off), by field, in registration order."""
        return {t.field: getattr(self, t.field) for t in techniques()}

    # read-only views in the flat vocabulary (what the shorthands set)
    @property
    def activation_checkpointing(self) -> Any:
        """The checkpointing policy, or ``None``."""
        return self.checkpointing.policy if self.checkpointing is not None else None

    @property
    def activation_compression(self) -> str | None:
        """The compression mode, or ``None``."""
        return self.compression.mode if self.compression is not None else None

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size, or ``None`` (whole batches)."""
        return self.microbatch.size if self.microbatch is not None else None

    @property
    def optimizer_name(self) -> str | None:
        return self.optimizer.name if self.optimizer is not None else None

    @property
    def precision_preset(self) -> str | None:
        return self.precision.preset if self.precision is not None else None

    def replace(self, **changes: Any) -> "TrainingConfig":
        """A copy with some fields (or shorthands) changed, e.g. ``config.replace(micro_batch_size=2)``. A
        technique changed through a flat keyword keeps its other settings (``replace(world_size=8)`` keeps
        ``sharding``'s kind)."""
        values: dict[str, Any] = {}
        for technique in techniques():
            current = getattr(self, technique.field)
            if technique.field not in changes and any(name in changes for name in technique.flat):
                values.update(technique.to_shorthand(current))
            else:
                values[technique.field] = current
        return TrainingConfig(**{**values, **changes})

    def describe(self) -> str:
        """A short human label, e.g. ``bf16-true + ckpt(auto) + int8 acts + adamw8bit + mb 4``."""
        labels = (t.label(getattr(self, t.field)) for t in techniques())
        return " + ".join(label for label in labels if label is not None)

    def to_dict(self) -> dict[str, Any]:
        """The flat shorthands (JSON-friendly); ``TrainingConfig(**config.to_dict())`` rebuilds it. Settings
        at their defaults (compression ``min_bytes``, optimizer arguments, quantization, sharding) are left out."""
        out: dict[str, Any] = {}
        for technique in techniques():
            out.update(technique.to_shorthand(getattr(self, technique.field)))
        return out
