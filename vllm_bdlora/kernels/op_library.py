"""Registers the kernels' in-place ops as `torch.ops.vllm_bdlora.<name>`.

The ops are defined on a `torch.library.Library` with one implementation per device key, as vLLM registers
its own ops, rather than with `torch.library.custom_op`: the latter's Python wrapper costs 20-100 µs per
call (measured 98 µs against 4.6 µs on a CI machine, bench note in bench/results/README.md), and layers
outside CUDA graphs (prefill) pay it on every call. torch.compile sees the same schema and the fake
implementation either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.library import Library, infer_schema

LIBRARY_NAME = "vllm_bdlora"
_library = Library(LIBRARY_NAME, "FRAGMENT")  # one fragment for every op of the package


def define_op(name: str, implementation: Callable, mutates_args: Sequence[str], fake: Callable) -> Callable:
    """Define `torch.ops.vllm_bdlora.<name>` from `implementation`'s annotated signature; the same function
    serves CPU and CUDA tensors (it picks its path itself). Returns `implementation` unchanged."""
    _library.define(name + infer_schema(implementation, mutates_args=tuple(mutates_args)))
    for dispatch_key in ("CPU", "CUDA"):
        _library.impl(name, implementation, dispatch_key)
    torch.library.register_fake(f"{LIBRARY_NAME}::{name}", fake, lib=_library)
    return implementation
