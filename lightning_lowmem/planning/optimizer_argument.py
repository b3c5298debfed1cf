"""The ``optimizer=`` argument of :func:`~lightning_lowmem.planning.estimate.estimate_memory` and
:func:`~lightning_lowmem.planning.plan.plan_memory`, as one :class:`~lightning_lowmem.functional.config.OptimizerConfig`.

``optimizer`` is an ``OptimizerConfig`` (a name and its hyperparameters, validated when it is built), a name
(``OptimizerConfig(name)``), or ``None``: the optimizer the module's ``configure_optimizers`` returns, read from a
fake copy of the module (its name and arguments, :func:`configured_optimizer_config`), else AdamW.

``optimizer_kwargs`` is the flat shorthand, turned into the config here (nothing validates it but
``OptimizerConfig``):

* beside a name, the config's hyperparameters -- deprecated (a ``DeprecationWarning``):
  ``optimizer=OptimizerConfig(name, **hyperparameters)`` says the same in one argument;
* beside ``None``, arguments that replace the configured optimizer's own (e.g. ``{"lr": 0.1}``): no config can
  say this, since the name is the module's, so it is not deprecated.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning._fake_step import configured_optimizer

__all__ = ["configured_optimizer_config", "optimizer_config"]


def optimizer_config(
    optimizer: str | OptimizerConfig | None, optimizer_kwargs: Mapping[str, Any] | None = None, *, stacklevel: int = 3
) -> OptimizerConfig | None:
    """``optimizer`` (with the shorthand ``optimizer_kwargs``) as a config; ``None`` stays ``None`` ("as configured").

    Args:
        optimizer: an :class:`OptimizerConfig`, an optimizer name, or ``None``.
        optimizer_kwargs: beside a name, its hyperparameters (deprecated); beside ``None``, ignored here (they are
            the configured optimizer's, see :func:`configured_optimizer_config`). Default: none.
        stacklevel: of the ``DeprecationWarning``, so that it points at the user's call. Default: 3.

    Raises:
        TypeError: ``optimizer`` is none of these, ``optimizer_kwargs`` is not a mapping.
        ValueError: ``optimizer_kwargs`` beside an ``OptimizerConfig`` (give them once); from ``OptimizerConfig``:
            an unknown name or argument, a value the optimizer refuses.

    Example::

        >>> optimizer_config("sgd")
        OptimizerConfig(name='sgd', hyperparameters=())
        >>> optimizer_config(OptimizerConfig("sgd", momentum=0.9)).kwargs
        {'momentum': 0.9}
    """
    if optimizer is not None and not isinstance(optimizer, (str, OptimizerConfig)):
        raise TypeError(
            f"`optimizer` must be an OptimizerConfig, an optimizer name or None, got {type(optimizer).__name__}: "
            f"{optimizer!r}; e.g. OptimizerConfig('adamw8bit', lr=1e-3)"
        )
    _check_mapping(optimizer_kwargs)
    if optimizer is None:
        return None
    if not optimizer_kwargs:
        return optimizer if isinstance(optimizer, OptimizerConfig) else OptimizerConfig(optimizer)
    if isinstance(optimizer, OptimizerConfig):
        raise ValueError(
            f"`optimizer_kwargs`={dict(optimizer_kwargs)!r} needs `optimizer` as a name, got {optimizer!r}; "
            "give the arguments to OptimizerConfig instead"
        )
    example = ", ".join([repr(optimizer), *(f"{key}={value!r}" for key, value in optimizer_kwargs.items())])
    warnings.warn(
        f"`optimizer_kwargs` beside optimizer={optimizer!r} is deprecated: give the optimizer and its arguments as "
        f"one OptimizerConfig, optimizer=OptimizerConfig({example})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return OptimizerConfig(optimizer, optimizer_kwargs)


def configured_optimizer_config(
    module: nn.Module, overrides: Mapping[str, Any] | None = None, *, accepted_only: bool = False
) -> tuple[OptimizerConfig, bool]:
    """The optimizer ``module.configure_optimizers()`` returns, as a config, and whether it was found.

    Its name and arguments are read from a fake copy of the module
    (:func:`~lightning_lowmem.planning._fake_step.configured_optimizer`); ``overrides`` replace its arguments. With
    none the estimator knows (no ``configure_optimizers``, several optimizers, a type it cannot name): AdamW with
    ``overrides``, and ``False``.

    Args:
        module: the model (not modified).
        overrides: arguments that replace the configured ones (``optimizer_kwargs`` beside ``optimizer=None``).
            Default: none.
        accepted_only: drop the overrides the optimizer found does not take (the planner's rule: they apply to the
            optimizers that accept them) instead of refusing them. Default: ``False``.

    Raises:
        ValueError: from ``OptimizerConfig``: an override the optimizer does not take, a value it refuses.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> config, found = configured_optimizer_config(CharLM(n_layer=1, n_embd=32, block_size=8), {"lr": 0.1})
        >>> config.name, config.kwargs["lr"], found
        ('adamw', 0.1, True)
    """
    _check_mapping(overrides)
    found = configured_optimizer(module)
    name, arguments = found if found is not None else ("adamw", {})
    overrides = dict(overrides or {})
    if accepted_only:
        from lightning_lowmem.functional.optimizers.catalog import optimizer_arguments

        accepted = set(optimizer_arguments(name))
        overrides = {key: value for key, value in overrides.items() if key in accepted}
    return OptimizerConfig(name, {**arguments, **overrides}), found is not None


def _check_mapping(optimizer_kwargs: Any) -> None:
    if optimizer_kwargs is not None and not isinstance(optimizer_kwargs, Mapping):
        raise TypeError(
            f"`optimizer_kwargs`={optimizer_kwargs!r} must be a mapping of argument names to values, e.g. {{'lr': 1e-3}}"
        )
