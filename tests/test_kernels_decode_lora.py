"""The one-launch decode kernel: its reference against a per-token loop (CPU), the kernel against the
reference in Triton's interpreter (CPU, the shrink as its own launch) and compiled with the in-kernel barrier
(GPU), over repeated calls (the state's S buffers alternate) and CUDA-graph replays."""

import dataclasses

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


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("out_features", [16, 1280, 1536, 2560, 4096, 7168, 8192, 14336, 28672, 33792])
@pytest.mark.parametrize("hidden", [1024, 3584, 4096, 8192, 14336])  # Llama-3.1-8B and -70B at TP 1-8
def test_plan_covers_the_layer_without_more_programs_than_sms(out_features, hidden, slots):
    """The barrier waits for every program: a grid larger than the SMs could wait on one never scheduled.
    Every output column and every hidden step of W is some GEMV program's, every hidden index some shrink
    program's, and no program is without work (it would still have to arrive)."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    plan = decode_plan(out_features, hidden, 96, slots, sms=132)
    assert plan.programs <= 132
    assert plan.tiles * plan.block_n >= out_features > (plan.tiles - 1) * plan.block_n
    k_steps = -(-hidden // plan.block_k)
    if plan.stream_k:
        total = plan.tiles * k_steps
        assert plan.gemv_programs * plan.steps_per_program >= total > (plan.gemv_programs - 1) * plan.steps_per_program
    else:
        assert plan.gemv_programs == plan.tiles and plan.steps_per_program == k_steps
    assert plan.chunks <= -(-hidden // plan.shrink_k)  # each shrink program gets at least one step
    assert plan.chunks >= min(32, 4 * slots, -(-hidden // plan.shrink_k))


def test_plan_takes_stream_k_where_whole_blocks_would_be_narrow_or_do_not_fit():
    """qkv_proj at TP=4 (1536 outputs) would need 16-column blocks to fill 124 SMs: stream-K over 32-column
    blocks instead; o_proj at TP=4 (4096 outputs: 128 blocks of 32), gate_up_proj at TP=4 (7168: 112 of 64) and
    qkv_proj at TP=1 (6144: 96 of 64) keep whole blocks; gate_up_proj at TP=1 (28672 outputs) fits none, and
    takes 128-column blocks, fewer for each program to finish after the barrier."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    qkv = decode_plan(1536, 4096, 96, 1, 132)
    assert qkv.stream_k and qkv.block_n == 32 and qkv.steps_per_program * 32 * qkv.block_k < 32 * 4096 / 2
    for (out_features, hidden, width), programs, block_n in (
        ((4096, 1024, 32), 128, 32),
        ((7168, 4096, 64), 112, 64),
        ((6144, 4096, 384), 96, 64),
    ):
        plan = decode_plan(out_features, hidden, width, 1, 132)
        assert not plan.stream_k and (plan.gemv_programs, plan.block_n) == (programs, block_n)
    wide = decode_plan(28672, 4096, 256, 1, 132)
    assert wide.stream_k and (wide.block_n, wide.block_k) == (128, 128)
    assert wide.tiles <= 2 * wide.gemv_programs  # at most 2 blocks to finish per program (3-4 of 64 columns)


