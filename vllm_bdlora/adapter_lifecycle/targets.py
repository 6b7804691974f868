"""Where each of an adapter's modules goes on this worker: the BD layer (and packed slice) vLLM's LoRA manager built
for it, and the module's share while it is being admitted (`StagedModule`). Runs in every worker process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.sharding import LocalFactors


@dataclass(frozen=True)
class LoRATarget:
    layer: BlockDiagonalLoRALayer
    slice_index: int


@dataclass
class StagedModule:
    """One module of an adapter being admitted: this rank's share of its factors, the layer it goes into, and what
    admission adds to it (vLLM's module weights once built, DoRA's magnitude entries of this rank's rows)."""

    name: str
    local: LocalFactors
    target: LoRATarget
    tensor_names: tuple[str, str] = ("", "")  # its A and B tensors' names in the adapter's weights file
    weights: object = None  # vLLM's LoRALayerWeights, once built
    magnitude: torch.Tensor | None = None  # this rank's DoRA magnitude entries


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


def tensor_parallel_size(manager) -> int:
    """The TP size the manager's BD layers shard over (1 where there are none)."""
    return next((t.layer.tp_size for t in bd_targets(manager).values()), 1)


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
