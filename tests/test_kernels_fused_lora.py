"""Fused multi-LoRA kernels: routing and the torch references against plain per-token loops (CPU), the
Triton kernels against the references in Triton's interpreter (CPU) and compiled (GPU, fp16/bf16)."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_bdlora.kernels.reference import (
    fused_expand_reference,
    fused_lora_linear_reference,
    lora_shrink_reference,
)

SLOT_RANKS = [8, 32, 0, 20]  # heterogeneous, one empty adapter; buffers are 32 wide


def mixed_batch(tokens=45, hidden=48, out=40, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, len(SLOT_RANKS), (tokens,), generator=g)
    ranks = torch.tensor(SLOT_RANKS, dtype=torch.int32)
    lora_a = torch.randn(len(SLOT_RANKS), 32, hidden, generator=g) * 0.2
    lora_b = torch.randn(len(SLOT_RANKS), out, 32, generator=g) * 0.2
    for slot, rank in enumerate(SLOT_RANKS):  # padding beyond the rank holds garbage the kernels must skip
        lora_a[slot, rank:] = 7.0
        lora_b[slot, :, rank:] = 7.0
    x = torch.randn(tokens, hidden, generator=g)
    weight = torch.randn(out, hidden, generator=g) * 0.2
    scales = torch.tensor([0.5, 2.0, 1.0, 1.5])
    g_table = 0.5 + torch.rand(len(SLOT_RANKS), out, generator=g)
    bias = torch.randn(out, generator=g)
    to = {"device": device}
    return {
        "x": x.to(dtype=dtype, **to), "weight": weight.to(dtype=dtype, **to), "bias": bias.to(dtype=dtype, **to),
        "lora_a": lora_a.to(dtype=dtype, **to), "lora_b": lora_b.to(dtype=dtype, **to),
        "slots": slots.to(**to), "ranks": ranks.to(**to), "scales": scales.to(**to), "g": g_table.to(**to),
    }  # fmt: skip


def per_token_loop(b, dora=False):
    """Independent of the references: one token at a time, float64."""
    out = []
    for t in range(b["x"].shape[0]):
        x = b["x"][t].double()
        base = b["weight"].double() @ x + b["bias"].double()
        slot = int(b["slots"][t])
        if slot < 0:
            out.append(base)
            continue
        r = SLOT_RANKS[slot]  # an empty adapter (rank 0) adds no delta but keeps its DoRA scale
        delta = float(b["scales"][slot]) * (b["lora_b"][slot, :, :r].double() @ (b["lora_a"][slot, :r].double() @ x))
        if dora:
            g = b["g"][slot].double()
            out.append(base + (g - 1) * (base - b["bias"].double()) + g * delta)
        else:
            out.append(base + delta)
    return torch.stack(out)


@pytest.mark.parametrize("dora", [False, True])
def test_references_match_a_per_token_loop(dora):
    b = mixed_batch()
    shrunk = lora_shrink_reference(b["x"], b["lora_a"], b["slots"], b["ranks"])
    g = b["g"] if dora else None
    fused = fused_lora_linear_reference(b["x"], b["weight"], shrunk, b["lora_b"], b["slots"], b["ranks"], b["scales"],
                                        b["bias"], g)  # fmt: skip
    base = b["x"] @ b["weight"].T + b["bias"]
    expanded = fused_expand_reference(base, shrunk, b["lora_b"], b["slots"], b["ranks"], b["scales"], g, b["bias"])
    want = per_token_loop(b, dora)
    assert torch.allclose(fused.double(), want, atol=1e-4)
    assert torch.allclose(expanded.double(), want, atol=1e-4)


def test_routing_gives_single_slot_tiles_covering_every_token():
    from vllm_bdlora.kernels.fused_lora import UNUSED_TILE, route_tokens

    slots = mixed_batch(tokens=70)["slots"]
    routing = route_tokens(slots, len(SLOT_RANKS), block_m=16)
    seen = []
    tiles = zip(routing.tile_slot.tolist(), routing.tile_start.tolist(), routing.tile_end.tolist(), strict=True)
    for slot, start, end in tiles:
        if slot == UNUSED_TILE:
            continue
        ids = routing.sorted_ids[start : min(start + 16, end)].long()
        assert len(ids) and torch.all(slots[ids] == slot), (slot, slots[ids])
        seen += ids.tolist()
    assert sorted(seen) == list(range(70))


INTERPRETED = """
import torch
from tests.test_kernels_fused_lora import SLOT_RANKS, mixed_batch
from vllm_bdlora.kernels.fused_lora import fused_expand, fused_lora_linear, lora_shrink, route_tokens
from vllm_bdlora.kernels.reference import fused_expand_reference, fused_lora_linear_reference, lora_shrink_reference
for tokens in (1, 5, 45):
    b = mixed_batch(tokens=tokens)
    routing = route_tokens(b["slots"], len(SLOT_RANKS), block_m=16)
    shrunk = lora_shrink(b["x"], b["lora_a"], routing, b["ranks"])
    want_s = lora_shrink_reference(b["x"], b["lora_a"], b["slots"], b["ranks"])
    assert torch.allclose(shrunk, want_s, atol=1e-4), (shrunk - want_s).abs().max()
    for g in (None, b["g"]):
        args = (want_s, b["lora_b"], routing, b["ranks"], b["scales"])
        got = fused_lora_linear(b["x"], b["weight"], *args, bias=b["bias"], scale_table=g)
        ref_args = (want_s, b["lora_b"], b["slots"], b["ranks"], b["scales"])
        want = fused_lora_linear_reference(b["x"], b["weight"], *ref_args, bias=b["bias"], scale_table=g)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        y = b["x"] @ b["weight"].T + b["bias"]
        want = fused_expand_reference(y, *ref_args, scale_table=g, bias=b["bias"])
        got = fused_expand(y.clone(), *args, scale_table=g, bias=b["bias"])
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
print("ok")
"""


def test_triton_kernels_in_interpreter_match_references():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_triton_kernels_match_references_on_gpu(dtype, tokens):
    from vllm_bdlora.kernels.fused_lora import fused_expand, fused_lora_linear, lora_shrink, route_tokens

    b = mixed_batch(tokens=tokens, hidden=256, out=320, dtype=dtype, device="cuda")
    routing = route_tokens(b["slots"], len(SLOT_RANKS), block_m=16)
    shrunk = lora_shrink(b["x"], b["lora_a"], routing, b["ranks"])
    want_s = lora_shrink_reference(b["x"], b["lora_a"], b["slots"], b["ranks"])
    torch.testing.assert_close(shrunk, want_s, atol=2e-2, rtol=2e-2)
    args = (want_s, b["lora_b"], routing, b["ranks"], b["scales"])
    ref_args = (want_s, b["lora_b"], b["slots"], b["ranks"], b["scales"])
    for g in (None, b["g"]):
        got = fused_lora_linear(b["x"], b["weight"], *args, bias=b["bias"], scale_table=g)
        want = fused_lora_linear_reference(b["x"], b["weight"], *ref_args, bias=b["bias"], scale_table=g)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
        y = (b["x"].float() @ b["weight"].float().T + b["bias"].float()).to(dtype)
        got = fused_expand(y.clone(), *args, scale_table=g, bias=b["bias"])
        torch.testing.assert_close(got, fused_expand_reference(y, *ref_args, scale_table=g, bias=b["bias"]),
                                   atol=5e-2, rtol=2e-2)  # fmt: skip