def test_whole_block_programs_with_a_long_hidden_loop_pipeline_6_stages_deep():
    """archived H200 runs: in 16-row tiles 6 stages won where a program's hidden loop has 24 or more
    steps and lost or tied with 4-16; larger tiles, whose stages hold fewer steps, keep their own threshold."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    def steps_and_stages(out_features, hidden, width):
        plan = decode_plan(out_features, hidden, width, 1, 132)
        assert not plan.stream_k
        return -(-hidden // plan.block_k), plan.num_stages

    assert steps_and_stages(6144, 4096, 384) == (32, 6)  # qkv_proj at TP=1
    assert steps_and_stages(4096, 14336, 128) == (56, 6)  # down_proj at TP=1
    assert steps_and_stages(14336, 4096, 128) == (64, 6)  # gate_up_proj at TP=2
    assert steps_and_stages(4096, 7168, 64) == (28, 6)  # down_proj at TP=2
    assert steps_and_stages(4096, 4096, 128) == (16, 3)  # o_proj at TP=1: a short loop, 3
    assert steps_and_stages(4096, 3584, 32) == (14, 3)  # down_proj at TP=4


def test_short_loop_whole_block_plans_follow_what_ran_fastest_on_an_h200():
    """archived H200 runs: for one adapter, short-loop programs over 64-column blocks ran
    faster in 2 warps (70B o_proj at TP=8), over 32-column blocks at 3 stages where the LoRA is at most 128 wide;
    qkv_proj at TP=2 (192 wide) lost with 3, and batches mixing adapters were not measured: both keep 4 warps and
    4 stages, as do long loops (6 stages)."""
    from vllm_bdlora.kernels.decode_lora import batch_plan, decode_plan

    def warps_stages(out_features, hidden, width, slots=1, tokens=1):
        plan = batch_plan(out_features, hidden, width, slots, 132, tokens)
        assert not plan.stream_k
        return plan.block_n, plan.num_warps, plan.num_stages

    assert warps_stages(8192, 1024, 16) == (64, 2, 4)  # Llama-3.1-70B o_proj at TP=8
    assert warps_stages(8192, 3584, 16) == (64, 4, 6)  # its down_proj: a long loop
    for out_features, hidden, width in ((4096, 2048, 64), (4096, 512, 16), (4096, 1792, 16), (3584, 4096, 32)):
        assert warps_stages(out_features, hidden, width) == (32, 4, 3)  # o_proj TP=2, 8; down, gate_up TP=8
        assert warps_stages(out_features, hidden, width, slots=4, tokens=16)[1:] == (4, 4)  # adapters mixed
    # qkv_proj at TP=2 mixing adapters: whole blocks, 4 stages (one adapter: `_split_block_plan`)
    assert decode_plan(3072, 4096, 192, 4, 132, 16, 4).num_stages == 4
    mixed = batch_plan(3072, 4096, 192, 4, 132, 16, slices=3)
    assert (mixed.stream_k, mixed.block_n, mixed.num_warps, mixed.num_stages) == (False, 32, 4, 4)


def test_layers_whose_32_column_blocks_leave_a_quarter_of_the_sms_split_64_column_blocks_for_one_adapter():
    """archived H200 runs: qkv_proj at TP=2 (96 blocks of 32 on 132 SMs) ran ~1.2 µs faster
    as stream-K over 64x128 on the same 96 programs, for one adapter; mixing 4 adapters it lost, and layers whose
    32-column blocks fill more of the SMs (o_proj, down_proj: 128; gate_up_proj at TP=8: 112) keep whole blocks."""
    from vllm_bdlora.kernels.decode_lora import batch_plan

    for slots in (1, 4):
        plan = batch_plan(3072, 4096, 192, slots, 132, 1, slices=3)
        assert plan.stream_k and (plan.block_n, plan.block_k, plan.gemv_programs, plan.chunks) == (64, 128, 96, 32)
    assert not batch_plan(3072, 4096, 192, 4, 132, 4, slices=3).stream_k  # up to 4 adapters mixed
    for out_features, hidden, width in ((4096, 2048, 64), (4096, 1024, 32), (3584, 4096, 32)):
        assert not batch_plan(out_features, hidden, width, 1, 132, 1).stream_k


def test_narrow_stream_k_plans_pipeline_3_stages_deep_and_wide_ones_4():
    """archived H200 runs: narrow layers' stream-K programs run short stretches of the
    hidden dimension, which 3 stages ran faster (8B qkv_proj at TP=4 -0.2 to -0.6 µs); gate_up_proj at TP=1, whose
    programs run long, lost with 3 (archived H200 runs), so it keeps 4."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    for out_features, hidden, width in ((1536, 4096, 32), (768, 4096, 16), (1280, 8192, 16)):  # 8B TP=4, 8; 70B TP=8
        for slots in (1, 4):
            plan = decode_plan(out_features, hidden, width * 3, slots, 132)
            assert plan.stream_k and plan.block_m == 16 and plan.num_stages == 3
    wide = decode_plan(28672, 4096, 256, 1, 132)  # gate_up_proj at TP=1
    assert wide.stream_k and wide.num_stages == 4


