"""Kernels vLLM worker processes call: each file holds a Triton kernel, its launcher and the custom op
wrapper; `reference.py` holds the CPU/torch definition every kernel is tested against."""
