"""Estimate and plan: a training step's peak predicted on fake tensors, and the cheapest technique mix under a
budget. This package applies the techniques (through ``functional/``) and counts with ``memory/``; ``memory/``
itself only counts and imports nothing from ``functional/``.
"""