@pytest.mark.parametrize("adapters", [1, 2, 4])
def test_narrow_multi_slot_layers_give_the_shrink_the_sms_16_column_blocks_would_leave(adapters):
    """archived H200 runs (narrow-*): with 4 slots, qkv_proj at TP=4/8 ran faster on 32 shrink
    programs than on 4 per adapter mixed; with one slot, TP=8 lost, so one-slot layers keep 4 per adapter."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    for out_features, hidden, width in ((1536, 4096, 96), (768, 4096, 48), (1280, 8192, 48)):  # 8B TP=4, 8; 70B TP=8
        plan = decode_plan(out_features, hidden, width, 4, 132, 16, adapters)
        assert plan.stream_k and plan.chunks == 32 and plan.programs <= 132
        one_slot = decode_plan(out_features, hidden, width, 1, 132)
        assert one_slot.stream_k and one_slot.chunks < 32


def test_narrow_layers_plans_follow_what_ran_fastest_on_an_h200():
    """archived H200 runs: Llama-3.1-70B's qkv_proj at TP=8 (1280 outputs, hidden 8192) ran ~20% faster
    as stream-K in 128-deep steps over 64 columns than in 256-deep steps over 32, which 8B's keeps at TP=4 (at TP=8,
    one slot, 64 x 128 since archived H200 runs); in
    64-row tiles whole 16-column blocks lost to stream-K where they leave SMs idle (TP=8: 48 blocks at 8B, 80 at
    70B) and keep qkv_proj at TP=4, where they fill as many SMs as stream-K would (96)."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    def kind(out_features, hidden, width, block_m):
        plan = decode_plan(out_features, hidden, width, 1, 132, block_m)
        return plan.stream_k, plan.block_n, plan.block_k

    for block_m in (16, 32, 64):
        assert kind(1280, 8192, 48, block_m) == (True, 64, 128)  # 70B qkv_proj at TP=8
    assert kind(1536, 4096, 96, 16) == (True, 32, 256)  # 8B qkv_proj at TP=4
    assert kind(768, 4096, 48, 16) == (True, 64, 128)  # at TP=8, one slot
    assert kind(768, 4096, 48, 64) == (True, 64, 128)
    assert kind(1536, 4096, 96, 64) == (False, 16, 128)


