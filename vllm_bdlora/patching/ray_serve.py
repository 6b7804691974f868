"""Patches on Ray Serve LLM's vLLM engine, in the replica process of a `ray.serve.llm` deployment."""

from __future__ import annotations

import sys

from vllm_bdlora.access import AdapterLoadRefused, adapter_failure_status
from vllm_bdlora.patching import require_parameters, wrap_method

RAY_VLLM_ENGINE_MODULE = "ray.llm._internal.serve.engines.vllm.vllm_engine"


def in_ray_serve_replica() -> bool:
    # A Ray Serve LLM replica imports its vLLM engine class before vLLM loads plugins; no other process needs Ray.
    return RAY_VLLM_ENGINE_MODULE in sys.modules


def patch_ray_serve_adapter_refusals() -> bool:
    """Ray Serve LLM turns every failed adapter load into a ValueError, which it answers with HTTP 500 and a
    traceback; answer a refused adapter with the status and message the API server gives it."""
    if not in_ray_serve_replica():
        return False
    engine = sys.modules[RAY_VLLM_ENGINE_MODULE].VLLMEngine
    require_parameters(engine.resolve_lora, ("disk_lora_model",), "VLLMEngine.resolve_lora")

    def make(original):
        async def resolve_lora(self, disk_lora_model):
            try:
                return await original(self, disk_lora_model)
            except ValueError as error:
                status = adapter_failure_status(str(error))
                if status is None:
                    raise
                raise AdapterLoadRefused(str(error), status) from error

        return resolve_lora

    return wrap_method(engine, "resolve_lora", make)
