"""What a BD-enabled LoRA manager adds to vLLM's: the refusals checked before any layer is built, the settings its
layers are built with, and the start-up report (what was claimed, how it is sharded, which kernels run)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.experts import refuse_lora_experts_on_cpu
from vllm_bdlora.kernels.plans import DEFAULT_MAX_MIXED_WIDTH, largest_tile, one_launch_tokens
from vllm_bdlora.layers import (
    base_quantization,
    describe_sharding,
    describe_slots,
    selecting_bd_layers,
    unreadable_base,
    uses_fused_kernels,
)
from vllm_bdlora.sharding import per_rank_width

logger = logging.getLogger("vllm.bdlora")


def refuse_incompatible(lora_config, model=None) -> None:
    """LoRA settings and models that cannot be served, refused before the model's LoRA layers are built."""
    from vllm.platforms import current_platform

    if lora_config.fully_sharded_loras:
        raise ValueError(
            "BD-LoRA (--enable-bdlora) and --fully-sharded-loras cannot be combined: drop --fully-sharded-loras."
        )
    if model is not None and current_platform.is_cpu():
        refuse_lora_experts_on_cpu(model, lora_config)


def is_first_tp_rank(manager) -> bool:
    """True on the first tensor-parallel rank only, so each log line appears once per engine."""
    return all(getattr(layer, "tp_rank", 0) == 0 for layer in manager.modules.values())


@contextmanager
def building_bd_layers(settings: BdLoraSettings, lora_config, model=None) -> Iterator[None]:
    """Inside: vLLM's manager builds BD layers, each holding `settings`."""
    refuse_incompatible(lora_config, model)
    with selecting_bd_layers(settings):
        yield


def log_startup_report(manager, settings: BdLoraSettings, lora_config, vllm_config) -> None:
    """The start-up report, from the first TP rank only."""
    lines = startup_report(manager, settings, lora_config, vllm_config)
    if is_first_tp_rank(manager):
        for line in lines:
            logger.info(line)


def startup_report(manager, settings: BdLoraSettings, lora_config, vllm_config) -> list[str]:
    """One line per BD layer kind and slot budget (`describe_sharding`), then DoRA, kernels and eager steps."""
    from vllm.platforms import current_platform  # resolved once the engine runs

    from vllm_bdlora.adapter_lifecycle.fill_ahead import adapters_per_step

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    layers = list(manager.modules.values())
    lines = describe_sharding(layers, tp_size)
    if not lines:
        logger.warning("vllm-bdlora: BD-LoRA is on but no layer of this model was given a BD LoRA layer.")
    per_step = adapters_per_step(lora_config)
    lines.append(describe_slots(layers, lora_config.max_loras, current_platform.is_cuda_alike(), per_step))
    if settings.dora:
        quantized = sorted({m for layer in layers if (m := base_quantization(layer))})
        unreadable = sorted({m for layer in layers if (m := base_quantization(layer)) and unreadable_base(layer)})
        if unreadable:
            lines.append(
                f"DoRA adapters are refused on this model's {', '.join(unreadable)} layers: they quantize "
                "activations with a static scale, so the dequantized weight DoRA's magnitude norm needs cannot be "
                "read exactly. LoRA adapters are served."
            )
        elif quantized:
            lines.append(
                f"DoRA over quantized base layers ({', '.join(quantized)}): magnitude norms are taken over the "
                "dequantized weight, read at adapter load through each layer's own GEMM."
            )
        path = "fused Triton kernel" if current_platform.is_cuda_alike() else "torch reference"
        lines.append(
            "DoRA on: each BD layer keeps a float32 magnitude scale per LoRA slot and output channel; "
            f"compose base + (g-1)(base - bias) + g*lora per token: {path}."
        )
    kernels = settings.lora_kernels
    if uses_fused_kernels(kernels):
        lines.append(
            f"LoRA kernels ({kernels}): vllm-bdlora's shrink + fused expand in every BD layer, one launch "
            'each for all slices of a packed layer ("lora_kernels": "vllm" in the bdlora section of '
            "--additional-config selects vLLM's)."
        )
        if settings.one_launch_decode and not settings.dora:
            width = per_rank_width(lora_config.max_lora_rank, tp_size)
            lines.append(one_launch_summary(settings, per_step, width))
    else:
        why = "not on CUDA" if kernels == "auto" else "as configured"
        lines.append(f"LoRA kernels ({kernels}): vLLM's own shrink/expand ({why}).")
    eager_steps = eager_steps_summary(vllm_config) if current_platform.is_cuda_alike() else None
    if eager_steps:
        lines.append(eager_steps)
    return lines


def one_launch_summary(settings: BdLoraSettings, max_loras: int, width: int) -> str:
    """The report's line on which decode batches run as one kernel per BD layer, `width` LoRA columns per GPU."""
    max_adapters = settings.one_launch_max_adapters
    set_width = settings.one_launch_max_mixed_width
    # the row-width rule; a GPU's plan table may have measured a projection's limit instead (logged per layer shape)
    limit = min(settings.one_launch_max_tokens, one_launch_tokens(None, set_width, max_adapters, width, max_loras))
    knobs = '"one_launch_max_tokens": 16 or 32 lowers the limit, "one_launch_decode": false turns it off'
    if max_loras > 1:
        if set_width is None:
            within = (f"while t x {width} stays within {DEFAULT_MAX_MIXED_WIDTH} columns, or in a projection this "
                      "GPU's plan table has measured, up to the tokens where the one kernel beat the three kernels "
                      "there (logged per layer shape)")  # fmt: skip
        else:
            within = f'while t x {width} stays within "one_launch_max_mixed_width": {set_width} columns'
        mixing = (
            f"a batch of t tokens may mix min(t, {max_loras}) adapters of {width} LoRA columns per GPU, and the one "
            f"kernel serves it {within} (each token row gathers its own adapter's B) and it may "
            f'mix at most "one_launch_max_adapters": {max_adapters}'
        )
        if limit == 0:
            return f"Decode batches take the three kernels: with --max-loras {max_loras} {mixing}."
        knobs = f"at most {largest_tile(max_loras)} with --max-loras above 1: {mixing}; {knobs}"
    tokens = "1 token" if limit == 1 else f"{limit} tokens"
    return (f"Decode batches of up to {tokens}: base GEMV + LoRA in one kernel per BD layer over an unquantized "
            f"base ({knobs}).")  # fmt: skip


def eager_steps_summary(vllm_config) -> str | None:
    """The report's line on which steps run outside CUDA graphs, where every LoRA layer op pays its host time (a
    Triton launch from Python costs more host time than the GPU time of a prefill's LoRA kernels). None where
    every step fits a graph."""
    # getattr throughout: a log line must never stop a server whose vLLM names these differently
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    eager = getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False)
    if eager or getattr(mode, "name", "") == "NONE":
        return ("CUDA graphs are off (--enforce-eager or cudagraph_mode NONE): every step pays the LoRA layers' host "
                "time, which outweighs their GPU time at decode sizes.")  # fmt: skip
    largest = getattr(compilation, "max_cudagraph_capture_size", None)
    batched = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    if not isinstance(largest, int) or not isinstance(batched, int) or batched <= largest:
        return None
    return (f"Steps of more than {largest} tokens (prefills of longer prompts; up to {batched} per step) run outside "
            "CUDA graphs, where the LoRA layers' host time adds to time to first token; for long prompts at low "
            "concurrency capture larger graphs: --compilation-config "
            "'{\"max_cudagraph_capture_size\": N}'.")  # fmt: skip
