"""The one-launch decode kernel: its reference against a per-token loop (CPU), the kernel against the
reference in Triton's interpreter (CPU, the shrink as its own launch) and compiled with the in-kernel barrier
(GPU), over repeated calls (the state's S buffers alternate) and CUDA-graph replays."""

import pytest
import torch

from tests.test_kernels_fused_lora import mixed_batch, per_token_loop, run_check_script
from vllm_bdlora.kernels.reference import lora_linear_slices_reference


def test_reference_matches_a_per_token_loop():
    b = mixed_batch(tokens=16)
    b["scales"] = torch.ones_like(b["scales"])  # vLLM folds the scaling into B
    got = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                       b["slots"], b["bias"])  # fmt: skip
    assert torch.allclose(got.double(), per_token_loop(b), atol=1e-4)


def test_a_decode_state_too_small_for_this_gpus_plan_sends_the_layer_to_three_kernels():
    """A layer's state is sized for the plans of the GPU it was made on; on a GPU whose plan needs more (another
    table), the op must take the three-kernel path, not raise in the middle of a forward. So must batches over the
    largest row tile, or over the configured limit."""
    from vllm_bdlora.kernels.lora_op import one_launch_plan
    from vllm_bdlora.kernels.plans import DEFAULT_MAX_MIXED_WIDTH, layer_state_words, state_words, table_for

    table = table_for("NVIDIA H200", 132)
    shape = (1536, 4096, 96, 1, 3)  # qkv_proj at TP=4, r'=128, one slot
    plan = table.decode_plan(1536, 4096, 96, 1, 16, 1)
    assert plan.stream_k  # its partial sums make the state larger than a whole-block plan's
    limits = (64, DEFAULT_MAX_MIXED_WIDTH)
    made_for_it = torch.zeros(layer_state_words(table, *shape, DEFAULT_MAX_MIXED_WIDTH), dtype=torch.int32)
    whole_blocks = torch.zeros(state_words(96, None), dtype=torch.int32)
    assert one_launch_plan(table, 1, *shape, made_for_it, *limits) == plan  # the one the op launches
    assert one_launch_plan(table, 32, *shape, made_for_it, *limits) == table.decode_plan(1536, 4096, 96, 1, 32, 1)
    assert one_launch_plan(table, 1, *shape, whole_blocks, *limits) is None
    for tokens in (16, 32, 64):  # the layer's state serves every tile's plan
        assert one_launch_plan(table, tokens, *shape, made_for_it, *limits) is not None
    assert one_launch_plan(table, 65, *shape, made_for_it, *limits) is None  # over the largest tile
    assert one_launch_plan(table, 16, *shape, made_for_it, 16, DEFAULT_MAX_MIXED_WIDTH) is not None
    assert one_launch_plan(table, 17, *shape, made_for_it, 16, DEFAULT_MAX_MIXED_WIDTH) is None  # the setting


