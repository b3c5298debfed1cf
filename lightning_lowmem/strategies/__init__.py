"""lightning_lowmem.strategies"""