@pytest.mark.parametrize("slots", [1, 4])
def test_wide_layers_keep_stream_k_only_for_narrow_lora_widths(slots):
    """archived H200 runs: gate_up_proj at TP=1 (28672 outputs, no whole blocks fit) as stream-K beat
    the three kernels at BD r'=128 (total width 256) but ran 254 µs against their 130 at r'=512 (1024), no
    candidate plan below 151: wider LoRA keeps the three kernels. Layers with whole blocks keep the kernel."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    assert decode_plan(28672, 4096, 256, slots, 132).stream_k
    assert decode_plan(28672, 4096, 512, slots, 132) is None
    assert decode_plan(28672, 4096, 1024, slots, 132) is None
    assert not decode_plan(6144, 4096, 1536, slots, 132).stream_k  # qkv_proj at TP=1, r'=512: whole blocks


@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("hidden", [4096, 8192, 14336])
@pytest.mark.parametrize("out_features", [16, 1280, 1536, 2560, 4096, 7168, 14336, 28672])
def test_tiles_over_16_rows_in_one_slot_layers_only(out_features, hidden, block_m):
    """A batch mixing adapters runs slower in the larger tiles than on three kernels, so layers with several
    LoRA slots keep the three kernels above 16 tokens. Layers too wide for whole blocks keep them too (stream-K's
    partial sums for 64 rows would take megabytes); narrow ones take stream-K in 32-row tiles, and in 64-row tiles
    unless whole 16-column blocks would fill as many SMs; the rest whole blocks of 32-128 columns, 6 stages deep
    where the hidden loop is long.
    The stages must fit in an H100's 227 kB of shared memory with room to spare."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    assert decode_plan(out_features, hidden, 96, 4, 132, block_m) is None
    plan = decode_plan(out_features, hidden, 96, 1, 132, block_m)
    if out_features > 128 * (132 - 4):
        assert plan is None  # gate_up_proj at TP=1: no whole blocks fit
        return
    assert plan.block_m == block_m and plan.programs <= 132
    blocks_of_16 = -(-out_features // 16)
    narrow = blocks_of_16 <= 132 - plan.chunks
    fills_stream_k_programs = blocks_of_16 >= 0.9 * (132 - plan.chunks)
    assert plan.stream_k == (narrow and (block_m == 32 or not fills_stream_k_programs))
    if plan.stream_k:
        assert plan.block_n == 64 and plan.steps_per_program * plan.gemv_programs >= plan.tiles * hidden // plan.block_k
    else:
        assert plan.block_n == 16 if narrow else 32 <= plan.block_n <= 128
        assert plan.gemv_programs * plan.block_n >= out_features
    stage = (block_m + plan.block_n) * plan.block_k * 2
    assert stage * plan.num_stages <= 160 * 1024
    assert plan.num_stages == (6 if not plan.stream_k and -(-hidden // plan.block_k) >= 48 and 6 * stage <= 150 * 1024
                               else 4)  # fmt: skip


def test_shrink_programs_split_a_wide_s_between_them_in_large_tiles():
    """qkv_proj at TP=1 (S 384 wide) in 64-row tiles computes S 128 columns at a time: rather than every
    shrink program adding all three chunks into S (each element added to by every program), each chunk has a
    third of the programs, each over a longer share of the hidden dimension. Narrow S keeps one group."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    wide = decode_plan(6144, 4096, 384, 1, 132, 64)
    assert wide.shrink_columns == 128 and wide.shrink_groups == 3
    assert wide.chunks % 3 == 0 and wide.chunks // 3 <= -(-4096 // wide.shrink_k) and wide.programs <= 132
    assert decode_plan(6144, 4096, 384, 1, 132, 16).shrink_groups == 1
    assert decode_plan(1536, 4096, 96, 1, 132, 64).shrink_groups == 1
    with pytest.raises(ValueError, match="do not split into 3 column groups"):
        dataclasses.replace(wide, chunks=wide.chunks + 1)


def test_a_decode_state_too_small_for_this_gpus_plan_sends_the_layer_to_three_kernels(monkeypatch):
    """A layer's state is sized for the plans of the GPU it was made on; on a GPU whose plan needs more (another
    SM count), the op must take the three-kernel path, not raise in the middle of a forward. So must batches
    over the largest row tile, or over the configured limit."""
    from vllm_bdlora.kernels import decode_lora

    monkeypatch.setattr(decode_lora, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    plan = decode_lora.plan_for(1536, 4096, 96, 1, cuda)
    assert plan.stream_k  # its partial sums make the state larger than a whole-block plan's
    made_for_it = torch.zeros(decode_lora.layer_state_words(1536, 4096, 96, 1, cuda), dtype=torch.int32)
    made_elsewhere = decode_lora.new_decode_state(
        96, "cpu", decode_lora.decode_plan(1536, 4096, 96, 1, 60)
    )  # whole blocks
    assert decode_lora.usable_plan(1, 1536, 4096, 96, 1, cuda, made_for_it) == plan  # the one the op launches
    assert decode_lora.usable_plan(32, 1536, 4096, 96, 1, cuda, made_for_it) == decode_lora.plan_for(
        1536, 4096, 96, 1, cuda, 32
    )  # fmt: skip
    assert decode_lora.usable_plan(1, 1536, 4096, 96, 1, cuda, made_elsewhere) is None
    for tokens in (16, 32, 64):  # the layer's state serves every tile's plan (32 rows: stream-K, more partials)
        assert decode_lora.usable_plan(tokens, 1536, 4096, 96, 1, cuda, made_for_it) is not None
    one_token_state = decode_lora.new_decode_state(96, "cpu", plan)  # too small for 32 rows
    assert decode_lora.usable_plan(32, 1536, 4096, 96, 1, cuda, one_token_state) is None
    assert decode_lora.usable_plan(65, 1536, 4096, 96, 1, cuda, made_for_it) is None  # over the largest tile
    decode_lora.set_max_tokens(16)  # the "one_launch_max_tokens" setting
    try:
        assert decode_lora.usable_plan(16, 1536, 4096, 96, 1, cuda, made_for_it) is not None
        assert decode_lora.usable_plan(17, 1536, 4096, 96, 1, cuda, made_for_it) is None
    finally:
        decode_lora.set_max_tokens(decode_lora.DECODE_MAX_TOKENS)


def test_a_multi_slot_layer_takes_the_one_launch_kernel_only_while_the_adapters_a_batch_may_mix_are_narrow(
    monkeypatch,
):
    """A batch of t tokens may mix min(t, slots) adapters; the kernel runs each one's shrink and B load on its
    own, so a layer with several slots hands batches over to the three kernels once the adapters they may mix
    are wider together (per slice) than the "one_launch_max_mixed_width" setting. One slot: unaffected."""
    from vllm_bdlora.kernels import decode_lora

    monkeypatch.setattr(decode_lora, "_sm_count", lambda index: 132)
    assert decode_lora.DEFAULT_MAX_MIXED_WIDTH == 256
    limits = {(slots, width): decode_lora.mixed_batch_limit(slots, width) for slots in (1, 4) for width in
              (32, 64, 128, 256, 512)}  # fmt: skip
    assert limits == {(1, 32): 64, (1, 64): 64, (1, 128): 64, (1, 256): 64, (1, 512): 64,
                      (4, 32): 16, (4, 64): 16, (4, 128): 2, (4, 256): 1, (4, 512): 0}  # fmt: skip
    assert decode_lora.mixed_batch_limit(4, 128, max_width=1024) == 16
    cuda = torch.device("cuda", 0)
    qkv = (6144, 4096, 3 * 128, 4)  # TP=1 qkv_proj, BD r'=128, 4 slots: 128 columns per slice
    assert decode_lora.usable_plan(2, *qkv, cuda, slices=3) is not None
    assert decode_lora.usable_plan(3, *qkv, cuda, slices=3) is None
    assert decode_lora.usable_plan(1, *qkv, cuda) is None  # read as one slice 384 wide: wider than the limit alone
    decode_lora.set_max_mixed_width(1 << 30)
    try:
        assert decode_lora.usable_plan(16, *qkv, cuda, slices=3) is not None
        assert decode_lora.usable_plan(17, *qkv, cuda, slices=3) is None  # a multi-slot layer's one tile
    finally:
        decode_lora.set_max_mixed_width(decode_lora.DEFAULT_MAX_MIXED_WIDTH)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 0"):
            decode_lora.set_max_mixed_width(bad)


def test_a_layers_plans_on_a_gpu_are_those_of_its_sm_count(monkeypatch):
    """warm_up and the decode state size take `layer_plans` (the device's SMs); the compile-time benchmark, on a
    machine without that GPU, `plans_on_sms`: the same plans for the same SM count, none off CUDA."""
    from vllm_bdlora.kernels import decode_lora

    monkeypatch.setattr(decode_lora, "_sm_count", lambda index: 132)
    for shape in ((4096, 1024, 48, 4, 3), (28672, 4096, 256, 1, 2), (1536, 4096, 96, 4, 3)):
        out_features, hidden, total_width, slots, slices = shape
        on_gpu = decode_lora.layer_plans(out_features, hidden, total_width, slots, "cuda", slices)
        assert on_gpu == decode_lora.plans_on_sms(out_features, hidden, total_width, slots, 132, slices)
        assert on_gpu and decode_lora.layer_plans(out_features, hidden, total_width, slots, "cpu", slices) == {}


def test_multi_slot_plans_are_sized_for_the_adapters_a_batch_may_mix(monkeypatch):
    """Shrink programs are sized per adapter a batch may mix: one per token, at most one per slot, and at most as
    many as the mixed-adapter limit lets it. With 4 slots at TP=1, r'=128 (128 columns per slice) the limit serves
    batches of at most 2 tokens: gate_up_proj's stream-K plan takes the shrink programs of 2 adapters, and its GEMV
    the SMs the other two would have taken; a one-token batch takes a one-slot layer's plan. The state, warm-up,
    the launch's default plan and `usable_plan` all follow the same plans; lifting the limit brings back the plan for
    every slot from 4 tokens on."""
    from vllm_bdlora.kernels import decode_lora

    monkeypatch.setattr(decode_lora, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert [decode_lora.batch_adapters(4, width) for width in (32, 64, 128, 256, 512)] == [4, 4, 2, 1, 1]
    assert decode_lora.batch_adapters(1, 512) == 1 and decode_lora.batch_adapters(32, 8) == 16  # one per token
    gate_up = (28672, 4096, 2 * 128, 4)  # out, hidden, LoRA width (both slices), slots
    every_slot = decode_lora.decode_plan(*gate_up, 132)
    two = decode_lora.decode_plan(*gate_up, 132, 16, 2)
    assert two.chunks < every_slot.chunks and two.gemv_programs > every_slot.gemv_programs and two.programs <= 132
    assert decode_lora.decode_plan(*gate_up, 132, 16, 4) == every_slot
    assert decode_lora.decode_plan(*gate_up, 132, 32, 1) is None  # larger tiles stay one-slot only
    assert decode_lora.plan_for(*gate_up, cuda, 2, 2) == two
    one = decode_lora.decode_plan(*gate_up, 132, 16, 1)
    assert decode_lora.plan_for(*gate_up, cuda, 1, 2) == one != two  # one token: one adapter
    assert decode_lora.plan_for(*gate_up, cuda, 2) == one  # read as one slice 256 wide: one token at most
    assert decode_lora.layer_plans(*gate_up, cuda, 2) == {1: one, 2: two}  # what warm_up launches
    assert decode_lora.layer_state_words(*gate_up, cuda, 2) == max(decode_lora.state_words(256, p) for p in (one, two))
    launched = {}
    monkeypatch.setattr(decode_lora, "launch", lambda kernel, grid, *args, **kwargs: launched.update(args=args))
    x = torch.zeros(2, 4096, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    decode_lora.decode_lora_linear(
        torch.zeros(2, 28672, dtype=torch.bfloat16), x, torch.zeros(28672, 4096, dtype=torch.bfloat16),
        torch.zeros(4, 256, 4096, dtype=torch.bfloat16), torch.zeros(4, 28672, 128, dtype=torch.bfloat16),
        torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 14336, 28672], dtype=torch.int32),
        torch.zeros(2, dtype=torch.long), torch.zeros(decode_lora.state_words(256, two), dtype=torch.int32),
    )  # fmt: skip
    gemv = (two.tiles, two.gemv_programs, two.steps_per_program)
    assert launched["args"][14:17] == gemv != (one.tiles, one.gemv_programs, one.steps_per_program)
    # the launch's own plan: the one `usable_plan` checked
    decode_lora.set_max_mixed_width(1 << 30)
    try:
        assert decode_lora.plan_for(*gate_up, cuda, 16, 2) == every_slot
        assert list(decode_lora.layer_plans(*gate_up, cuda, 2)) == [1, 2, 3, 4]
    finally:
        decode_lora.set_max_mixed_width(decode_lora.DEFAULT_MAX_MIXED_WIDTH)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_only_16_bit_layers_take_the_one_launch_kernel(monkeypatch, dtype):
    """Decode plans size their pipeline stages (up to 6 in 32/64-row tiles) for 16-bit X and W; a float32 layer
    would need twice the shared memory and fail to compile mid-serving, so the layer op keeps its other path."""
    from tests.test_kernels_fused_lora import mixed_batch
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.fused_lora import fused_lora_slices_
    from vllm_bdlora.kernels.reference import lora_linear_slices_reference

    launched = []
    monkeypatch.setattr(decode_lora, "usable_plan", lambda *args: "plan")  # as on a GPU with the SMs for the grid
    monkeypatch.setattr(decode_lora, "decode_lora_linear", lambda *args, **kwargs: launched.append(args))
    b = mixed_batch(tokens=8, hidden=64, dtype=dtype)
    out = torch.zeros(8, b["weight"].shape[0], dtype=dtype)
    fused_lora_slices_(out, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"],
                       weight=b["weight"], decode_state=torch.zeros(64, dtype=torch.int32))  # fmt: skip
    assert bool(launched) == (dtype == torch.bfloat16)
    assert all(args[-1] == "plan" for args in launched)  # the plan usable_plan found is the one launched
    if not launched:
        want = lora_linear_slices_reference(b["x"], b["weight"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                            b["slots"])  # fmt: skip
        torch.testing.assert_close(out, want)


KERNEL_CHECK = """
import sys, torch
from dataclasses import replace
from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch
from vllm_bdlora.kernels.decode_lora import (DECODE_MAX_TOKENS, decode_lora_linear, make_plan, new_decode_state,
                                             plan_for, row_tile, state_words, whole_block_step)
from vllm_bdlora.kernels.reference import lora_linear_slices_reference
device, dtype, tol = sys.argv[1], getattr(torch, sys.argv[2]), float(sys.argv[5])
phases, hidden, kind = int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
spread = kind.endswith("+spread")  # the shrink's programs numbered among the GEMV's (spread_shrink)
kind = kind.removesuffix("+spread")


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
    else:  # the planner's own choice (tiles over 16 rows are planned for one-slot layers only)
        plan = plan_for(out_features, hidden, total_width, len(SLOT_WIDTHS[0]) if tile == 16 else 1, device, tile)
    assert plan.gemv_programs > 1 and plan.chunks > 1 and plan.block_m == tile, plan
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
@pytest.mark.parametrize("kind", ["whole", "stream_k", "whole+spread", "stream_k+spread"])
def test_kernel_in_interpreter_matches_reference(kind):
    run_kernel_check("cpu", "float32", 2, 200, 1e-4, True, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden", [272, 4096])  # a hidden size the GEMV's K step does not divide, and 8B's
@pytest.mark.parametrize("kind", ["whole", "stream_k", "default", "whole+spread", "stream_k+spread"])
def test_kernel_with_in_kernel_barrier_matches_reference_on_gpu(dtype, hidden, kind):
    run_kernel_check("cuda", dtype, 1, hidden, 3e-2, False, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots_n", [(8, 4), (48, 1)])  # a 16-row tile; a 64-row tile (one-slot layers)
def test_layer_op_runs_the_one_launch_kernel_in_a_cuda_graph(monkeypatch, rows, slots_n):
    """The op as BD layers call it with their decode state, captured at `rows` rows and replayed 50 times with
    the slots (vLLM's per-step metadata) changing between replays: each replay right, none stalls."""
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.decode_lora import layer_decode_state
    from vllm_bdlora.kernels.fused_lora import group_tokens

    launched = []
    real = decode_lora.decode_lora_linear
    monkeypatch.setattr(decode_lora, "decode_lora_linear", lambda *a, **k: launched.append(1) or real(*a, **k))
    b = mixed_batch(tokens=rows, hidden=512, dtype=torch.bfloat16, device="cuda")
    if slots_n == 1:  # the layer of a server with --max-loras 1: slot 0's adapter or none
        b.update(lora_a=b["lora_a"][:1].contiguous(), lora_b=b["lora_b"][:1].contiguous(),
                 widths=b["widths"][:, :1].contiguous(), slots=b["slots"].clamp(max=0))  # fmt: skip
    groups = group_tokens(b["slots"], slots_n)
    state = layer_decode_state(b["weight"].shape[0], 512, b["lora_a"].shape[1], slots_n, "cuda")
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


@pytest.mark.parametrize("block_m", [16, 64])
def test_the_benchmarks_candidate_plans_fit_the_tile_and_include_the_default(block_m):
    """`bench.kernels.decode_lora --configs` times these on a GPU host: each must be a plan the kernel can run
    for the tile (every program resident), and the default among them; in 16-row tiles also a 4-slot layer's
    plans sized for 1, 2 and 4 adapters mixed."""
    from bench.kernels.decode_lora import candidate_plans, sized_for_adapters
    from vllm_bdlora.kernels.decode_lora import decode_plan

    plans = candidate_plans(1536, 4096, 96, 1, 132, block_m)
    assert decode_plan(1536, 4096, 96, 1, 132, block_m) in plans
    sized = [decode_plan(1536, 4096, 96, 4, 132, 16, adapters) for adapters in (1, 2, 4)]
    assert all((plan in plans) == (block_m == 16) for plan in sized)
    assert len(set(sized_for_adapters(28672, 4096, 256, 132).values())) == 3  # gate_up_proj at TP=1: 4, 8, 16 shrink
    assert all(plan.block_m == block_m and plan.programs <= 132 for plan in plans)
    assert any(plan.stream_k for plan in plans)
    assert len({(plan.block_n, plan.block_k, plan.stream_k) for plan in plans}) >= 4


def test_s28_plan_changes_stay_within_the_lora_widths_they_were_timed_at():
    """archived H200 runs: each plan change was timed at BD r'=128 (16-192 columns per GPU); wider LoRA
    keeps the plans it ran before (4 warps, 4 stages, whole 32-column blocks) rather than untimed ones."""
    from vllm_bdlora.kernels.decode_lora import decode_plan

    def shape_of(out_features, hidden, width):
        plan = decode_plan(out_features, hidden, width, 1, 132)
        return plan.stream_k, plan.block_n, plan.num_warps, plan.num_stages

    assert shape_of(1536, 4096, 96) == (True, 32, 4, 3)  # qkv_proj at TP=4, r'=128
    assert shape_of(1536, 4096, 384) == (True, 32, 4, 4)  # ... r'=512
    assert shape_of(3072, 4096, 192) == (True, 64, 4, 4)  # qkv_proj at TP=2, r'=128: split blocks
    assert shape_of(3072, 4096, 768) == (False, 32, 4, 4)  # ... r'=512: whole blocks
    assert shape_of(4096, 2048, 64) == (False, 32, 4, 3)  # o_proj at TP=2, r'=128
    assert shape_of(4096, 2048, 256) == (False, 64, 4, 4)  # ... r'=512 (64-column blocks: no 2 warps either)
    assert shape_of(8192, 1024, 16) == (False, 64, 2, 4)  # Llama-3.1-70B o_proj at TP=8, r'=128
    assert shape_of(8192, 1024, 256) == (False, 64, 4, 4)  # ... LoRA 256 wide


def test_one_slot_narrow_layers_of_few_outputs_stream_64_column_blocks():
    """archived H200 runs: 8B qkv_proj at TP=8 (768 outputs) ran ~0.47 µs faster over 64x128 than
    32x256 with one slot, and lost with 4 slots; at TP=4 (1536 outputs) 64 columns lost before."""
    from vllm_bdlora.kernels.decode_lora import batch_plan

    def blocks(out_features, width, slots, tokens=1):
        plan = batch_plan(out_features, 4096, width, slots, 132, tokens, 3)
        assert plan.stream_k
        return plan.block_n, plan.block_k

    assert blocks(768, 48, 1) == blocks(768, 48, 1, 16) == (64, 128)
    assert blocks(768, 48, 4) == blocks(768, 48, 4, 16) == (32, 256)
    assert blocks(1536, 96, 1) == (32, 256)
    assert blocks(768, 192, 1) == (32, 256)  # r'=512 at TP=8: not timed with 64 x 128


def test_long_loop_whole_block_plans_spread_the_shrink_programs_among_the_gemvs():
    """Archived H200 runs: whole-block plans streaming long hidden loops (6 stages) beside 16 or more
    shrink programs ran faster with those numbered among the GEMV's, in 16-row tiles; plans with 4 shrink programs,
    short loops and stream-K did not, and were kept; the rule holds up to BD r'=128's widest LoRA (384 columns)."""
    from vllm_bdlora.kernels.decode_lora import batch_plan

    def spread(out_features, hidden, width, slots=1, tokens=1, slices=1):
        plan = batch_plan(out_features, hidden, width, slots, 132, tokens, slices)
        return plan.spread_shrink, plan.stream_k, plan.gemv_programs, plan.chunks

    assert spread(6144, 4096, 384, slices=3) == (True, False, 96, 32)  # qkv_proj at TP=1
    assert spread(14336, 4096, 128, slices=2) == (True, False, 112, 20)  # gate_up_proj at TP=2
    assert spread(7168, 4096, 64, slices=2) == (True, False, 112, 20)  # ... at TP=4
    assert spread(4096, 7168, 64, slots=4, tokens=16)[:2] == (True, False)  # down_proj at TP=2, 4 adapters mixed
    assert spread(4096, 14336, 128) == (False, False, 128, 4)  # down_proj at TP=1: 4 shrink programs
    assert spread(3584, 4096, 32, slices=2)[0] is False  # gate_up_proj at TP=8: a short loop
    assert spread(3072, 4096, 192, slices=3)[:2] == (False, True)  # qkv_proj at TP=2: stream-K
    assert spread(28672, 4096, 256, slices=2)[:2] == (False, True)  # gate_up_proj at TP=1: stream-K
    assert spread(14336, 4096, 512, slices=2)[0] is False  # r'=512 at TP=2: not timed
    assert not batch_plan(4096, 14336, 128, 1, 132, 64).spread_shrink  # 64-row tiles: not timed