def test_a_multi_slot_layer_takes_the_one_launch_kernel_only_while_its_token_rows_are_narrow():
    """After the kernel's barrier each token row of a multi-slot layer gathers its own adapter's B, so its cost
    follows the rows' width: such a layer hands batches over to the three kernels once t tokens x its LoRA
    columns per slice pass the "one_launch_max_mixed_width" setting, whether or not the rows' adapters repeat.
    One slot: unaffected."""
    from vllm_bdlora.kernels.lora_op import one_launch_plan
    from vllm_bdlora.kernels.plans import DEFAULT_MAX_MIXED_WIDTH, layer_state_words, mixed_batch_limit, table_for

    assert DEFAULT_MAX_MIXED_WIDTH == 128
    limits = {(slots, width): mixed_batch_limit(slots, width, 128) for slots in (1, 4) for width in
              (8, 32, 64, 128, 256)}  # fmt: skip
    assert limits == {(1, 8): 64, (1, 32): 64, (1, 64): 64, (1, 128): 64, (1, 256): 64,
                      (4, 8): 16, (4, 32): 4, (4, 64): 2, (4, 128): 1, (4, 256): 0}  # fmt: skip
    assert mixed_batch_limit(4, 128, 1024) == 8  # four slots: their adapters repeat, the rows still count
    assert mixed_batch_limit(4, 8, 1 << 30) == 16  # a multi-slot layer's one tile
    table = table_for("NVIDIA H200", 132)
    qkv = (6144, 4096, 3 * 128, 4)  # TP=1 qkv_proj, BD r'=128, 4 slots: 128 columns per slice
    state = torch.zeros(layer_state_words(table, *qkv, 3, 1 << 30), dtype=torch.int32)
    assert one_launch_plan(table, 2, *qkv, 3, state, 64, 256) is not None
    assert one_launch_plan(table, 3, *qkv, 3, state, 64, 256) is None
    assert one_launch_plan(table, 1, *qkv, 1, state, 64, 256) is None  # one slice 384 wide: over the limit alone
    assert one_launch_plan(table, 16, *qkv, 3, state, 64, 1 << 30) is not None
    assert one_launch_plan(table, 17, *qkv, 3, state, 64, 1 << 30) is None  # a multi-slot layer's one tile


def test_a_multi_slot_layer_limits_the_adapters_a_one_launch_batch_may_mix():
    """Where a layer's batches could mix more than "one_launch_max_adapters" adapters (one per token, at most one
    per slot), its row width admits no more tokens than that; by default (16, a multi-slot tile's rows) only the
    width limit applies."""
    from vllm_bdlora.kernels.plans import (
        DEFAULT_MAX_MIXED_ADAPTERS,
        DEFAULT_MAX_MIXED_WIDTH,
        mixed_batch_limit,
        mixed_width_limit,
    )

    assert DEFAULT_MAX_MIXED_ADAPTERS == 16

    def tokens(slots, width, max_adapters=DEFAULT_MAX_MIXED_ADAPTERS):
        return mixed_batch_limit(slots, width, mixed_width_limit(DEFAULT_MAX_MIXED_WIDTH, max_adapters, width,
                                                                 slots))  # fmt: skip

    assert tokens(12, 8) == 16  # TP=4, BD r'=32, 12 slots: every batch of a multi-slot tile
    assert tokens(12, 16) == 8  # TP=4, BD r'=64
    assert tokens(8, 32) == tokens(4, 32) == 4  # TP=4, BD r'=128 (or TP=1, r'=32)
    assert tokens(4, 128) == 1  # TP=1, BD r'=128
    assert tokens(4, 512) == 0  # one row alone is over the configured width
    assert tokens(1, 512) == 64  # one slot: every tile
    assert tokens(12, 8, max_adapters=4) == 4  # four tokens mix four adapters at most
    assert tokens(4, 8, max_adapters=4) == 16  # four slots: no batch mixes more than four
    assert tokens(12, 8, max_adapters=0) == 0  # multi-slot layers on the three kernels
    assert mixed_width_limit(DEFAULT_MAX_MIXED_WIDTH, 4, 8, 12) == 32


