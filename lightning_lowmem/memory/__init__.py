"""Memory measurement, estimation and planning: the one place where bytes are counted."""

from lightning_lowmem.memory.measure import MemoryTracking, mark_memory, measure_memory, state_bytes, track_memory
from lightning_lowmem.memory.report import CATEGORIES, PHASES, MemoryReport
from lightning_lowmem.memory.units import format_bytes, parse_bytes

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemoryReport",
    "MemoryTracking",
    "format_bytes",
    "mark_memory",
    "measure_memory",
    "parse_bytes",
    "state_bytes",
    "track_memory",
]
