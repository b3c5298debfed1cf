"""lightning_lowmem.plugins"""