def test_multi_slot_plans_are_sized_for_the_adapters_a_batch_may_mix():
    """Plans are looked up for the adapters a batch may mix: one per token, at most one per slot, and at most as
    many as the mixed-adapter limit lets it; the layer's plans (what warm_up compiles and the state is sized for)
    are those of each batch size; larger tiles serve one-slot layers only."""
    from tests.test_kernels_plans import TABLES, load
    from vllm_bdlora.kernels.plans import (
        batch_adapters,
        batch_plan,
        layer_plans,
        layer_state_words,
        state_words,
        table_for,
    )

    table = table_for("NVIDIA H200", 132)
    assert [batch_adapters(4, width, 256) for width in (32, 64, 128, 256, 512)] == [4, 4, 2, 1, 1]
    assert batch_adapters(1, 512, 256) == 1 and batch_adapters(32, 8, 256) == 16  # one per token
    gate_up = (28672, 4096, 2 * 128, 4)  # out, hidden, LoRA width (both slices), slots
    one, two = (table.decode_plan(*gate_up, 16, adapters) for adapters in (1, 2))
    assert table.decode_plan(*gate_up, 32, 1) is None  # larger tiles stay one-slot only
    assert batch_plan(table, *gate_up, 2, 2, 256) == two
    assert batch_plan(table, *gate_up, 1, 2, 256) == one  # one token: one adapter
    assert batch_plan(table, *gate_up, 2, 1, 256) == one  # read as one slice 256 wide: one token at most
    assert layer_plans(table, *gate_up, 2, 256) == ({1: one, 2: two} if one != two else {1: one})
    assert layer_state_words(table, *gate_up, 2, 256) == max(state_words(256, p) for p in (one, two))
    every_slot = table.decode_plan(*gate_up, 16, 4)
    assert batch_plan(table, *gate_up, 16, 2, 1 << 30) == every_slot
    assert table.decode_plan(*gate_up, 16, 9) == table.decode_plan(*gate_up, 16, 8)  # more than the table holds
    # a batch that may mix adapters finishes with its rows gathering B; one adapter (or one slot) with a tl.dot,
    # and the layer's plans (what warm_up compiles) hold both finishes
    assert (one.row_gather, two.row_gather, every_slot.row_gather) == (False, True, True)
    assert not table.decode_plan(28672, 4096, 256, 1, 16, 1).row_gather
    assert {p.row_gather for p in layer_plans(table, *gate_up, 2, 256).values()} == {False, True}
    for path in TABLES:  # not a table choice
        assert not any(plan.row_gather for plan in load(path).decode.values() if plan), path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_only_16_bit_layers_over_an_unquantized_base_take_the_one_launch_kernel(dtype):
    """Decode plans size their pipeline stages for 16-bit X and W; a float32 layer would need twice the shared
    memory and fail to compile mid-serving, so the layer op keeps its other path. DoRA layers compose on the base
    output, which the kernel never materialises: they keep it too."""
    from vllm_bdlora.kernels.lora_op import takes_one_launch

    weight, state = torch.zeros(4, 4, dtype=dtype), torch.zeros(8, dtype=torch.int32)
    assert takes_one_launch(state, weight, None) == (dtype != torch.float32)
    assert not takes_one_launch(state, weight, torch.ones(1, 4))
    assert not takes_one_launch(None, weight, None) and not takes_one_launch(state, None, None)


