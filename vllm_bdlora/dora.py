"""DoRA serving math: the per-row weight norm without materialising B·A, the magnitude scale, and the
adapter-file conventions for PEFT's magnitude vectors.

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

import torch

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
