"""Mixture-of-experts layers under LoRA: which ones vLLM wraps for LoRA, and how the CPU backend builds them.

vLLM runs LoRA on a mixture of experts' experts with Triton kernels only, and it builds every experts layer for
those kernels whenever LoRA is on, whatever `--lora-target-modules` says. Its CPU build has no Triton, so on the
CPU any LoRA server over a MoE model would stop at its first step, even one whose adapters leave the experts alone.
With BD-LoRA on and `--lora-target-modules` given, the CPU backend builds the experts as without LoRA (its own MoE
kernels); a LoRA manager that would still wrap an experts layer (no targets given, or targets naming the experts)
is refused before any LoRA layer is built (`lora_wrapped_experts`).
"""

from __future__ import annotations

CPU_EXPERTS_HINT = (
    "needs vLLM's Triton kernels, which its CPU build does not have: serve it on a CUDA GPU, or, for adapters that "
    "leave the experts alone, pass --lora-target-modules naming the projections they adapt (e.g. qkv_proj o_proj)."
)


def lora_wrapped_experts(model, lora_config) -> list[str]:
    """The experts layers vLLM's LoRA manager will wrap for LoRA, by vLLM's own rule: all of them when no
    `--lora-target-modules` is given, else those the targets name (the layer, or its packed expert modules)."""
    from vllm.lora.utils import is_in_target_modules, process_packed_modules_mapping
    from vllm.model_executor.layers.fused_moe import MoERunner

    experts = [name for name, module in model.named_modules() if isinstance(module, MoERunner)]
    if not experts or lora_config.target_modules is None:
        return experts
    packed = process_packed_modules_mapping(model)
    return [name for name in experts if is_in_target_modules(name, lora_config.target_modules, packed)]


def refuse_lora_experts_on_cpu(model, lora_config) -> None:
    """On the CPU backend, refuse a LoRA manager that would wrap an experts layer (see the module's docstring)."""
    experts = lora_wrapped_experts(model, lora_config)
    if experts:
        raise ValueError(f"LoRA on a mixture of experts' experts ({len(experts)} layer(s), e.g. {experts[0]}) "
                         f"{CPU_EXPERTS_HINT}")  # fmt: skip


def experts_built_for_lora(vllm_config) -> bool:
    """Whether an experts layer built under `vllm_config` takes vLLM's LoRA MoE kernels: not on the CPU backend for
    a BD-LoRA server whose LoRA targets are given (the manager refuses it if those targets name the experts)."""
    from vllm.platforms import current_platform

    from vllm_bdlora.config import BdLoraSettings

    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        return False
    if not current_platform.is_cpu() or lora_config.target_modules is None:
        return True
    return not BdLoraSettings.from_vllm_config(vllm_config).enabled
