"""Finish an admission (a worker, on its own thread, inside the add_lora call every rank runs in the same order):
DoRA's magnitude scales g = m / ||W + s·B·A||, which read the layers' base weights and, at TP > 1, sum row-parallel
norms over the ranks in one all-reduce. Nothing else needs this stage: an adapter without DoRA is finished when it
is cut (`read_and_cut.py`)."""

from __future__ import annotations

import torch

from vllm_bdlora.adapter_lifecycle.read_and_cut import AdmittedAdapter
from vllm_bdlora.adapter_lifecycle.values import dora_scale_problems
from vllm_bdlora.adapters import AdapterRejected
from vllm_bdlora.dora import DoraAdapter, magnitude_scales, unreadable_base_problems
from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.sharding import LocalFactors


def finish_admission(admitted: AdmittedAdapter, adapter_id: int) -> None:
    """DoRA's magnitude scales (once per adapter, on the worker's own thread: they read the layers' weights and, at
    TP > 1, sum row-parallel norms over the ranks in one all-reduce that every rank reaches in the same order)."""
    if not admitted.dora or not admitted.staged:
        admitted.staged = []
        return
    staged = admitted.staged
    problems = unreadable_base_problems(staged)
    agree_across_ranks(problems, staged[0].target.layer, admitted.name, adapter_id)
    if problems:
        raise AdapterRejected(admitted.name, problems)
    dora = DoraAdapter.of(admitted.template)
    for item in staged:  # the norm takes the factors as served: B already scaled
        item.local = LocalFactors(item.weights.lora_a, item.weights.lora_b, item.local.blocks, item.local.nblocks)
    scales, problems = magnitude_scales(staged)
    problems += dora_scale_problems(scales)
    if problems:
        raise AdapterRejected(admitted.name, problems)
    dora.scales = scales
    dora.magnitudes = {}
    admitted.staged = []


def agree_across_ranks(problems: list[str], layer: BlockDiagonalLoRALayer, adapter: str, adapter_id: int) -> None:
    """DoRA scales of row-parallel layers need one all-reduce; every rank must reach it or none may, and
    for the same adapter. A rank whose own checks passed raises when another rank's did not; ranks loading
    different adapters at this point (a load order that differs between ranks, see
    `patch_adapter_load_order`) would sum unrelated norms, so that is an error too."""
    tp = layer.tp_size
    if tp == 1:
        return
    from vllm.distributed import tensor_model_parallel_all_reduce

    # The id in two base-1024 digits (exact in float32 after the sum): for each digit, the sum and the sum of
    # squares equal tp copies of this rank's digit iff every rank holds that digit (ids agree below 2**20).
    digits = [float(adapter_id % 1024), float(adapter_id // 1024 % 1024)]
    local = torch.tensor([float(len(problems))] + digits + [d * d for d in digits], device=layer.device)
    total, *sums = tensor_model_parallel_all_reduce(local).tolist()
    if sums != [tp * d for d in digits] + [tp * d * d for d in digits]:
        raise RuntimeError(
            f"vllm-bdlora: tensor-parallel ranks are loading different adapters at once ('{adapter}' here); "
            "adapter load order must be the same on every rank."
        )
    if total and not problems:
        raise AdapterRejected(adapter, [f"{AdapterRejected.OTHER_RANK} (see its message)"])