KERNEL_CHECK = """
import sys, torch
from dataclasses import replace
from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch
from vllm_bdlora.kernels.decode_lora import decode_lora_linear, new_decode_state
from vllm_bdlora.kernels.plans import (DECODE_MAX_TOKENS, DEFAULT_MAX_MIXED_WIDTH, batch_plan, cuda_table, make_plan,
                                       row_tile, state_words, whole_block_step)
from vllm_bdlora.kernels.reference import lora_linear_slices_reference
device, dtype, tol = sys.argv[1], getattr(torch, sys.argv[2]), float(sys.argv[5])
phases, hidden, kind = int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
spread = kind.endswith("+spread")  # the shrink's programs numbered among the GEMV's (spread_shrink)
kind = kind.removesuffix("+spread")
one_slot = kind.endswith("+one-slot")  # a layer of one LoRA slot: its finish takes one tl.dot, not a gather
kind = kind.removesuffix("+one-slot")


def plan_of(b, tokens):
    # Forced plans: several programs share the shrink, the output columns and (stream-K) each block's hidden
    # steps, the runs crossing from one column block into the next
    out_features, total_width, tile = b["weight"].shape[0], b["lora_a"].shape[1], row_tile(tokens)
    block_k = min(64 if hidden < 1024 else 256, whole_block_step(16, tile))
    if kind == "stream_k":  # in larger tiles, S's chunks split as below
        plan = make_plan(out_features, hidden, total_width, 6 if tile > 16 else 3, block_n=16, block_k=block_k,
                         stream_k=True, gemv_programs=7, block_m=tile, shrink_columns=32 if tile > 16 else 0)
        assert plan.steps_per_program % -(-hidden // block_k), plan
    elif kind == "whole":
        # larger tiles: S in chunks of 32 columns (the last past the width), each chunk its own shrink
        # programs, which split the hidden dimension two ways
        plan = make_plan(out_features, hidden, total_width, 6 if tile > 16 else 3, block_n=16, block_k=block_k,
                         stream_k=False, block_m=tile, shrink_columns=32 if tile > 16 else 0)
        assert tile == 16 or (plan.shrink_groups, plan.chunks) == (3, 6), plan
    else:  # the GPU's plan table's (tiles over 16 rows serve one-slot layers only)
        plan = batch_plan(cuda_table(device), out_features, hidden, total_width,
                          len(SLOT_WIDTHS[0]) if tile == 16 else 1, tile, 3, DEFAULT_MAX_MIXED_WIDTH)
    assert plan.gemv_programs > 1 and plan.chunks > 1 and plan.block_m == tile, plan
    if kind != "default":  # finish as a layer's table plan would: rows gather B where the batch may mix adapters
        plan = replace(plan, row_gather=not one_slot and tile == 16 and tokens > 1)
    return replace(plan, spread_shrink=True) if spread else plan


# One state through batches whose tiles change both ways (16, 64, 32 rows...), as a layer's decode steps do:
# every call must find zeros in the S rows it adds into, whatever tile the call before the last one used
sizes = (1, 5, 64, 16, 40, 3, 33, 64, 1)
for call, tokens in enumerate(sizes):
    b = mixed_batch(tokens=tokens, hidden=hidden, dtype=dtype, device=device, seed=tokens)
    if tokens > 1:
        b["slots"][1] = 99  # a stale slot number past the buffers (graph padding rows): no adapter, no fault
    total_width = b["lora_a"].shape[1]
    if call == 0:  # the layer's: made for the largest of its plans
        state = new_decode_state(total_width, device, max((plan_of(b, tile) for tile in (1, 32, 64)),
                                                          key=lambda plan: state_words(total_width, plan)))
    slots = b["slots"].clone()
    if call % 3 == 2:  # one adapter among the tokens that have one (most decode steps), some tokens without
        slots[(slots >= 0) & (slots < len(SLOT_WIDTHS[0]))] = call % len(SLOT_WIDTHS[0])
    else:
        slots[torch.arange(tokens, device=device) % 5 == call % 5] = call % len(SLOT_WIDTHS[0])
    if call == len(sizes) - 1:
        slots[0] = 99  # a batch whose only slot is stale: no adapter, nothing read past the buffers
    if one_slot:  # slot 1's adapter alone (its widths differ per slice), in slot 0
        for name in ("lora_a", "lora_b", "widths"):
            b[name] = b[name][1:2] if name != "widths" else b[name][:, 1:2]
        slots = torch.where(slots == 1, 0, torch.where(slots == 99, 99, -1))
    want = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                        slots, b["bias"] if call % 2 else None)
    out = torch.full_like(want, float("nan"))
    decode_lora_linear(out, b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], slots, state,
                       b["bias"] if call % 2 else None, plan=plan_of(b, tokens), phases=phases)
    err = (out.double() - want.double()).abs().max().item()
    assert err <= tol * (1 + want.double().abs().max().item()), (tokens, call, err)
    s_words = DECODE_MAX_TOKENS * total_width
    following = 2 + ((call + 1) & 1) * s_words  # the S buffer the next call adds into: all zeros
    assert not state[following:following + s_words].any(), (tokens, call)
    assert not state[2 + 2 * s_words:].any(), (tokens, call)  # the partial sums too
    assert state[1].item() == tokens, state[1]  # the rows the call after next will zero
assert state[0].item() == len(sizes) << 16, state[0]  # arrivals reset, one epoch per call
print("ok")
"""


