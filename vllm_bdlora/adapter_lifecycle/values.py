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
from collections.abc import Iterable, Iterator

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


# A bfloat16 factor's norm reduced in bfloat16 (a float sum, rounded to bfloat16's 8 significant bits: within 2^-8 of
# the exact norm) takes less than half the float64 reduction's time on a CPU (3.2 against 7.8 ms for an 8B adapter's
# share, `bench/results/admission/estimated-norms-cpu`). Taken as at most this far from the exact norm either way, it
# decides a module only where the bound it gives is clear of every limit; any other module, and any factor whose
# estimate is not finite, is decided on float64 norms, so the verdicts and the messages are the float64 reduction's.
ESTIMATE_MARGIN = 2**-4


def value_problems(modules: Iterable[tuple[str, object, object, float]], dtype) -> tuple[list[str], list[str]]:
    """(NaN or Inf in a factor, gains the serving `dtype` cannot hold safely) for every (module, lora_A, lora_B,
    scaling), in one pass: each factor's norm answers both (a NaN or Inf makes it non-finite, and the gain is their
    product), so an admission reduces each factor once, not once per check: estimated where that is cheaper
    (`estimated_norms`), in float64 wherever an estimate does not settle the verdict. `dtype` None: finiteness
    only."""
    import torch

    limit, largest = (gain_limit(dtype), float(torch.finfo(dtype).max)) if dtype is not None else (None, None)
    dtype_name = str(dtype).removeprefix("torch.")
    non_finite, gains = [], []
    modules = list(modules)
    estimates = iter(estimated_norms([tensor for _, lora_a, lora_b, _ in modules for tensor in (lora_a, lora_b)
                                      if tensor is not None]))  # fmt: skip
    for module, lora_a, lora_b, scaling in modules:
        factors = [(name, tensor, next(estimates)) for name, tensor in (("lora_A", lora_a), ("lora_B", lora_b))
                   if tensor is not None]  # fmt: skip
        # (norm, finite, exact): an estimate that is not finite may be a finite factor past bfloat16's range
        factors = [(name, tensor, found if found[1] or found[2] else (*norm_and_finite(tensor), True))
                   for name, tensor, found in factors]  # fmt: skip
        norms = {}
        for factor, _, (norm, finite, _) in factors:
            if not finite:
                non_finite.append(f"{module}: {factor} holds NaN or Inf")
            norms[factor] = norm if finite else None
        if dtype is None or len(norms) < 2 or None in norms.values():
            continue
        if not math.isfinite(scaling):
            gains.append(f"{module}: its scaling {scaling} is not finite")
            continue
        if not all(exact for _, _, (_, _, exact) in factors):
            upper = {name: norm * (1 + ESTIMATE_MARGIN) for name, _, (norm, _, _) in factors}
            if abs(scaling) * upper["lora_A"] * upper["lora_B"] <= limit and abs(scaling) * upper["lora_B"] <= largest:
                continue  # clear of both limits: so are the exact norms
            norms = {name: norm if exact else norm_and_finite(tensor)[0] for name, tensor, (norm, _, exact) in factors}
        gain = abs(float(scaling)) * norms["lora_A"] * norms["lora_B"]
        if not math.isfinite(gain) or gain > limit:
            gains.append(
                f"{module}: gain {gain:.3g} (scaling {scaling:.3g} x ||lora_A|| x ||lora_B||) is over the limit of "
                f"{limit:.3g} for {dtype_name}"
            )
        elif abs(scaling) * norms["lora_B"] > largest:  # only then can s x max|B| exceed it: max|B| <= ||B||_F
            scaled_b = abs(scaling) * float(torch.linalg.vector_norm(lora_b, ord=math.inf))
            if scaled_b > largest:
                gains.append(
                    f"{module}: scaling {scaling:.3g} x the largest lora_B entry is {scaled_b:.3g}, more than "
                    f"{dtype_name} holds"
                )
    return non_finite, gains


def estimated_norms(tensors: list) -> list[tuple[float, bool, bool]]:
    """(norm, finite, exact) of each tensor, in order: bfloat16 tensors' norms estimated (see `ESTIMATE_MARGIN`; not
    finite where an entry is NaN or Inf, or the norm is past bfloat16's range), in one reduction; the others' as
    `norms_and_finite` answers, exact."""
    import torch

    estimated = [i for i, t in enumerate(tensors) if t.dtype == torch.bfloat16]
    found = dict(zip(estimated, torch.stack(torch._foreach_norm([tensors[i] for i in estimated], 2)).float().tolist()
                     if estimated else [], strict=True))  # fmt: skip
    others = [i for i in range(len(tensors)) if i not in found]
    exact = dict(zip(others, norms_and_finite([tensors[i] for i in others]), strict=True))
    return [(found[i], math.isfinite(found[i]), False) if i in found else (*exact[i], True)
            for i in range(len(tensors))]  # fmt: skip


def norms_and_finite(tensors: list) -> Iterator[tuple[float, bool]]:
    """`norm_and_finite` of each tensor, in order. The floating factors of at most 32 bits (all of a served adapter's)
    are reduced in one operation: an admission runs on a thread beside the worker's main thread and other admissions,
    and a reduction per factor (448 at Llama-8B's depth) hands the interpreter lock over and waits for it back 448
    times (38 of an admission's 160 ms of thread time inside a GPU server, `bench/results/admission`)."""
    import torch

    batched = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.dtype != torch.float64]
    norms = dict(zip(batched, torch.stack(torch._foreach_norm([tensors[i] for i in batched], 2,
                                                              dtype=torch.float64)).tolist()
                     if batched else [], strict=True))  # fmt: skip
    for i, tensor in enumerate(tensors):
        if i in norms:
            yield norms[i], math.isfinite(norms[i])
        else:
            yield norm_and_finite(tensor)


def norm_and_finite(tensor) -> tuple[float, bool]:
    """The factor's float64 Frobenius norm, and whether every entry is finite: for floating dtypes of at most 32 bits
    the norm of finite values cannot overflow (a square is at most ~1.2e77), so a non-finite norm means a NaN or Inf
    entry; float64 factors are checked element-wise."""
    import torch

    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    if tensor.dtype == torch.float64 or not tensor.is_floating_point():
        return norm, bool(torch.isfinite(tensor).all())
    return norm, math.isfinite(norm)


def gain_limit(dtype) -> float:
    """The largest gain a module may have when served in `dtype`."""
    import torch

    return min(MAX_GAIN, float(torch.finfo(dtype).max))


def module_gain(lora_a, lora_b, scaling: float) -> float:
    """|s| * ||A||_F * ||B||_F in float64: no input x gives ||s B A x|| above it times ||x||."""
    return abs(float(scaling)) * norm_and_finite(lora_a)[0] * norm_and_finite(lora_b)[0]


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
