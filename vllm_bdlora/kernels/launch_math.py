"""Integer arithmetic for sizing launches on the host.

Triton's `triton.cdiv` and `triton.next_power_of_2` are constexpr functions (in Triton 3.6 and 3.9 alike): callable
from kernels at compile time, but each host call goes through `ConstexprFunction.__call__` (an import, argument
unwrapping), some 2 µs against 0.03 for the arithmetic (archived CPU runs). The layer op sizes a
dozen of them per call outside CUDA graphs, so host code uses these; kernels keep `tl.cdiv`.
"""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded up (positive denominators)."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n; 0 for n <= 0, as Triton's."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
