"""Worker-side adapter loading for a BD-enabled LoRA manager: validate every module of an adapter
against the layer it targets and cut it to this rank's share, all before anything reaches a LoRA slot.

An adapter is accepted whole or rejected whole (`AdapterRejected`, one message listing every problem),
so a bad adapter never leaves half-written state behind.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from vllm_bdlora.adapter_files import check_adapter_dir
from vllm_bdlora.adapters import AdapterFormat, AdapterRejected, adapter_format, read_adapter_format
from vllm_bdlora.admission import AdmittedCopies, is_admitting
from vllm_bdlora.compat import adapter_absolute_path, allowed_max_lora_ranks, with_lora_path
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.dora import DoraAdapter, magnitude_scales, stage_magnitudes, unreadable_base_problems
from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.sharding import LocalFactors, ShardingError, foreign_model_problem, localize

logger = logging.getLogger("vllm.bdlora")

ENABLE_HINT = (
    'start the server with --enable-bdlora (Python API: LLM(..., enable_lora=True, additional_config={"bdlora": {}}))'
)
DORA_HINT = (
    "start the server with --enable-dora (Python API: LLM(..., enable_lora=True, "
    'additional_config={"bdlora": {"dora": True}}))'
)
NON_FINITE_HINT = "the adapter's training diverged or its file is damaged; re-train or re-save it."


@dataclass(frozen=True)
class LoRATarget:
    layer: BlockDiagonalLoRALayer
    slice_index: int


def bd_targets(manager) -> dict[str, LoRATarget]:
    """Adapter module name -> the BD layer (and packed slice) it is loaded into."""
    targets = {}
    for name, layer in manager.modules.items():
        if not isinstance(layer, BlockDiagonalLoRALayer):
            continue
        sub_modules = manager.packed_modules.get(name)
        if sub_modules:
            targets.update({sub: LoRATarget(layer, i) for i, sub in enumerate(sub_modules)})
        else:
            targets[name] = LoRATarget(layer, 0)
    return targets


def known_lora_modules(manager) -> set[str]:
    names = set(manager.modules)
    for sub_modules in manager.packed_modules.values():
        names.update(sub_modules)
    return names


def on_other_pipeline_stage(model, module: str) -> bool:
    """True when `module` lies under a layer that pipeline parallelism placed on another stage (vLLM keeps a
    PPMissingLayer in its place): that stage's workers load its LoRA, this one's skip it."""
    from vllm.model_executor.models.utils import PPMissingLayer

    node = model
    for part in module.split("."):
        node = node._modules.get(part) if isinstance(node, torch.nn.Module) else None
        if node is None:
            return False
        if isinstance(node, PPMissingLayer):
            return True
    return False


def smallest_max_lora_rank(width_needed: int, tp_size: int) -> int | None:
    return next((r for r in allowed_max_lora_ranks() if r >= width_needed * tp_size and r % tp_size == 0), None)


def width_problem(module: str, local: LocalFactors, rank: int, max_lora_rank: int, tp: int, parallelism: str) -> str:
    """Why `module` (`local`: its widest rank's share) does not fit the per-GPU LoRA width, and the fix; the server
    and `vllm-bdlora check` both say it."""
    fix = smallest_max_lora_rank(local.width, tp)
    fix_text = f"start the server with --max-lora-rank {fix}" if fix else "this module cannot be served at this TP"
    if local.nblocks == 1:
        why = f"a standard (non-BD) module needs its full rank {rank} on every GPU"
    else:
        why = (
            f"this GPU's shard touches {len(local.blocks)} of the {local.nblocks} blocks "
            f"(rank {rank} / {local.nblocks} per block)"
        )
        if len(local.blocks) * tp > local.nblocks:
            why += ": the blocks do not line up with the tensor-parallel shards (nblocks should be a multiple of TP"
            why += ", and TP must not exceed the number of KV heads)" if parallelism == "column" else ")"
    return (
        f"{module}: needs LoRA width {local.width} per GPU but each GPU has {max_lora_rank // tp} "
        f"(= --max-lora-rank {max_lora_rank} / TP {tp}); {why}; {fix_text}"
    )


@dataclass
class StagedModule:
    name: str
    weights: object  # vLLM's LoRALayerWeights
    local: LocalFactors
    target: LoRATarget
    magnitude: torch.Tensor | None = None  # this rank's DoRA magnitude entries


def localize_adapter(
    lora_model, fmt: AdapterFormat, manager, adapter: str, target_modules: Sequence[str] | None = None
) -> tuple[str, list[str]]:
    """Replace the adapter's tensors, in place, by this rank's share (and compute its DoRA magnitude
    scales), or raise `AdapterRejected`. `target_modules`: vLLM's deployment-time restriction
    (--lora-target-modules), under which vLLM wraps only those modules and drops the adapter's others without
    a word; they are returned so that the caller can say so. Returns a one-line summary for the log and the
    adapter's modules that are not served."""
    non_finite = non_finite_problems((m, w.lora_a, w.lora_b) for m, w in lora_model.loras.items())
    if non_finite:
        raise AdapterRejected(adapter, non_finite, NON_FINITE_HINT)
    spec = fmt.block_diagonal
    targets = bd_targets(manager)
    known = known_lora_modules(manager)
    problems: list[str] = []
    not_served: list[str] = []
    staged: list[StagedModule] = []
    for module, weights in lora_model.loras.items():
        factor = spec.factor_of(module) if spec else None
        target = targets.get(module)
        if target is None:
            if module not in known and on_other_pipeline_stage(manager.model, module):
                continue
            if module not in known and target_modules is not None:
                not_served.append(module)
            elif module not in known:
                problems.append(
                    f"{module}: no such LoRA-capable module in this model (is the adapter for another base model?)"
                )
            elif factor:
                problems.append(
                    f"{module}: block-diagonal LoRA-{factor.upper()} on a layer kind vllm-bdlora does not shard "
                    f"({type(manager.modules.get(module)).__name__}); train it as a standard LoRA module"
                )
            continue
        geometry = target.layer.shard_geometry(target.slice_index)
        foreign = foreign_model_problem(weights.lora_a, geometry, factor)
        if foreign:
            problems.append(f"{module}: {foreign}")
            continue
        try:
            local = localize(weights.lora_a, weights.lora_b, geometry, factor, spec.nblocks if factor else 1)
        except ShardingError as e:
            problems.append(f"{module}: {e}")
            continue
        if local.width > target.layer.lora_width:
            layer = target.layer
            problems.append(width_problem(module, local, weights.lora_a.shape[0], layer.lora_config.max_lora_rank,
                                          layer.tp_size, layer.parallelism))  # fmt: skip
            continue
        staged.append(StagedModule(module, weights, local, target))
    dora = DoraAdapter.of(lora_model)
    problems += stage_magnitudes(staged, dora.magnitudes, fmt.dora)
    if fmt.dora:
        problems += unreadable_base_problems(staged)
    if fmt.dora and staged:
        _agree_across_ranks(problems, staged[0].target.layer, adapter, lora_model.id)
    if problems:
        raise AdapterRejected(adapter, problems)
    if fmt.dora:
        dora.scales, problems = magnitude_scales(staged)
        if problems:
            raise AdapterRejected(adapter, problems)
    for item in staged:
        weights, local = item.weights, item.local
        pinned = weights.lora_a.is_pinned()
        weights.lora_a = local.lora_a.pin_memory() if pinned else local.lora_a
        weights.lora_b = local.lora_b.pin_memory() if pinned else local.lora_b
    block_diagonal = sum(item.local.nblocks > 1 for item in staged)
    widths = sorted({item.local.width for item in staged})
    summary = (
        f"adapter '{adapter}' ({fmt.describe()}, r={lora_model.rank}): {len(staged)} module(s) sharded, "
        f"{block_diagonal} block-diagonal; per-GPU width {'/'.join(map(str, widths)) or '-'} "
        f"of {next(iter(targets.values())).layer.lora_width if targets else '-'}"
    )
    return summary, sorted(not_served)


def _agree_across_ranks(problems: list[str], layer: BlockDiagonalLoRALayer, adapter: str, adapter_id: int) -> None:
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


def non_finite_problems(modules: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> list[str]:
    """One pass over every (module, lora_A, lora_B): NaN or Inf in a LoRA factor would make the adapter's answers
    empty or garbage, and in a shared slot buffer could reach other adapters' rows."""
    problems = []
    for module, lora_a, lora_b in modules:
        for factor, tensor in (("lora_A", lora_a), ("lora_B", lora_b)):
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                problems.append(f"{module}: {factor} holds NaN or Inf")
    return problems


def base_quantization(layer) -> str | None:
    return layer.base_quantization() if isinstance(layer, BlockDiagonalLoRALayer) else None


def unreadable_base(layer) -> str | None:
    return layer.base_weight_unreadable() if isinstance(layer, BlockDiagonalLoRALayer) else None


def is_first_tp_rank(manager) -> bool:
    """True on the first tensor-parallel rank only, so each log line appears once per engine."""
    return all(getattr(layer, "tp_rank", 0) == 0 for layer in manager.modules.values())


def refuse_unserved_kinds(fmt: AdapterFormat, settings: BdLoraSettings, adapter: str) -> None:
    """A BD adapter on a server without BD-LoRA would be served as dense (wrong output); a DoRA adapter
    without DoRA serving would lose its magnitudes. Both are refused with the flag that serves them."""
    spec = fmt.block_diagonal
    if spec is not None and not settings.enabled:
        problem = f"it is a BD-LoRA adapter (use_bdlora, nblocks={spec.nblocks}) and BD-LoRA is off"
        raise AdapterRejected(adapter, [problem], ENABLE_HINT)
    if fmt.dora and not settings.dora:
        problem = f"it is a {fmt.describe()} adapter (use_dora) and DoRA serving is off"
        raise AdapterRejected(adapter, [problem], DORA_HINT)


def load_adapter(worker_manager, lora_request, read: Callable):
    """vLLM's `WorkerLoRAManager._load_adapter` with vllm-bdlora's rules: `read(request)` is vLLM's own reader.

    With BD-LoRA on, the adapter is admitted first (`vllm_bdlora.admission`): its files are copied, checked
    (`vllm_bdlora.adapter_files`) and read from the copy, then every module is validated against its layer and
    cut to this rank's share. A later read of an admitted adapter (after vLLM's CPU cache dropped it) reads the
    same copy, so it passes as it passed before: no load can fail inside an engine step because of its files."""
    manager = worker_manager._adapter_manager
    settings = getattr(manager, "_bdlora_settings", BdLoraSettings())
    name = lora_request.lora_name
    if not settings.enabled:
        try:
            fmt = read_adapter_format(adapter_absolute_path(lora_request.lora_path), name)
        except AdapterRejected:
            raise
        except (OSError, ValueError):
            fmt = AdapterFormat(None, dora=False)  # vLLM's own reader reports missing or unreadable adapters
        refuse_unserved_kinds(fmt, settings, name)
        return read(lora_request)
    copies = admitted_copies(worker_manager, settings)
    adapter_id = lora_request.lora_int_id
    copy = copies.get(adapter_id)
    new_copy = None
    if copy is None or is_admitting():
        source = adapter_absolute_path(lora_request.lora_path)
        if not os.path.exists(source):
            return read(lora_request)  # vLLM's "not found" (HTTP 404)
        copy = new_copy = copies.stage(source, name)
    try:
        files = check_adapter_dir(copy.directory, name)
        fmt = adapter_format(files.config, name)
        refuse_unserved_kinds(fmt, settings, name)
        try:
            lora_model = read(with_lora_path(lora_request, copy.directory))
        except ValueError as e:
            if isinstance(e, AdapterRejected):
                raise
            raise AdapterRejected(name, [str(e)], rank_limit_hint(str(e), manager)) from e
        deployment_targets = getattr(manager.lora_config, "target_modules", None)
        summary, not_served = localize_adapter(lora_model, fmt, manager, name, deployment_targets)
    except BaseException:
        if new_copy is not None:
            copies.discard(new_copy)
        raise
    if new_copy is not None:
        copies.keep(adapter_id, new_copy)
    if is_first_tp_rank(manager):
        # One line when an adapter is admitted; re-reads after vLLM's CPU cache dropped it are routine.
        logger.log(logging.INFO if new_copy is not None else logging.DEBUG, "vllm-bdlora: %s", summary)
        if not_served and new_copy is not None:
            logger.warning(
                "vllm-bdlora: adapter '%s' is served without its LoRA on %d module(s) that --lora-target-modules %s "
                "leaves out (%s): its outputs differ from the adapter's as trained. Add their names to "
                "--lora-target-modules to serve it whole.",
                name, len(not_served), " ".join(deployment_targets), _module_kinds(not_served),
            )  # fmt: skip
    return lora_model


def rank_limit_hint(message: str, manager) -> str | None:
    """The fix for vLLM's "LoRA rank R is greater than max_lora_rank M": the smallest --max-lora-rank vLLM accepts
    that holds this adapter (a BD adapter needs >= r; a standard one, served replicated, r * TP)."""
    import re

    found = re.search(r"LoRA rank (\d+) is greater than max_lora_rank", message)
    if not found:
        return None
    rank = int(found.group(1))
    tp = next((t.layer.tp_size for t in bd_targets(manager).values()), 1)
    fit = smallest_max_lora_rank(-(-rank // tp), tp)
    accepted = ", ".join(map(str, allowed_max_lora_ranks()))
    return (f"start the server with --max-lora-rank {fit} (vLLM accepts {accepted}); a standard (non-BD) adapter "
            f"needs its rank x TP") if fit else f"vLLM accepts --max-lora-rank {accepted} only"  # fmt: skip


def admitted_copies(worker_manager, settings: BdLoraSettings) -> AdmittedCopies:
    copies = getattr(worker_manager, "_bdlora_admitted", None)
    if copies is None:
        copies = AdmittedCopies(settings.adapter_copy_dir)
        worker_manager._bdlora_admitted = copies
    return copies


def _module_kinds(modules: list[str]) -> str:
    """'lm_head, 2 x up_proj' rather than every layer's full name."""
    kinds = Counter(module.rsplit(".", 1)[-1] for module in modules)
    return ", ".join(kind if count == 1 else f"{count} x {kind}" for kind, count in sorted(kinds.items()))
