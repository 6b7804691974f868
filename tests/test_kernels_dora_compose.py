"""The DoRA compose kernel: its torch reference against an independent float64 formula, the Triton
kernel against the reference (Triton's interpreter on CPU, compiled on a GPU), and the custom op under
torch.compile and CUDA-graph capture (GPU)."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_bdlora.kernels.reference import dora_compose_reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def mixed_batch(rows, cols, slots=4, dtype=torch.float32, device="cpu", bias=True, seed=0):
    """Tokens of several adapters, plain-LoRA slots (g = 1) and no-adapter tokens (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g)
    lora = torch.randn(rows, cols, generator=g) * 0.1
    scale = 0.5 + torch.rand(slots, cols, generator=g)
    scale[1] = 1.0  # a plain LoRA adapter in slot 1
    token_slots = torch.randint(-1, slots, (rows,), generator=g)
    b = torch.randn(cols, generator=g) if bias else None
    to = dict(device=device)
    return (
        base.to(dtype=dtype, **to),
        lora.to(dtype=dtype, **to),
        scale.to(**to),
        token_slots.to(**to),
        b.to(dtype=dtype, **to) if b is not None else None,
    )


def float64_formula(base, lora, scale, token_slots, bias):
    """Written independently of the reference: per token, PEFT's DoRA output with bias excluded."""
    out = torch.empty(base.shape, dtype=torch.float64)
    for t in range(base.shape[0]):
        b, lo = base[t].double(), lora[t].double()
        unbiased = b - bias.double() if bias is not None else b
        if token_slots[t] < 0:
            out[t] = b + lo
        else:
            g = scale[token_slots[t]].double()
            out[t] = (unbiased * g + (b - unbiased)) + g * lo
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_formula(bias, dtype):
    inputs = mixed_batch(37, 50, dtype=dtype, bias=bias)
    got = dora_compose_reference(*inputs).double()
    want = float64_formula(*inputs)
    assert torch.allclose(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_reference_leaves_unadapted_tokens_and_plain_lora_untouched():
    base, lora, scale, slots, bias = mixed_batch(64, 33)
    out = dora_compose_reference(base, lora, scale, slots, bias)
    plain = (slots == -1) | (slots == 1)
    assert plain.any() and (~plain).any()
    assert torch.equal(out[plain], base[plain] + lora[plain])
    assert not torch.allclose(out[~plain], base[~plain] + lora[~plain])


INTERPRETED = """
import torch
from vllm_bdlora.kernels.dora_compose import dora_compose
from vllm_bdlora.kernels.reference import dora_compose_reference
from tests.test_kernels_dora_compose import mixed_batch
for rows, cols, bias in ((1, 7, True), (70, 300, True), (129, 1030, False)):
    inputs = mixed_batch(rows, cols, bias=bias)
    got, want = dora_compose(*inputs), dora_compose_reference(*inputs)
    assert torch.allclose(got, want, atol=1e-6), (rows, cols, (got - want).abs().max())
    inplace = inputs[0].clone()
    dora_compose(inplace, *inputs[1:], out=inplace)
    assert torch.allclose(inplace, want, atol=1e-6)
print("ok")
"""


def test_triton_kernel_in_interpreter_matches_reference():
    """The Triton kernel itself, run by Triton's CPU interpreter (no GPU needed)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_custom_op_on_cpu_is_the_reference():
    import vllm_bdlora.kernels.dora_compose  # noqa: F401

    base, lora, scale, slots, bias = mixed_batch(20, 40)
    want = dora_compose_reference(base, lora, scale, slots, bias)
    torch.ops.vllm_bdlora.dora_compose_(base, lora, scale, slots, bias)
    assert torch.equal(base, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 4096), (3, 1000), (512, 14336), (2048, 4096)])
def test_triton_kernel_matches_reference_on_gpu(dtype, rows, cols):
    from vllm_bdlora.kernels.dora_compose import dora_compose

    for bias in (True, False):
        inputs = mixed_batch(rows, cols, dtype=dtype, device="cuda", bias=bias)
        got = dora_compose(*inputs)
        want = dora_compose_reference(*inputs)
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.gpu
def test_custom_op_under_torch_compile_and_cuda_graphs():
    import vllm_bdlora.kernels.dora_compose  # noqa: F401

    base, lora, scale, slots, bias = mixed_batch(256, 4096, dtype=torch.bfloat16, device="cuda")
    want = dora_compose_reference(base, lora, scale, slots, bias)

    def layer(b, lo):
        out = b * 1  # a fresh output, as the base GEMM's would be
        torch.ops.vllm_bdlora.dora_compose_(out, lo, scale, slots, bias)
        return out

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(base, lora), want, atol=2e-2, rtol=2e-2)
    static_base, static_lora = base.clone(), lora.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer(static_base, static_lora)  # warm-up compiles the kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_base, static_lora)
    static_base.copy_(base * 2)
    graph.replay()
    torch.testing.assert_close(
        static_out, dora_compose_reference(base * 2, lora, scale, slots, bias), atol=4e-2, rtol=2e-2
    )
