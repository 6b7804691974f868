"""The layer op BD layers call: `torch.ops.vllm_bdlora.fused_lora_slices_`, its path choice and its warm-up.

Per call it picks one of three paths for a packed layer (all slices at once):

* decode-sized batches over an unquantized 16-bit base, with the layer's decode state: the one-launch kernel
  (decode_lora.py), base GEMV, shrink and expand in one launch, under the plan the GPU's table gives the batch;
* otherwise the routed shrink, then the fused expand after the base GEMM, or (packed layers, ranges of the plan
  table marked `delta_first`) the expand writing the delta and cuBLAS accumulating X·Wᵀ onto it (fused_lora.py);
* CPU tensors: the torch reference (reference.py).

Every variant a layer can launch is compiled on its first call (`warm_up`), so serving never compiles one for a
new batch size.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from vllm_bdlora.kernels import decode_lora
from vllm_bdlora.kernels.compile_ahead import compile_concurrently, compile_threads
from vllm_bdlora.kernels.fused_lora import TokenGroups, delta_then_gemm, fused_expand, group_tokens, lora_shrink
from vllm_bdlora.kernels.op_library import define_op
from vllm_bdlora.kernels.plans import (
    PlanTable,
    batch_plan,
    cuda_table,
    launch_variants,
    layer_plans,
    layer_state_words,
    mixed_batch_limit,
    state_words,
)
from vllm_bdlora.kernels.triton_cache import CACHE_DIR_ENV, plugin_cache_dir

logger = logging.getLogger("vllm.bdlora")


def layer_decode_state(out_features: int, hidden: int, total_width: int, slots: int, device, slices: int,
                       max_mixed_width: int) -> torch.Tensor | None:  # fmt: skip
    """A layer's barrier words, S buffers and partial sums, enough for every plan it may launch on this CUDA
    device: int32, zero. None off CUDA."""
    table = cuda_table(device)
    if table is None:
        return None
    words = layer_state_words(table, out_features, hidden, total_width, slots, slices, max_mixed_width)
    return torch.zeros(words, dtype=torch.int32, device=device)


def one_launch_plan(table: PlanTable, tokens: int, out_features: int, hidden: int, total_width: int, slots: int,
                    slices: int, state: torch.Tensor, max_tokens: int, max_mixed_width: int):  # fmt: skip
    """The plan the op launches the one-launch kernel with for a batch of `tokens`, or None where it keeps the
    three-kernel path: over the token or mixed-adapter limit, no plan, or a decode state too small for the plan
    (a state made for another GPU's plans: the layer keeps the three kernels rather than fail)."""
    if tokens > min(max_tokens, mixed_batch_limit(slots, total_width // slices, max_mixed_width)):
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    plan = batch_plan(table, out_features, hidden, total_width, slots, tokens, slices, max_mixed_width)
    if plan is None or state.numel() < state_words(total_width, plan):
        return None
    return plan


def takes_one_launch(decode_state, weight, scale_table) -> bool:
    """Whether a layer's call may run the one-launch kernel: it has a decode state and an unquantized 16-bit base
    weight (decode plans size their pipeline stages for 16-bit X and W), and no DoRA compose (which needs the base
    output the kernel never materialises)."""
    return decode_state is not None and weight is not None and scale_table is None and weight.element_size() == 2


_warmed_up: set[int] = set()


def warm_up(x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias, delta_first_layer,
            decode_weight=None, max_mixed_width: int = 0, plan_slots: int = 0) -> int:  # fmt: skip
    """Compile every kernel variant a layer of this shape can launch, on a few rows of scratch data, so
    that no batch size compiles one while serving (a compile stalls every request in the batch for about
    a second). Once per layer (keyed by its LoRA buffer), outside CUDA-graph capture; compiled variants
    are shared by layers of equal shape and cached on disk by Triton, in one directory whatever vLLM's
    configuration (triton_cache.py). The variants compile on several threads first (compile_ahead.py).
    `decode_weight`: the layer runs the one-launch decode kernel over this base weight (a variant per plan it may
    launch, compiled here with a scratch state; `plan_slots`: the slots one batch may use, as the op's). Returns the
    launches made."""
    if lora_a.data_ptr() in _warmed_up or torch.cuda.is_current_stream_capturing():
        return 0
    _warmed_up.add(lora_a.data_ptr())
    started = time.perf_counter()
    variants = (cuda_table(x.device), x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias,
                delta_first_layer, decode_weight, max_mixed_width, plan_slots)  # fmt: skip
    threads = compile_threads()
    with plugin_cache_dir():
        on_threads = compile_concurrently(lambda: compile_variants(*variants), threads)  # launches nothing
        launches = compile_variants(*variants)
    seconds = time.perf_counter() - started
    if seconds > 1.0:  # compiled rather than found in Triton's caches: say where start-up time went
        logger.info(
            "vllm-bdlora: compiled the fused LoRA kernels for layers of %d slice(s), LoRA width %d, input %d "
            "(%d variants, %.1f s, %s); Triton caches them in %s for the next start.",
            slot_widths.shape[0], lora_b.shape[2], x.shape[1], launches, seconds,
            f"on {threads} threads" if on_threads else "one at a time",
            os.environ.get(CACHE_DIR_ENV, "its cache directory"),
        )  # fmt: skip
    return launches


def compile_variants(table: PlanTable, x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias,
                     delta_first_layer, decode_weight, max_mixed_width, plan_slots: int = 0) -> int:  # fmt: skip
    """warm_up's launches on scratch data, under `table`'s plans (the device's), the decode plans chosen for
    `plan_slots` slots a batch may use (0: every slot); returns how many."""
    rows = 16  # a multiple of 16 like most batches: the same integer specialisation as theirs
    slices, width, out_features = slot_widths.shape[0], lora_b.shape[2], lora_b.shape[1]
    scratch_x = x.new_zeros(rows, x.shape[1])
    scratch_y = x.new_zeros(rows, out_features)
    groups = group_tokens(torch.full((rows,), -1, dtype=torch.int32, device=x.device), n_groups - 1)
    ranges = table.prefill_ranges(out_features, x.shape[1], width, slices)
    shrinks, expands = launch_variants(ranges, delta_first_layer)
    shrunk_by_split = {}
    for config in shrinks:
        shrunk_by_split[config.split_k] = lora_shrink(scratch_x, lora_a, groups, slot_widths, config)
    for config, split_k, overwrite in expands:  # every split_k is one of the shrinks' (launch_variants)
        fused_expand(scratch_y, shrunk_by_split[split_k], lora_b, groups, slot_widths, slice_bounds, None,
                     scale_table, bias, config, overwrite)  # fmt: skip
    launches = len(shrinks) + len(expands)
    if decode_weight is None:
        return launches
    # out, hidden, width, and the slots a batch may use
    shape = (decode_weight.shape[0], x.shape[1], lora_a.shape[1], plan_slots or lora_a.shape[0])
    words = layer_state_words(table, *shape, slices, max_mixed_width)
    state = torch.zeros(words, dtype=torch.int32, device=x.device)
    for tokens, plan in layer_plans(table, *shape, slices, max_mixed_width).items():
        decode_lora.decode_lora_linear(
            x.new_zeros(tokens, out_features), x.new_zeros(tokens, x.shape[1]), decode_weight, lora_a, lora_b,
            slot_widths, slice_bounds, torch.full((tokens,), -1, dtype=torch.long, device=x.device), state, bias, plan,
        )  # fmt: skip
        launches += 1
    return launches


def fused_lora_slices_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_widths: torch.Tensor,
    slice_bounds: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_ids: torch.Tensor | None = None,
    group_slot: torch.Tensor | None = None,
    group_count: torch.Tensor | None = None,
    group_start: torch.Tensor | None = None,
    no_lora: torch.Tensor | None = None,
    scale_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    decode_state: torch.Tensor | None = None,
    one_launch_max_tokens: int = 0,
    one_launch_max_mixed_width: int = 0,
    plan_slots: int = 0,
) -> None:
    """In place on output (tokens, total height): each token's LoRA delta from its slot's adapter, all
    slices at once (lora_a (slots, slices·width, in), lora_b (slots, total height, width), the first
    slot_widths[j, slot] columns of slice j; vLLM has folded the scaling into B), or with scale_table the
    DoRA compose. Token slot -1: untouched. On CUDA the token groups (vLLM's LoRAKernelMeta tensors) are
    used; `no_lora`, a CPU flag as in vLLM's own ops, skips every LoRA launch when no token has an adapter.

    With `weight` (total height, in) the op runs the base GEMM too and output's contents are ignored:
    output = X·Wᵀ + bias + delta. With `decode_state` (the layer's `layer_decode_state`) too, batches of up to
    `one_launch_max_tokens` tokens (the plugin's settings, as are the mixed width) run all of it as one kernel
    where the plan table has a plan for them. `plan_slots`: the slots one batch may use (the adapters a step may
    run), where the layer has more (slots kept for fills ahead); plans and mixed-adapter limits are chosen for it.
    0: every slot."""
    tokens, slices = x.shape[0], slot_widths.shape[0]
    plan_slots = plan_slots or lora_a.shape[0]
    out_features, width = lora_b.shape[1], lora_b.shape[2]
    delta_first_layer = x.is_cuda and scale_table is None and slices > 1 and weight is not None
    one_launch = takes_one_launch(decode_state, weight, scale_table)
    if x.is_cuda and group_slot is not None:
        warm_up(x, lora_a, lora_b, slot_widths, slice_bounds, group_slot.shape[0], scale_table, bias, delta_first_layer,
                weight if one_launch else None, one_launch_max_mixed_width, plan_slots)  # fmt: skip
    skip_lora = no_lora is not None and bool(no_lora[0])
    table = cuda_table(x.device) if x.is_cuda else None
    if one_launch and not skip_lora and table is not None:
        plan = one_launch_plan(table, tokens, out_features, x.shape[1], lora_a.shape[1], plan_slots, slices,
                               decode_state, one_launch_max_tokens, one_launch_max_mixed_width)  # fmt: skip
        if plan is not None:
            decode_lora.decode_lora_linear(output, x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots,
                                           decode_state, bias, plan)  # fmt: skip
            return
    launch = table.prefill_launch(tokens, out_features, x.shape[1], width, slices) if table is not None else None
    delta_first = delta_first_layer and launch is not None and launch.delta_first
    if weight is not None and (skip_lora or not delta_first):
        torch.addmm(bias, x, weight.t(), out=output) if bias is not None else torch.mm(x, weight.t(), out=output)
        weight = None
    if skip_lora:
        return
    if launch is not None:
        groups = TokenGroups(sorted_ids[:tokens], group_slot, group_count, group_start)
        shrunk = lora_shrink(x, lora_a, groups, slot_widths, launch.shrink)
        if weight is not None:
            delta_then_gemm(x, weight, shrunk, lora_b, groups, slot_widths, slice_bounds, bias=bias, out=output,
                            config=launch.expand)  # fmt: skip
        else:
            fused_expand(output, shrunk, lora_b, groups, slot_widths, slice_bounds, None, scale_table, bias,
                         launch.expand)  # fmt: skip
        return
    from vllm_bdlora.kernels.reference import fused_lora_slices_reference

    output.copy_(fused_lora_slices_reference(output, x, lora_a, lora_b, slot_widths, slice_bounds,
                                             token_slots[:tokens], None, scale_table, bias))  # fmt: skip


def _fused_lora_slices_fake(output, x, lora_a, lora_b, slot_widths, slice_bounds, token_slots, sorted_ids=None,
                            group_slot=None, group_count=None, group_start=None, no_lora=None, scale_table=None,
                            bias=None, weight=None, decode_state=None, one_launch_max_tokens=0,
                            one_launch_max_mixed_width=0, plan_slots=0) -> None:  # fmt: skip
    return None


define_op("fused_lora_slices_", fused_lora_slices_, mutates_args=("output", "decode_state"),
          fake=_fused_lora_slices_fake)  # fmt: skip
