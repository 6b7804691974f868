"""A request whose logits are not finite ends alone, with an error naming its adapter.

Admission refuses every adapter whose values could overflow (`vllm_bdlora.adapter_values`), but a finite adapter
can still drive a row's logits to NaN or +Inf in 16-bit arithmetic, and so can weights corrupted after admission.
vLLM samples such a row anyway: on a GPU its sampling kernels can return an index past the vocabulary, which the
next step uses to index the embeddings (a device-side assert: the engine dies for every tenant); on the CPU the
row's answer is silently garbage. Here:

* in every worker, before sampling (`sample_safely`): a row holding NaN or +Inf (-Inf is how vLLM masks tokens) is
  sampled from a finite stand-in, so the token is a valid index, and is marked NaN in the logits vLLM counts
  afterwards (`VLLM_COMPUTE_NANS_IN_LOGITS`, which BD-LoRA servers turn on: per-row counts in the step's output);
* in the scheduler (`ends_request`): a request whose row was counted is finished with vLLM's error status, its
  stand-in token dropped, its `stop_reason` naming the adapter, and the log says so; every other request of the
  batch goes on;
* in the API server (`raise_if_ended`): such an output becomes an HTTP 422 (in a stream, an error event) whose
  message names the adapter, where vLLM would answer a bare "Internal server error".
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.bdlora")

COUNT_NANS_VARIABLE = "VLLM_COMPUTE_NANS_IN_LOGITS"
MARKER = "the logits of this request held NaN or Inf"
NON_FINITE_ATTRIBUTE = "_bdlora_non_finite_requests"  # the request ids of the step being processed


def sample_safely(logits):
    """The logits to sample from: rows holding NaN or +Inf replaced by zeros (every token equally likely); those rows
    of `logits` itself are set to NaN, so vLLM's per-row NaN count reports them. No host synchronisation."""
    import torch

    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1, keepdim=True)
    safe = torch.where(bad, torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
    logits.masked_fill_(bad, float("nan"))
    return safe


def non_finite_requests(model_runner_output) -> frozenset[str]:
    counts = getattr(model_runner_output, "num_nans_in_logits", None) or {}
    return frozenset(request_id for request_id, count in counts.items() if count)


def non_finite_message(request) -> str:
    lora = getattr(request, "lora_request", None)
    source = f"LoRA adapter '{lora.lora_name}'" if lora is not None else "the base model"
    return (
        f"{source}: {MARKER}, so it was ended; the other requests were not "
        "affected. Check the adapter's weights, or serve it in a wider dtype (--dtype bfloat16 or float32)."
    )


def ends_request(scheduler, request) -> bool:
    """True if `request` is one whose logits were not finite this step; it is then marked finished with an error."""
    if request.request_id not in getattr(scheduler, NON_FINITE_ATTRIBUTE, ()):
        return False
    from vllm.v1.request import RequestStatus

    message = non_finite_message(request)
    request.status = RequestStatus.FINISHED_ERROR
    if hasattr(request, "resumable"):
        request.resumable = False
    request.stop_reason = message
    logger.warning("vllm-bdlora: request %s ended: %s", request.request_id, message)
    return True


def raise_if_ended(output) -> None:
    """Raise the API's error for a `RequestOutput` this module ended (see the module's docstring)."""
    for completion in getattr(output, "outputs", None) or ():
        reason = getattr(completion, "stop_reason", None)
        if getattr(completion, "finish_reason", None) == "error" and isinstance(reason, str) and MARKER in reason:
            from http import HTTPStatus

            from vllm.exceptions import GenerationError

            error = GenerationError(reason)
            error.status_code = HTTPStatus.UNPROCESSABLE_ENTITY
            raise error
