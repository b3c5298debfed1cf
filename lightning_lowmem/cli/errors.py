"""One clear ``error:`` line for a mistake in a ``lowmem`` YAML config or command line.

jsonargparse reports a bad ``class_path``, an unknown init argument or a wrong type as a nested
"Does not validate against any of the Union subtypes" block, and a ``ValueError`` raised by a
callback's constructor as a traceback. :func:`explain_parse_error` turns the first kind into one
sentence with a "did you mean" for near-miss names; :func:`explain_construction_error` does the same for
the second. Both are generic: they read class signatures and module contents, not a list of our own
callbacks, so a new constructor argument is covered without touching this file.

Only the ``lowmem`` CLI uses this module.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re
import textwrap
from typing import Any, Iterable

# constructor errors that are the user's configuration talking; anything else keeps its traceback
CONFIG_ERROR_TYPES: tuple[type[BaseException], ...] = (ValueError, TypeError, ImportError, NotImplementedError)


class ConfigError(ValueError):
    """A configuration mistake; its message is the one line printed after ``error:``, ``hint`` the line after it
    (``None``: the command's usual "see --help" line)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """``" (did you mean X?)"`` for the candidate closest to ``name``, or ``""`` when none is close.

    Example::

        >>> did_you_mean("polcy", ["policy", "nested"])
        " (did you mean 'policy'?)"
    """
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    if not close:  # case-insensitive second try ("activationcheckpointing")
        lowered = {c.lower(): c for c in candidates}
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.75)]
    if not close:
        return ""
    return f" (did you mean {prefix}{close[0]}?)" if prefix else f" (did you mean {close[0]!r}?)"


def one_line(text: str) -> str:
    """Collapse a possibly multi-line message into one line."""
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def public_path(cls: type) -> str:
    """The shortest import path that names ``cls`` (``lightning_lowmem.ActivationCompression``, not the
    defining submodule)."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module_name = ".".join(parts[:end])
        try:
            if getattr(importlib.import_module(module_name), cls.__name__, None) is cls:
                return f"{module_name}.{cls.__name__}"
        except Exception:  # noqa: BLE001 - a parent package that fails to import just isn't shorter
            continue
    return f"{cls.__module__}.{cls.__qualname__}"


def _import(path: str) -> Any | None:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr) if module_name else importlib.import_module(attr)
    except Exception:  # noqa: BLE001 - only used to enrich a message
        return None


def _module_members(module_name: str) -> list[str]:
    """Public attributes and submodules of a module (empty if it cannot be imported)."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001
        return []
    names = [n for n in dir(module) if not n.startswith("_")]
    for info in pkgutil.iter_modules(getattr(module, "__path__", []) or []):
        names.append(info.name)
    return names


def _class_not_found(class_path: str) -> str:
    """Why ``class_path`` does not import, with the nearest existing path."""
    parts = class_path.split(".")
    for end in range(len(parts) - 1, 0, -1):  # longest importable prefix
        module_name = ".".join(parts[:end])
        try:
            importlib.import_module(module_name)
        except Exception:  # noqa: BLE001
            continue
        missing = parts[end]
        hint = did_you_mean(missing, _module_members(module_name), prefix=f"{module_name}.")
        if hint and end < len(parts) - 1:  # fix the module part, keep the rest of the path
            hint = hint.replace("?)", "." + ".".join(parts[end + 1 :]) + "?)")
        return f"cannot import {class_path!r}: {module_name!r} has no {missing!r}{hint}"
    top = [m.name for m in pkgutil.iter_modules()]
    hint = did_you_mean(parts[0], top, prefix="")
    return f"cannot import {class_path!r}: no module named {parts[0]!r}{hint}"


def init_arg_names(cls: Any) -> list[str]:
    """Names of the keyword arguments ``cls(...)`` accepts."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _type_words(text: str) -> str:
    """``Expected a <class 'bool'>`` -> ``expected a bool``."""
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    text = re.sub(r"typing\.Literal\[(.*?)\]", r"one of \1", text)
    text = text.replace(". Got value:", ", got")
    return text[:1].lower() + text[1:]


