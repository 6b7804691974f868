"""Host-side launch arithmetic: the same integers as Triton's constexpr functions, which it replaces on the host."""

import triton

from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2


def test_matches_tritons_own():
    for n in range(-3, 20000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for numerator in (*range(0, 600), 4095, 4096, 4097, 14336, 28672, 1 << 20):
        for denominator in (1, 2, 3, 16, 32, 64, 128, 256, 1000):
            assert cdiv(numerator, denominator) == triton.cdiv(numerator, denominator), (numerator, denominator)
