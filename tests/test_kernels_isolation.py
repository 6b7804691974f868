"""No adapter's values reach another adapter's rows, or the base model's, in any of vllm-bdlora's kernels: one slot's
LoRA weights are set to NaN or Inf (what admission refuses, here written into the slot directly) and every other
token's output must be what it is with that slot's weights finite. Masking, not multiplication by zero: 0 x NaN is
NaN. In Triton's interpreter (CPU) and compiled (GPU, fp16/bf16); the torch references (the CPU serving path) too."""

import pytest
import torch

from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch, run_check_script
from vllm_bdlora.kernels.reference import fused_lora_slices_reference, lora_linear_slices_reference

POISONED_SLOT = 3  # an adapter of nonzero width in every slice (SLOT_WIDTHS)


def poisoned(b, value):
    """`b` with every weight of POISONED_SLOT (within its width and beyond) set to `value`."""
    out = dict(b)
    for key in ("lora_a", "lora_b"):
        out[key] = b[key].clone()
        out[key][POISONED_SLOT] = value
    return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_references_keep_a_poisoned_slot_to_its_own_rows(value):
    b = mixed_batch(tokens=45)
    bad = poisoned(b, value)
    others = b["slots"] != POISONED_SLOT
    base = b["x"] @ b["weight"].T + b["bias"]
    args = ("widths", "bounds", "slots")
    for dora in (None, b["g"]):
        clean = fused_lora_slices_reference(base, b["x"], b["lora_a"], b["lora_b"], *(b[k] for k in args),
                                            b["scales"], dora, b["bias"])  # fmt: skip
        got = fused_lora_slices_reference(base, b["x"], bad["lora_a"], bad["lora_b"], *(b[k] for k in args),
                                          b["scales"], dora, b["bias"])  # fmt: skip
        assert torch.equal(got[others], clean[others]) and torch.isfinite(got[others]).all()
    clean = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], *(b[k] for k in args))
    got = lora_linear_slices_reference(b["x"], b["weight"], bad["lora_a"], bad["lora_b"], *(b[k] for k in args))
    assert torch.equal(got[others], clean[others]) and torch.isfinite(got[others]).all()


ISOLATION_CHECK = """
import sys, torch
from dataclasses import replace
from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch
from tests.test_kernels_isolation import POISONED_SLOT, poisoned
from vllm_bdlora.kernels.decode_lora import decode_lora_linear, new_decode_state
from vllm_bdlora.kernels.fused_lora import delta_then_gemm, fused_expand, group_tokens, lora_shrink
from vllm_bdlora.kernels.plans import LaunchConfig, make_plan, row_tile, whole_block_step
device, dtype, phases, tol = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
hidden = 272 if device == "cuda" else 48
slots_n = len(SLOT_WIDTHS[0])

def same_elsewhere(got, want, others, what):
    assert torch.isfinite(got[others]).all(), (what, "non-finite output in another adapter's row")
    err = (got[others].double() - want[others].double()).abs().max().item() if others.any() else 0.0
    assert err <= tol * (1 + want[others].double().abs().max().item()), (what, err)

for value in (float("nan"), float("inf")):
    for tokens in (5, 16, 45):
        b = mixed_batch(tokens=tokens, hidden=hidden, dtype=dtype, device=device, seed=tokens)
        b["slots"][:slots_n + 1] = torch.arange(-1, slots_n, device=device)  # every slot and the base model
        bad = poisoned(b, value)
        others = b["slots"] != POISONED_SLOT
        groups = group_tokens(b["slots"], slots_n)
        y = (b["x"].float() @ b["weight"].float().T + b["bias"].float()).to(dtype)
        for split_k in (1, 3):
            cfg = LaunchConfig(16, 16, 32, split_k=split_k)
            # mixed tiles: rows of the poisoned slot share tiles with every other adapter's rows
            for expand_cfg in (LaunchConfig(16, 64, 32, num_stages=2), LaunchConfig(128, 256, 32, num_warps=8),
                               LaunchConfig(16, 64, 32, num_stages=2, mixed_tiles=True)):
                runs = []
                for w in (b, bad):
                    shrunk = lora_shrink(w["x"], w["lora_a"], groups, w["widths"], config=cfg)
                    args = (shrunk, w["lora_b"], groups, w["widths"], w["bounds"], w["scales"])
                    runs.append((fused_expand(y.clone(), *args, scale_table=w["g"], bias=w["bias"], config=expand_cfg),
                                 delta_then_gemm(w["x"], w["weight"], *args, bias=w["bias"],
                                                 out=torch.full_like(y, float("nan")), config=expand_cfg)))
                (expand_clean, gemm_clean), (expand_bad, gemm_bad) = runs
                same_elsewhere(expand_bad, expand_clean, others, f"fused_expand {value} {tokens} {split_k}")
                same_elsewhere(gemm_bad, gemm_clean, others, f"delta_then_gemm {value} {tokens} {split_k}")
        if tokens > 16:
            continue
        tile = row_tile(tokens)
        plan = make_plan(b["weight"].shape[0], hidden, b["lora_a"].shape[1], 3, block_n=16,
                         block_k=min(64, whole_block_step(16, tile)), stream_k=False, block_m=tile)
        for row_gather in (False, True):  # the finish's tl.dot per adapter, or each row gathering its B
            outs = []
            for w in (b, bad):
                state = new_decode_state(w["lora_a"].shape[1], device, plan)
                out = torch.full_like(y, float("nan"))
                decode_lora_linear(out, w["x"], w["weight"], w["lora_a"], w["lora_b"], w["widths"], w["bounds"],
                                   w["slots"], state, w["bias"], plan=replace(plan, row_gather=row_gather),
                                   phases=phases)  # fmt: skip
                outs.append(out)
            same_elsewhere(outs[1], outs[0], others, f"decode_lora_linear {value} {tokens} {row_gather}")
print("ok")
"""


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU host checks the compiled kernels instead; Triton 3.6's interpreter there cannot run them",
)
def test_kernels_in_interpreter_keep_a_poisoned_slot_to_its_own_rows():
    run_check_script(ISOLATION_CHECK, ("cpu", "float32", 2, 1e-4), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernels_on_gpu_keep_a_poisoned_slot_to_its_own_rows(dtype):
    run_check_script(ISOLATION_CHECK, ("cuda", dtype, 1, 3e-2), interpret=False)


def test_every_slot_and_the_base_model_appear_in_the_checked_batches():
    b = mixed_batch(tokens=5)
    b["slots"][: len(SLOT_WIDTHS[0]) + 1] = torch.arange(-1, len(SLOT_WIDTHS[0]))
    assert set(b["slots"].tolist()) == set(range(-1, len(SLOT_WIDTHS[0])))
    assert all(widths[POISONED_SLOT] > 0 for widths in SLOT_WIDTHS)