def _indented_block(lines: list[str], start: int) -> list[str]:
    """The lines after ``lines[start]`` indented deeper than it."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip().splitlines()


def _explain_class_problem(class_path: str, detail: list[str]) -> str:
    text = "\n".join(detail)
    if re.search(r"has no attribute|No module named|Expected a dot import path", text):
        return _class_not_found(class_path)
    cls = _import(class_path)
    option = re.search(
        r"Option '([^']+)' is not accepted|Key '([^']+)' is not expected|Key \"([^\"]+)\" is not expected", text
    )
    if option:
        name = next(g for g in option.groups() if g)
        names = init_arg_names(cls) if cls is not None else []
        accepted = f"; it accepts {', '.join(names)}" if names else ""
        return f"{class_path} has no argument {name!r}{did_you_mean(name, names)}{accepted}"
    key = re.match(r'Parser key "([^"]+)":', detail[0]) if detail else None
    if key:
        reason = one_line(" ".join(detail[1:])) or "invalid value"
        return f"{class_path}: argument {key.group(1)!r}: {_type_words(reason)}"
    if detail and "Not a valid subclass" in detail[0]:
        return f"{class_path}: {one_line(detail[0])}"
    return f"{class_path}: {one_line(detail[-1]) if detail else 'invalid'}"


def _short_name_candidates(base_paths: list[str]) -> dict[str, str]:
    """Class name -> import path, for the loaded subclasses of the given base classes."""
    import lightning_lowmem

    for name in getattr(lightning_lowmem, "__all__", []):  # make our own classes known
        getattr(lightning_lowmem, name, None)
    found: dict[str, str] = {}
    for base in filter(None, (_import(p) for p in base_paths)):
        if not isinstance(base, type):
            continue
        stack = list(base.__subclasses__())
        while stack:
            cls = stack.pop()
            stack.extend(cls.__subclasses__())
            if not cls.__name__.startswith("_") and not cls.__module__.startswith("jsonargparse"):
                found.setdefault(cls.__name__, public_path(cls))
    return found


def explain_parse_error(message: str, option_names: Iterable[str] = ()) -> str:
    """One line for a jsonargparse parse error message.

    Args:
        message: the text of jsonargparse's ``ArgumentError``.
        option_names: the parser's option keys (``trainer.max_steps``, ...), for "did you mean".

    Returns:
        The line to print after ``error:`` (no newline).

    Example::

        >>> explain_parse_error("Group 'trainer' does not accept option 'max_step'", ["trainer.max_steps"])
        "trainer: unknown option 'max_step' (did you mean 'trainer.max_steps'?)"
    """
    lines = message.strip().splitlines()
    head = re.match(r'Parser key "([^"]+)":', lines[0]) if lines else None
    where = f"{head.group(1)}: " if head else ""
    option_names = list(option_names)

    for i, line in enumerate(lines):  # a class_path the user wrote: the most specific complaint
        problem = re.search(r"Problem with given class_path '([^']+)':", line)
        if problem:
            return where + _explain_class_problem(problem.group(1), _indented_block(lines, i))
    short = re.search(r"Expected a dot import path string: (\S+)", message)
    if short:
        subtypes = re.findall(r"<class '([\w.]+)'>", message)
        name = short.group(1)
        known = _short_name_candidates(subtypes)
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
        hint = f" (did you mean {known[close[0]]}?)" if close else "; give a full class_path (module.Class)"
        return f"{where}no class named {name!r} is known{hint}"
    group = re.match(r"Group '([^']+)' does not accept option '([^']+)'", message)
    if group:
        full = f"{group.group(1)}.{group.group(2)}"
        return f"{group.group(1)}: unknown option {group.group(2)!r}{did_you_mean(full, option_names)}"
    unknown = re.match(r"(?:Option|Key) ['\"]([^'\"]+)['\"] is not (?:accepted|expected)", message)
    if unknown:
        name = unknown.group(1)
        return f"unknown option {name!r}{did_you_mean(name, option_names)}"
    unrecognized = re.match(r"[Uu]nrecognized arguments: (.*)", message)
    if unrecognized:
        first = unrecognized.group(1).split()[0].lstrip("-").split("=")[0]
        return f"unrecognized arguments: {unrecognized.group(1)}{did_you_mean(first, option_names)}"
    required = re.match(r"the following arguments are required: (.*)", message)
    if required:  # "fit.model" -> "model"
        names = [re.sub(r"^(fit|validate|test|predict)\.", "", n.strip()) for n in required.group(1).split(",")]
        return f"missing {', '.join(names)}: give --{names[0]} CLASS_PATH or a config with a `{names[0]}:` section"
    if lines and lines[0].startswith("Problems parsing config"):
        return f"the config could not be read: {one_line(message.split(':', 1)[1])}"
    if head:  # a plain value of the wrong type: "trainer.precision" given "bf17"
        given = next((line.split(":", 1)[1].strip() for line in lines if line.strip().startswith("Given value:")), None)
        literals = re.findall(r"Literal\[([^\]]*)\]", message)
        choices = [c.strip() for group_ in literals for c in group_.split(",")]
        if given is not None and choices:
            options = [c.strip("'\"") for c in choices]
            hint = did_you_mean(given, options)
            return f"{where}{given!r} is not accepted{hint}; choose one of {', '.join(dict.fromkeys(choices))}"
        reasons = [line.strip()[2:] for line in lines if line.strip().startswith("- ")]
        reasons = [r for r in reasons if not r.startswith(("Expected a <class 'NoneType'>", "Not a valid subclass"))]
        inline = lines[0][head.end() :].strip()  # 'Parser key "config": File does not exist: ...'
        reason = inline or (reasons[0] if reasons else (lines[1] if len(lines) > 1 else "invalid value"))
        return f"{where}{_type_words(one_line(reason))}" + (f" (given {given})" if given else "")
    return one_line(message)


def explain_construction_error(cls: type | None, error: BaseException) -> str:
    """One line for an exception raised while constructing ``cls`` from the config.

    Example::

        >>> explain_construction_error(dict, ValueError("`mode`='int7' is unknown"))
        "builtins.dict: `mode`='int7' is unknown"
    """
    text = one_line(str(error)) or type(error).__name__
    if not isinstance(error, (ValueError, TypeError)):
        text = f"{type(error).__name__}: {text}"
    if cls is None:
        return text
    return f"{public_path(cls)}: {text}"


def strategy_hint(error: BaseException) -> str:
    """A "did you mean" for Lightning's "invalid strategy name" error (``trainer.strategy: lowmen``)."""
    match = re.search(r"invalid strategy name: `strategy='([^']+)'`", str(error))
    if not match:
        return ""
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_lowmem.strategies  # noqa: F401 - registers "lowmem", "lowmem_ddp", ...
    except Exception:  # noqa: BLE001
        return ""
    names = StrategyRegistry.available_strategies()
    return f"trainer.strategy: unknown strategy {match.group(1)!r}{did_you_mean(match.group(1), names)}"


def duplicate_callback_line(error: BaseException) -> str:
    """One line for Lightning's "Found more than one stateful callback of type `X`" (``""`` for another error)."""
    match = re.search(r"more than one stateful callback of type `(\w+)`", str(error))
    if not match:
        return ""
    name = match.group(1)
    return (
        f"trainer.callbacks: {name} is given twice; a fit takes one {name} (both would change the same layers and "
        f"save the same state): merge their options into one {name}"
    )