def run_kernel_check(device, dtype, phases, hidden, tol, interpret, kind):
    run_check_script(KERNEL_CHECK, (device, dtype, phases, hidden, tol, kind), interpret)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU host checks the compiled kernel instead; Triton 3.6's interpreter there cannot run kernels",
)
@pytest.mark.parametrize("kind", ["whole", "stream_k", "whole+spread", "stream_k+spread", "whole+one-slot"])
def test_kernel_in_interpreter_matches_reference(kind):
    run_kernel_check("cpu", "float32", 2, 200, 1e-4, True, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden", [272, 4096])  # a hidden size the GEMV's K step does not divide, and 8B's
@pytest.mark.parametrize("kind", ["whole", "stream_k", "default", "whole+spread", "stream_k+spread", "whole+one-slot"])
def test_kernel_with_in_kernel_barrier_matches_reference_on_gpu(dtype, hidden, kind):
    run_kernel_check("cuda", dtype, 1, hidden, 3e-2, False, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots_n", [(8, 4), (48, 1)])  # a 16-row tile; a 64-row tile (one-slot layers)
def test_layer_op_runs_the_one_launch_kernel_in_a_cuda_graph(monkeypatch, rows, slots_n):
    """The op as BD layers call it with their decode state, captured at `rows` rows and replayed 50 times with
    the slots (vLLM's per-step metadata) changing between replays: each replay right, none stalls."""
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.fused_lora import group_tokens
    from vllm_bdlora.kernels.lora_op import layer_decode_state

    launched = []
    real = decode_lora.decode_lora_linear
    monkeypatch.setattr(decode_lora, "decode_lora_linear", lambda *a, **k: launched.append(1) or real(*a, **k))
    b = mixed_batch(tokens=rows, hidden=512, dtype=torch.bfloat16, device="cuda")
    if slots_n == 1:  # the layer of a server with --max-loras 1: slot 0's adapter or none
        b.update(lora_a=b["lora_a"][:1].contiguous(), lora_b=b["lora_b"][:1].contiguous(),
                 widths=b["widths"][:, :1].contiguous(), slots=b["slots"].clamp(max=0))  # fmt: skip
    groups = group_tokens(b["slots"], slots_n)
    state = layer_decode_state(b["weight"].shape[0], 512, b["lora_a"].shape[1], slots_n, "cuda", 3, 256)
    out = torch.empty(rows, b["weight"].shape[0], dtype=torch.bfloat16, device="cuda")

    def step():
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"], groups.sorted_ids,
            groups.group_slot, groups.group_count, groups.group_start, torch.tensor([False]), None, b["bias"],
            b["weight"], state, 64, 256,
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


@pytest.mark.parametrize("block_m", [16, 64])
def test_the_benchmarks_candidate_plans_fit_the_tile_and_include_the_tables_and_the_default(block_m):
    """`bench.kernels.decode_lora --configs` times these on a GPU host: each must be a plan the kernel can run
    for the tile (every program resident), the table's entry and the structural default among them."""
    from bench.kernels.decode_lora import candidate_plans
    from vllm_bdlora.kernels.plans import default_decode_plan, table_for

    table = table_for("NVIDIA H200", 132)
    plans = candidate_plans(1536, 4096, 96, 1, 1, table, block_m)
    assert table.decode_plan(1536, 4096, 96, 1, block_m, 1) in plans
    assert default_decode_plan(1536, 4096, 96, 1, 132, block_m, 1) in plans
    assert all(plan.block_m == block_m and plan.programs <= 132 for plan in plans)
    assert any(plan.stream_k for plan in plans) and any(not plan.stream_k for plan in plans)
    assert len({(plan.block_n, plan.block_k, plan.stream_k) for plan in plans}) >= 4
