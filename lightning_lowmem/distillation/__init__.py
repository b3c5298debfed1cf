"""lightning_lowmem.distillation"""
