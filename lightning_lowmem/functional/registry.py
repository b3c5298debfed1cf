"""The registry of techniques: one handler per config type (torchao's ``register_quantize_module_handler`` is
the model), and what :class:`~lightning_lowmem.functional.config.TrainingConfig` needs to compose it.

A technique is a frozen config (validated once, in ``__post_init__``) and a handler registered for the
config's type with :func:`register_technique`. :func:`lightning_lowmem.functional.apply` looks the handler up
(:func:`handler_for`) and calls it in ``order``; ``TrainingConfig`` takes the config as the keyword ``field``
(or its ``shorthand``), shows it in ``describe()`` / ``to_dict()``, and compares by it. The built-in
techniques are registered in :mod:`lightning_lowmem.functional.handlers`, the others by their own modules in
:mod:`lightning_lowmem.functional.techniques` (imported by file when the registry fills).

A handler is ``fn(module, config, applied) -> None``: it changes ``module`` in place and records how to
give it back with ``applied.on_undo(callable)`` (undone last-in, first-out; record the undo *before* the
change, so a change that fails halfway is undone too). A technique that does nothing to the module (the
optimizer, micro-batching) registers a handler that returns at once: its step-side part is its config's.

Example::

    >>> from dataclasses import dataclass
    >>> import torch
    >>> @dataclass(frozen=True)
    ... class ScaleConfig:
    ...     factor: float = 2.0
    >>> @register_technique(ScaleConfig, field="scale", order=60, label=lambda c: f"x{c.factor}")
    ... def _scale(module, config, applied):
    ...     applied.on_undo(lambda: module.weight.data.div_(config.factor))
    ...     module.weight.data.mul_(config.factor)
    >>> handler_for(ScaleConfig) is _scale, technique("scale").label(ScaleConfig(3.0))
    (True, 'x3.0')
    >>> unregister_technique(ScaleConfig)
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = [
    "Technique",
    "handler_for",
    "register_technique",
    "technique",
    "technique_for",
    "techniques",
    "unregister_technique",
]

Handler = Callable[[Any, Any, Any], None]


@dataclass(frozen=True)
class Technique:
    """One registered technique (built by :func:`register_technique`).

    Attributes:
        config_type: the config class the handler is registered for.
        field: the :class:`TrainingConfig` keyword (and attribute) holding the config.
        order: where the handler runs in :func:`apply` (smaller first).
        handler: ``fn(module, config, applied) -> None``.
        shorthand: turns what a user wrote for ``field`` (and the flat keywords it owns) into a config.
        flat: the flat keywords of ``TrainingConfig`` this technique owns (the shorthand's keyword-only
            parameters, e.g. ``micro_batch_size``).
        label: the config's part of ``TrainingConfig.describe()``, or ``None`` to leave it out.
        to_shorthand: the config's flat keywords in ``TrainingConfig.to_dict()`` (the inverse of ``shorthand``).
        step_context: ``fn(config, stats) -> context manager`` that every training step (forward and backward)
            runs in (activation compression), or ``None``.
        not_estimated: why the estimator (fake tensors) cannot run the technique, or ``None`` when it can; a
            config with it is refused by ``estimate_memory`` / ``plan_memory`` in one line saying this.
        default: what ``TrainingConfig()`` sets when the keyword is not given (``None``: off).
    """

    config_type: type
    field: str
    order: int
    handler: Handler
    shorthand: Callable[..., Any]
    flat: tuple[str, ...]
    label: Callable[[Any], str | None]
    to_shorthand: Callable[[Any], dict[str, Any]]
    step_context: Callable[[Any, Any], Any] | None = None
    not_estimated: str | None = None
    default: Any = None

    def build(self, value: Any, **flat: Any) -> Any:
        """The config for ``value`` (a config, a mapping of its arguments, a shorthand, or ``None``)."""
        value = self.shorthand(value, **flat) if self.flat else self.shorthand(value)
        if value is None or isinstance(value, self.config_type):
            return value
        if isinstance(value, Mapping):
            return self.config_type(**value)
        return self.config_type(value)


_TECHNIQUES: dict[type, Technique] = {}  # in registration order: the order of describe() and to_dict()


def _keep(value: Any) -> Any:
    return value


def _default_label(field: str) -> Callable[[Any], str | None]:
    def label(config: Any) -> str | None:
        if config is None:
            return None
        if dataclasses.is_dataclass(config):
            arguments = ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config))
            return f"{field}({arguments})"
        return f"{field}({config!r})"

    return label


def _default_to_shorthand(field: str) -> Callable[[Any], dict[str, Any]]:
    def to_shorthand(config: Any) -> dict[str, Any]:
        if config is None:
            return {}
        return {field: dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config}

    return to_shorthand


def register_technique(
    config_type: type,
    *,
    field: str,
    order: int,
    shorthand: Callable[..., Any] | None = None,
    label: Callable[[Any], str | None] | None = None,
    to_shorthand: Callable[[Any], dict[str, Any]] | None = None,
    step_context: Callable[[Any, Any], Any] | None = None,
    not_estimated: str | None = None,
    default: Any = None,
) -> Callable[[Handler], Handler]:
    """Register the decorated ``fn(module, config, applied) -> None`` as the handler of ``config_type``.

    Args:
        config_type: the technique's frozen config class.
        field: its :class:`~lightning_lowmem.functional.config.TrainingConfig` keyword, e.g. ``"lora"``.
        order: where it runs in :func:`~lightning_lowmem.functional.apply`, smaller first (the built-ins' orders:
            :mod:`lightning_lowmem.functional.handlers`; the step-side techniques 0).
        shorthand: ``fn(value, *, flat_keyword=None, ...) -> config | mapping | None`` for what users
            write instead of a config (``lora=8``); its keyword-only parameters become flat keywords of
            ``TrainingConfig`` (``micro_batch_size=4``). Default: ``config_type(value)`` for a value that is
            not a config, a mapping or ``None``.
        label: ``fn(config | None) -> str | None``, the config's part of ``describe()``. Default:
            ``field(arguments)``, nothing for ``None``.
        to_shorthand: ``fn(config | None) -> dict``, its flat keywords for ``to_dict()`` (what the
            constructor takes back). Default: ``{field: dataclasses.asdict(config)}``, nothing for ``None``.
        step_context: ``fn(config, stats) -> context manager`` each training step runs in
            (:meth:`Applied.step_context`); ``stats`` is ``Applied.compression_stats`` or the caller's. Default:
            ``None`` (the technique has no step side, or its own, like the optimizer's ``OptimizerConfig.build``).
        not_estimated: why the estimator cannot run it on fake tensors (its effect depends on the weights'
            values); ``estimate_memory`` and ``plan_memory`` then refuse a config with it. Default: ``None``.
        default: the value ``TrainingConfig()`` takes when the keyword is not given (what a user would write,
            e.g. ``"32-true"`` for precision). Default: ``None`` (off).

    Returns:
        The decorator; it returns the handler unchanged.

    Raises:
        TypeError: ``config_type`` is not a class, or the handler is not callable.
        ValueError: the type or the field is registered already (call :func:`unregister_technique` first).
    """
    if not isinstance(config_type, type):
        raise TypeError(f"`config_type` must be a config class, got {type(config_type).__name__}: {config_type!r}")
    if not isinstance(field, str) or not field.isidentifier():
        raise ValueError(f"`field`={field!r} must be a Python identifier (the TrainingConfig keyword), e.g. 'lora'")
    if isinstance(order, bool) or not isinstance(order, int):
        raise TypeError(f"`order` must be an int (smaller applies first), got {type(order).__name__}: {order!r}")
    parameters = inspect.signature(shorthand).parameters.values() if shorthand is not None else ()
    flat = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)

    def decorator(handler: Handler) -> Handler:
        if not callable(handler):
            raise TypeError(f"the handler of {config_type.__name__} must be callable, got {handler!r}")
        for other in _TECHNIQUES.values():
            taken = {other.field, *other.flat} & {field, *flat}
            if other.config_type is config_type or taken:
                what = config_type.__name__ if other.config_type is config_type else f"keyword {min(taken)!r}"
                raise ValueError(
                    f"{what} is registered already (by {other.config_type.__name__}); "
                    "call unregister_technique first to replace it"
                )
        _TECHNIQUES[config_type] = Technique(
            config_type=config_type,
            field=field,
            order=order,
            handler=handler,
            shorthand=shorthand or _keep,
            flat=flat,
            label=label or _default_label(field),
            to_shorthand=to_shorthand or _default_to_shorthand(field),
            step_context=step_context,
            not_estimated=not_estimated,
            default=default,
        )
        return handler

    return decorator


def unregister_technique(config_type: type) -> None:
    """Forget ``config_type``'s technique (a test's toy technique, or one replaced by another handler)."""
    _TECHNIQUES.pop(config_type, None)


def techniques() -> list[Technique]:
    """The registered techniques, in registration order (the order of ``describe()`` and ``to_dict()``)."""
    return list(_TECHNIQUES.values())


def technique(field: str) -> Technique:
    """The technique whose :class:`TrainingConfig` keyword is ``field``.

    Raises:
        KeyError: no technique has that field (the message lists those that do).
    """
    for registered in _TECHNIQUES.values():
        if registered.field == field:
            return registered
    raise KeyError(f"no technique is registered with field {field!r}; registered: {[t.field for t in techniques()]}")


def handler_for(config_type: type) -> Handler:
    """The handler registered for ``config_type`` (its class, or a subclass's nearest registered base).

    Raises:
        TypeError: nothing is registered for it (the message lists what is, and how to register).
    """
    return _find(config_type).handler


def technique_for(config: Any) -> Technique:
    """The registered technique of a config object (see :func:`handler_for`)."""
    return _find(type(config))


def _find(config_type: type) -> Technique:
    for base in getattr(config_type, "__mro__", (config_type,)):
        if base in _TECHNIQUES:
            return _TECHNIQUES[base]
    raise TypeError(
        f"no technique handler is registered for {getattr(config_type, '__name__', config_type)!r}; registered: "
        f"{[t.config_type.__name__ for t in techniques()]} (register one with @register_technique(ConfigType, ...))"
    )
