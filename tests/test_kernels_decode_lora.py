"""The one-launch decode kernel: its reference against a per-token loop (CPU), the kernel against the
reference in Triton's interpreter (CPU, the shrink as its own launch) and compiled with the in-kernel barrier
(GPU), over repeated calls (the state's S buffers alternate) and CUDA-graph replays."""

import pytest
import torch

from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch, per_token_loop, run_check_script
from vllm_bdlora.kernels.reference import lora_linear_slices_reference


def test_reference_matches_a_per_token_loop():
    b = mixed_batch(tokens=16)
    b["scales"] = torch.ones_like(b["scales"])  # vLLM folds the scaling into B
    got = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                       b["slots"], b["bias"])  # fmt: skip
    assert torch.allclose(got.double(), per_token_loop(b), atol=1e-4)


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("out_features", [16, 1536, 4096, 7168, 14336, 28672, 33792])
def test_plan_never_launches_more_programs_than_sms(out_features, slots):
    """The barrier waits for every program: a grid larger than the SMs could wait on one never scheduled."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    plan = decode_plan(out_features, 4096, 96, slots, sms=132)
    reserve = min(32, 4 * slots)  # SMs left to the shrink
    if out_features > 128 * (132 - reserve):  # a column block of at most 128
        assert plan is None
        return
    assert plan.tiles * plan.block_n >= out_features > (plan.tiles - 1) * plan.block_n
    assert plan.programs <= 132
    # every hidden index is in some shrink program's share, and every shrink program has one
    assert plan.k_per_chunk * plan.chunks >= 4096 > plan.k_per_chunk * (plan.chunks - 1)
    assert plan.chunks >= reserve


KERNEL_CHECK = """
import sys, torch
from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch
from vllm_bdlora.kernels.decode_lora import decode_lora_linear, decode_plan, new_decode_state
from vllm_bdlora.kernels.reference import lora_linear_slices_reference
device, dtype, tol = sys.argv[1], getattr(torch, sys.argv[2]), float(sys.argv[5])
phases, hidden = int(sys.argv[3]), int(sys.argv[4])
for tokens in (1, 5, 16):
    b = mixed_batch(tokens=tokens, hidden=hidden, dtype=dtype, device=device, seed=tokens)
    if tokens > 1:
        b["slots"][1] = 99  # a stale slot number past the buffers (graph padding rows): no adapter, no fault
    state = new_decode_state(b["lora_a"].shape[1], device)
    # CPU: a small SM count, so several programs share the shrink and the output columns
    plan = decode_plan(b["weight"].shape[0], hidden, b["lora_a"].shape[1], 1, 9) if device == "cpu" else None
    assert plan is None or (plan.tiles > 1 and plan.chunks > 1), plan
    for call in range(5):  # the S buffers alternate: every call must start from zeros
        slots = b["slots"].clone()
        slots[torch.arange(tokens, device=device) % 5 == call] = call % len(SLOT_WIDTHS[0])
        want = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                            slots, b["bias"] if call % 2 else None)
        out = torch.full_like(want, float("nan"))
        decode_lora_linear(out, b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], slots, state,
                           b["bias"] if call % 2 else None, plan=plan, phases=phases)
        err = (out.double() - want.double()).abs().max().item()
        assert err <= tol * (1 + want.double().abs().max().item()), (tokens, call, err)
    assert state[0].item() == 5 << 16, state[0]  # arrivals reset, one epoch per call
print("ok")
"""


def run_kernel_check(device, dtype, phases, hidden, tol, interpret):
    run_check_script(KERNEL_CHECK, (device, dtype, phases, hidden, tol), interpret)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU host checks the compiled kernel instead; Triton 3.6's interpreter there cannot run kernels",
)
def test_kernel_in_interpreter_matches_reference():
    run_kernel_check("cpu", "float32", 2, 200, 1e-4, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden", [272, 4096])  # a hidden size the GEMV's K step does not divide, and 8B's
def test_kernel_with_in_kernel_barrier_matches_reference_on_gpu(dtype, hidden):
    run_kernel_check("cuda", dtype, 1, hidden, 3e-2, interpret=False)


@pytest.mark.gpu
def test_layer_op_runs_the_one_launch_kernel_in_a_cuda_graph(monkeypatch):
    """The op as BD layers call it with their decode state, captured at 8 rows and replayed 50 times with the
    slots (vLLM's per-step metadata) changing between replays: each replay right, none stalls."""
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.decode_lora import new_decode_state
    from vllm_bdlora.kernels.fused_lora import group_tokens

    launched = []
    real = decode_lora.decode_lora_linear
    monkeypatch.setattr(decode_lora, "decode_lora_linear", lambda *a, **k: launched.append(1) or real(*a, **k))
    rows, slots_n = 8, len(SLOT_WIDTHS[0])
    b = mixed_batch(tokens=rows, hidden=512, dtype=torch.bfloat16, device="cuda")
    groups = group_tokens(b["slots"], slots_n)
    state = new_decode_state(b["lora_a"].shape[1], "cuda")
    out = torch.empty(rows, b["weight"].shape[0], dtype=torch.bfloat16, device="cuda")

    def step():
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"], groups.sorted_ids,
            groups.group_slot, groups.group_count, groups.group_start, torch.tensor([False]), None, b["bias"],
            b["weight"], state,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    assert launched, "the op took the three-kernel path"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        b["slots"].copy_(torch.randint(-1, slots_n, (rows,), generator=generator))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                            b["slots"], b["bias"])  # fmt: skip
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
