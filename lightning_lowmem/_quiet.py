"""Drop the log lines torchao's import prints on a machine without CUDA, from ``import lightning_lowmem`` on.

The package imports torchao for the user (quantization, QAT, the 8-bit optimizers), and that import logs

- a ``Failed to load .../torchao/_C_mxfp8...so: Could not load this library`` warning per CUDA-only kernel
  library, and
- torch >= 2.13's ``<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
  torch.compile ... register_constant() on Enum subclasses is deprecated`` for each enum torchao registers.

Neither says anything to the user of a quantizer. :func:`quiet_startup_logs` adds one filter to each of those two
loggers (no import of torch or torchao: ``logging.getLogger`` makes them before they exist), dropping exactly
those lines; every other record of the two loggers passes. A ``Failed to load`` line is kept where CUDA is
available: there a kernel library that does not load matters. ``import lightning_lowmem`` installs it, so the
Python API is as quiet as the ``lowmem`` command; a torchao imported before ``lightning_lowmem`` has already logged.
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = ["DropMessages", "quiet_startup_logs"]


class DropMessages(logging.Filter):
    """Drops log records whose message matches one of ``patterns`` (nothing else); keeps the last one
    dropped in ``held``.

    Args:
        patterns: regular expressions, searched in each record's message.
        unless_cuda: keep every record where ``torch.cuda.is_available()`` (asked at the first matching record,
            once torch is loaded). Default: ``False``.

    Example::

        >>> noisy = logging.getLogger("lowmem.example")
        >>> noisy.addFilter(DropMessages(r"^Failed to load"))
        >>> noisy.warning("Failed to load x.so")  # dropped
    """

    def __init__(self, *patterns: str, unless_cuda: bool = False) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]
        self.unless_cuda = unless_cuda
        self.held: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.search(message) for p in self.patterns) and not (self.unless_cuda and _cuda_available()):
            self.held = message
            return False
        return True


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # a torchao log line means torch is loaded; never import it from a filter
    return bool(torch is not None and torch.cuda.is_available())


# logger -> (pattern of the one line to drop, keep it where CUDA is available)
_NOISE = {
    "torchao": (r"^Failed to load \S*torchao/_C\w*\.\S*so: Could not load this library", True),
    "torch.utils._pytree": (r"is an Enum subclass and is now natively supported by torch\.compile", False),
}


def quiet_startup_logs() -> None:
    """Silence torchao's import-time log lines (see the module docstring); idempotent.

    Example::

        >>> quiet_startup_logs(); quiet_startup_logs()
        >>> sum(isinstance(f, DropMessages) for f in logging.getLogger("torchao").filters)
        1
    """
    for name, (pattern, unless_cuda) in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(pattern, unless_cuda=unless_cuda))
