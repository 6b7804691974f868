"""DoRA serving, all of it but the compose kernel (kernels/dora_compose.py) and the layers' scale buffers: PEFT's
magnitude vectors in adapter files, the per-adapter holder vLLM's LoRAModel carries (`DoraAdapter`), the load-time
checks, the per-row weight norm without materialising B·A, the magnitude scale g, and copying g into LoRA slots.

PEFT's DoRA computes `y = base + (g - 1)·base + g·s·lora`, with `g = m / ||W + s·B·A||` per output row
(bias excluded from the scaling). W is frozen while serving, so g is a per-adapter constant, computed
once at adapter load.

Factored norm, per output row i:

    ||W_i + s (BA)_i||² = ||W_i||² + 2s·<W_i, (BA)_i> + s²·||(BA)_i||²
                        = ||W_i||² + 2s·rowsum(B ⊙ (W Aᵀ))_i + s²·rowsum((B (A Aᵀ)) ⊙ B)_i

accumulated in float32 over chunks of the input dimension. Working set: one chunk of W and A in fp32
(`out·chunk + r·chunk` values), the `out×r` product W·Aᵀ and the `r×r` Gram matrix A·Aᵀ, i.e.
O((out + r)·(chunk + r)) instead of the O(out·in) of a dense B·A.

Tensor parallelism: the squared norm of a row is the sum of its squared norms over column blocks, and
within the columns a rank holds, (B·A) restricted to them is exactly the rank's local B·A (standard or
BD sharding alike, see vllm_bdlora.sharding). So a column-parallel rank computes its rows' norms from
local data alone, and row-parallel ranks each compute `squared_row_norms` of their shard and sum the
vectors once (one all-reduce at load, none per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_bdlora.sharding import localize_magnitude

if TYPE_CHECKING:
    from vllm_bdlora.adapter_lifecycle.targets import StagedModule

# 1024 input columns per step: a gate_up shard of Llama-3.1-8B at TP=1 (28672 rows) then needs 117 MB of
# float32 scratch on the GPU at load, well inside the headroom vLLM leaves outside the KV cache.
DEFAULT_CHUNK = 1024
MAGNITUDE_KEY = "lora_magnitude_vector"


def is_magnitude_tensor(tensor_name: str) -> bool:
    """PEFT saves `<module>.lora_magnitude_vector` (older versions: `...lora_magnitude_vector.weight`)."""
    return MAGNITUDE_KEY in tensor_name.split(".")[-2:]


def as_lora_a_name(tensor_name: str) -> str:
    """The name of the module's LoRA-A tensor, so vLLM's own name parsing maps a magnitude vector to
    its module exactly as it maps the module's A and B."""
    head = tensor_name.removesuffix(".weight").removesuffix("." + MAGNITUDE_KEY)
    return head + ".lora_A.weight"


@dataclass
class DoraAdapter:
    """What DoRA adds to one adapter as vLLM's LoRAModel carries it: the magnitude vectors read from its file (per
    vLLM module name) and, once loaded on this rank, the magnitude scales g of this rank's rows (per module)."""

    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    ATTRIBUTE = "bdlora_dora"  # the one attribute vllm-bdlora sets on a LoRAModel

    @classmethod
    def of(cls, lora_model) -> DoraAdapter:
        """The model's holder; an empty one (not attached) for a model read without magnitude vectors."""
        return getattr(lora_model, cls.ATTRIBUTE, None) or cls()

    def attach(self, lora_model) -> None:
        setattr(lora_model, self.ATTRIBUTE, self)

    def load_into_slot(self, manager, index: int) -> None:
        """Copy g into slot `index` of every BD layer whose modules have one (the layers reset a slot's scales to 1
        when vLLM writes A and B into it)."""
        from vllm_bdlora.layers import BlockDiagonalLoRALayer

        if not self.scales:
            return
        for name, layer in manager.modules.items():
            if isinstance(layer, BlockDiagonalLoRALayer) and layer.dora_scale is not None:
                per_slice = [self.scales.get(sub) for sub in manager.packed_modules.get(name) or [name]]
                if any(scale is not None for scale in per_slice):
                    layer.set_dora_scale(index, per_slice)


def split_magnitudes(tensors: dict) -> tuple[dict, dict]:
    """(the tensors vLLM's reader understands, the magnitude vectors) of an adapter file's tensors."""
    magnitudes = {name: t for name, t in tensors.items() if is_magnitude_tensor(name)}
    return {name: t for name, t in tensors.items() if name not in magnitudes}, magnitudes


