"""What an adapter's values may be, so that no adapter can put a non-finite value into a batch.

A non-finite value in one request's hidden states does not stay there: it reaches the KV cache, and a cache block
is reused by other requests once freed (on vLLM's CPU backend attention reads a block's stale rows and multiplies
them by zero: NaN). So an adapter whose factors or scales can overflow the serving dtype is refused at admission,
naming the key or module and the value, before anything reaches a LoRA slot:

* every factor finite (NaN or Inf: a diverged training run or a damaged file);
* every scale finite and at most `MAX_SCALING`: `lora_alpha / r` (rsLoRA: `/ sqrt(r)`), per `rank_pattern` and
  `alpha_pattern` entry, from `adapter_config.json` before any tensor is read;
* every module's gain, `|s| * ||A||_F * ||B||_F` (a bound on how much the module can amplify the norm of its
  input), at most `MAX_GAIN` and at most the serving dtype's largest value, and `s * max|B|` representable in it
  (vLLM multiplies B by s in that dtype). Trained adapters measure gains of 1e1 to 1e4 (PiSSA-style initialisation
  from the base weight's singular vectors the most); at 1e6 a module's output stays finite in bfloat16 and float32
  for any hidden state a finite model produces after its normalisation layers;
* DoRA's magnitude scale `g = m / ||W + s B A||`, which multiplies the layer's whole output, at most
  `MAX_DORA_SCALE` in magnitude (trained adapters: about 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MAX_SCALING = 1e6
MAX_GAIN = 1e6
MAX_DORA_SCALE = 1e3

NON_FINITE_HINT = "the adapter's training diverged or its file is damaged; re-train or re-save it."
GAIN_HINT = (
    "an adapter this large would overflow the serving dtype and is refused so that it cannot corrupt other "
    "requests; check its lora_alpha and factors (trained adapters have gains of 1e1 to 1e4)."
)


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The factor PEFT multiplies a module's B A by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def config_scale_problems(config: dict) -> list[str]:
    """The scales `adapter_config.json` gives its modules that are over `MAX_SCALING` (its fields' types are already
    checked): the default `lora_alpha / r` and every `rank_pattern` / `alpha_pattern` entry's."""
    rslora = bool(config.get("use_rslora", False))
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    divisor = "sqrt(r)" if rslora else "r"
    cases = [("lora_alpha", alpha, "r", rank)]
    cases += [(f"lora_alpha (rank_pattern {key!r})", alphas.get(key, alpha), f"rank_pattern[{key!r}]", r)
              for key, r in ranks.items()]  # fmt: skip
    cases += [(f"alpha_pattern[{key!r}]", a, f"rank_pattern[{key!r}]" if key in ranks else "r", ranks.get(key, rank))
              for key, a in alphas.items()]  # fmt: skip
    problems = []
    for alpha_key, a, rank_key, r in cases:
        scale = lora_scaling(a, r, rslora)
        if not math.isfinite(scale) or abs(scale) > MAX_SCALING:
            problems.append(
                f"{alpha_key} {a:g} / {divisor} ({rank_key} {r}) scales the adapter by {scale:.3g}, over the limit of "
                f"{MAX_SCALING:g}"
            )
    return problems


def non_finite_problems(modules: Iterable[tuple[str, object, object]]) -> list[str]:
    """One pass over every (module, lora_A, lora_B): NaN or Inf in a LoRA factor."""
    problems = []
    for module, lora_a, lora_b in modules:
        for factor, tensor in (("lora_A", lora_a), ("lora_B", lora_b)):
            if tensor is not None and not all_finite(tensor):
                problems.append(f"{module}: {factor} holds NaN or Inf")
    return problems


def all_finite(tensor) -> bool:
    """Whether every entry is finite, in one reduction: the float64 norm of finite values of at most 32 bits cannot
    overflow (a square is at most ~1.2e77), and a NaN or Inf makes it non-finite. An element-wise isfinite pass costs
    several times as much on CPU for half-precision factors, and an admission checks a few hundred modules."""
    import torch

    if tensor.dtype == torch.float64 or not tensor.is_floating_point():
        return bool(torch.isfinite(tensor).all())
    return math.isfinite(float(torch.linalg.vector_norm(tensor, dtype=torch.float64)))


def gain_limit(dtype) -> float:
    """The largest gain a module may have when served in `dtype`."""
    import torch

    return min(MAX_GAIN, float(torch.finfo(dtype).max))


def module_gain(lora_a, lora_b, scaling: float) -> float:
    """|s| * ||A||_F * ||B||_F in float64: no input x gives ||s B A x|| above it times ||x||."""
    import torch

    norm_a = float(torch.linalg.vector_norm(lora_a, dtype=torch.float64))
    norm_b = float(torch.linalg.vector_norm(lora_b, dtype=torch.float64))
    return abs(float(scaling)) * norm_a * norm_b


def gain_problems(modules: Iterable[tuple[str, object, object, float]], dtype) -> list[str]:
    """Every (module, lora_A, lora_B, scaling) whose gain or scaled B the serving `dtype` cannot hold safely."""
    import torch

    limit, largest = gain_limit(dtype), float(torch.finfo(dtype).max)
    problems = []
    for module, lora_a, lora_b, scaling in modules:
        if lora_a is None or lora_b is None:
            continue
        if not math.isfinite(scaling):
            problems.append(f"{module}: its scaling {scaling} is not finite")
            continue
        gain = module_gain(lora_a, lora_b, scaling)
        scaled_b = abs(scaling) * float(lora_b.abs().max()) if lora_b.numel() else 0.0
        if not math.isfinite(gain) or gain > limit:
            problems.append(
                f"{module}: gain {gain:.3g} (scaling {scaling:.3g} x ||lora_A|| x ||lora_B||) is over the limit of "
                f"{limit:.3g} for {str(dtype).removeprefix('torch.')}"
            )
        elif scaled_b > largest:
            problems.append(
                f"{module}: scaling {scaling:.3g} x the largest lora_B entry is {scaled_b:.3g}, more than "
                f"{str(dtype).removeprefix('torch.')} holds"
            )
    return problems


def dora_scale_problems(scales: dict) -> list[str]:
    """DoRA magnitude scales g (per module) larger in magnitude than `MAX_DORA_SCALE`."""
    problems = []
    for module, g in scales.items():
        largest = float(g.abs().max()) if g.numel() else 0.0
        if not math.isfinite(largest) or largest > MAX_DORA_SCALE:
            problems.append(
                f"{module}: DoRA magnitude scale m / ||W + s·B·A|| reaches {largest:.3g}, over the limit of "
                f"{MAX_DORA_SCALE:g} (lora_magnitude_vector too large for its weights)"
            )
    return problems
