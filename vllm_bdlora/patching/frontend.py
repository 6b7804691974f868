"""Patches on the OpenAI-compatible API server process."""

from __future__ import annotations

import sys
from http import HTTPStatus

from vllm_bdlora.adapters import AdapterRejected
from vllm_bdlora.patching import wrap_method

SERVING_MODELS_MODULE = "vllm.entrypoints.openai.models.serving"


def as_bad_request(response):
    """vLLM answers every adapter load failure but "not found" with 500; a rejected adapter is the
    client's input, so answer 400 with the same message."""
    error = getattr(response, "error", None)
    if error is not None and AdapterRejected.MARKER in error.message:
        error.code = HTTPStatus.BAD_REQUEST.value
        error.type = "BadRequestError"
    return response


def patch_load_lora_adapter_status() -> bool:
    # Only the API server has (and needs) this module; it is imported there before plugins load, and
    # importing it into engine workers would only cost them start-up time.
    module = sys.modules.get(SERVING_MODELS_MODULE)
    if module is None:
        return False

    def make(original):
        async def load_lora_adapter(self, *args, **kwargs):
            return as_bad_request(await original(self, *args, **kwargs))

        return load_lora_adapter

    return wrap_method(module.OpenAIServingModels, "load_lora_adapter", make)