def squared_row_norms(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """||W + s·B·A||² per row of W (out, in), with A (r, in), B (out, r); float32, shape (out,)."""
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    if lora_a.shape[1] != in_features or lora_b.shape != (out_features, rank):
        raise ValueError(
            f"DoRA norm: W {tuple(weight.shape)}, A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not chain"
        )
    device = weight.device
    w_sq = torch.zeros(out_features, dtype=torch.float32, device=device)
    w_at = torch.zeros(out_features, rank, dtype=torch.float32, device=device)
    gram = torch.zeros(rank, rank, dtype=torch.float32, device=device)
    for start in range(0, in_features, chunk):
        w = weight[:, start : start + chunk].float()
        a = lora_a[:, start : start + chunk].to(device=device, dtype=torch.float32)
        w_sq += w.square().sum(dim=1)
        w_at += w @ a.T
        gram += a @ a.T
    b = lora_b.to(device=device, dtype=torch.float32)
    cross = (b * w_at).sum(dim=1)
    lora_sq = ((b @ gram) * b).sum(dim=1)
    # Rounding can push an (exactly) zero norm slightly negative.
    return (w_sq + 2.0 * scaling * cross + scaling * scaling * lora_sq).clamp_min(0.0)


def magnitude_scale(magnitude: torch.Tensor, squared_norms: torch.Tensor, module: str = "") -> torch.Tensor:
    """g = m / ||W + s·B·A||, float32, with the load-time checks a bad adapter needs."""
    where = f"{module}: " if module else ""
    if magnitude.shape != squared_norms.shape:
        raise ValueError(
            f"{where}lora_magnitude_vector has shape {tuple(magnitude.shape)}, expected "
            f"({squared_norms.shape[0]},): one value per output feature"
        )
    magnitude = magnitude.float()
    if not torch.isfinite(magnitude).all():
        raise ValueError(f"{where}lora_magnitude_vector holds NaN or Inf")
    norms = squared_norms.sqrt()
    if not torch.isfinite(norms).all() or (norms == 0).any():
        rows = torch.nonzero(~torch.isfinite(norms) | (norms == 0)).flatten()[:8].tolist()
        raise ValueError(f"{where}||W + s·B·A|| is zero or not finite for output rows {rows}: g = m/norm is undefined")
    return magnitude.to(norms.device) / norms


def stage_magnitudes(staged: list[StagedModule], magnitudes: dict, dora: bool) -> list[str]:
    """Check every DoRA magnitude vector against its module and keep this rank's entries."""
    if not dora:
        if magnitudes:
            return [
                f"{name}: has a lora_magnitude_vector but adapter_config.json does not set use_dora: true"
                for name in sorted(magnitudes)
            ]
        return []
    problems = []
    served = {item.name for item in staged}
    for name in sorted(set(magnitudes) - served):
        problems.append(f"{name}: lora_magnitude_vector for a module without LoRA tensors served here")
    for item in staged:
        magnitude = magnitudes.get(item.name)
        geometry = item.target.layer.shard_geometry(item.target.slice_index)
        if magnitude is None:
            problems.append(f"{item.name}: use_dora is set but the module has no lora_magnitude_vector")
        elif tuple(magnitude.shape) != (geometry.output_size,):
            problems.append(
                f"{item.name}: lora_magnitude_vector has shape {tuple(magnitude.shape)}, expected "
                f"({geometry.output_size},): one value per output feature"
            )
        elif not torch.isfinite(magnitude).all():
            problems.append(f"{item.name}: lora_magnitude_vector holds NaN or Inf")
        else:
            item.magnitude = localize_magnitude(magnitude.float(), geometry)
    return problems


def unreadable_base_problems(staged: list[StagedModule]) -> list[str]:
    """DoRA's magnitude scale g = m / ||W + s·B·A|| needs the base weight W as the layer applies it. A quantized
    layer's W is read through its own GEMM on identity rows (`ProbedWeight`), exact under dynamic activation
    quantization; where the layer quantizes activations with a static scale the read would be off by the
    format's rounding, so such layers refuse DoRA rather than serve it wrong."""
    return [
        f"{item.name}: DoRA over a quantized base layer ({layer.base_quantization()}, {why}) is not served: the "
        "magnitude norm needs the dequantized base weight, which that layer's GEMM cannot return exactly; serve "
        "this adapter on a base quantized with dynamic activation scales or unquantized, or as LoRA without its "
        "magnitudes"
        for item in staged
        if (why := (layer := item.target.layer).base_weight_unreadable()) and layer.base_quantization()
    ]


def magnitude_scales(staged: list[StagedModule]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """g = m / ||W + s·B·A|| per module, on this rank's rows, from the factored norm. Row-parallel
    modules hold a column block of W: their partial squared norms are summed over ranks in one
    all-reduce (for all such modules at once)."""
    squared: dict[str, torch.Tensor] = {}
    for item in staged:
        weight = item.target.layer.base_weight_rows(item.target.slice_index)
        squared[item.name] = squared_row_norms(weight, item.local.lora_a, item.local.lora_b, item.weights.scaling)
    row_names = [item.name for item in staged if item.target.layer.parallelism == "row"]
    tp_size = staged[0].target.layer.tp_size
    if row_names and tp_size > 1:
        from vllm.distributed import tensor_model_parallel_all_reduce

        summed = tensor_model_parallel_all_reduce(torch.cat([squared[n] for n in row_names]))
        for name, part in zip(row_names, summed.split([squared[n].numel() for n in row_names]), strict=True):
            squared[name] = part
    scales, problems = {}, []
    for item in staged:
        try:
            scales[item.name] = magnitude_scale(item.magnitude, squared[item.name].cpu(), item.name)
        except ValueError as e:
            problems.append(str(e))
    return scales, problems
