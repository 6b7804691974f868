"""Worker-side adapter loading for a BD-enabled LoRA manager: validate every module of an adapter
against the layer it targets and cut it to this rank's share, all before anything reaches a LoRA slot.

An adapter is accepted whole or rejected whole (`AdapterRejected`, one message listing every problem),
so a bad adapter never leaves half-written state behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_bdlora.adapters import AdapterRejected, BlockDiagonalSpec
from vllm_bdlora.compat import allowed_max_lora_ranks
from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.sharding import LocalFactors, ShardingError, localize


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


def smallest_max_lora_rank(width_needed: int, tp_size: int) -> int | None:
    return next((r for r in allowed_max_lora_ranks() if r >= width_needed * tp_size and r % tp_size == 0), None)


def _width_problem(module: str, local: LocalFactors, rank: int, target: LoRATarget) -> str:
    layer, tp = target.layer, target.layer.tp_size
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
            why += ", and TP must not exceed the number of KV heads)" if layer.parallelism == "column" else ")"
    return (
        f"{module}: needs LoRA width {local.width} per GPU but each GPU has {layer.lora_width} "
        f"(= --max-lora-rank {layer.lora_config.max_lora_rank} / TP {tp}); {why}; {fix_text}"
    )


def localize_adapter(
    lora_model, spec: BlockDiagonalSpec | None, manager, adapter: str, check_unknown_modules: bool = True
) -> str:
    """Replace the adapter's tensors, in place, by this rank's share, or raise `AdapterRejected`.
    Returns a one-line summary for the log."""
    targets = bd_targets(manager)
    known = known_lora_modules(manager) if check_unknown_modules else None
    problems: list[str] = []
    staged: list[tuple[object, LocalFactors]] = []
    for module, weights in lora_model.loras.items():
        factor = spec.factor_of(module) if spec else None
        target = targets.get(module)
        if target is None:
            if known is not None and module not in known:
                problems.append(
                    f"{module}: no such LoRA-capable module in this model (is the adapter for another base model?)"
                )
            elif factor:
                problems.append(
                    f"{module}: block-diagonal LoRA-{factor.upper()} on a layer kind vllm-bdlora does not shard "
                    f"({type(manager.modules.get(module)).__name__}); train it as a standard LoRA module"
                )
            continue
        try:
            local = localize(
                weights.lora_a,
                weights.lora_b,
                target.layer.shard_geometry(target.slice_index),
                factor,
                spec.nblocks if factor else 1,
            )
        except ShardingError as e:
            problems.append(f"{module}: {e}")
            continue
        if local.width > target.layer.lora_width:
            problems.append(_width_problem(module, local, weights.lora_a.shape[0], target))
            continue
        staged.append((weights, local))
    if problems:
        raise AdapterRejected(adapter, problems)
    for weights, local in staged:
        pinned = weights.lora_a.is_pinned()
        weights.lora_a = local.lora_a.pin_memory() if pinned else local.lora_a
        weights.lora_b = local.lora_b.pin_memory() if pinned else local.lora_b
    block_diagonal = sum(local.nblocks > 1 for _, local in staged)
    widths = sorted({local.width for _, local in staged})
    kind = f"BD-LoRA nblocks={spec.nblocks}" if spec else "standard LoRA"
    return (
        f"adapter '{adapter}' ({kind}, r={lora_model.rank}): {len(staged)} module(s) sharded, "
        f"{block_diagonal} block-diagonal; per-GPU width {'/'.join(map(str, widths)) or '-'} "
        f"of {next(iter(targets.values())).layer.lora_width if targets else '-'}"
    )
