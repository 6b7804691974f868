"""A request whose logits are not finite ends alone, with an error naming its adapter.

Admission refuses every adapter whose values could overflow (`vllm_bdlora.adapter_lifecycle.values`), but a finite
adapter can still drive a row's logits to NaN or +Inf in 16-bit arithmetic, and so can weights corrupted after
admission. vLLM samples such a row anyway: on a GPU its sampling kernels can return an index past the vocabulary,
which the next step uses to index the embeddings (a device-side assert: the engine dies for every tenant); on the
CPU the row's answer is silently garbage. Here:

* in every worker, before sampling: a row holding NaN or +Inf (-Inf is how vLLM masks tokens) is marked NaN in
  the logits vLLM counts (`VLLM_COMPUTE_NANS_IN_LOGITS`, which BD-LoRA servers turn on: per-row counts in the
  step's output) and sampled from a finite stand-in, so the token is a valid index. vLLM's first model runner
  counts after its sampler runs (`sample_safely` around the sampler); its second (the default for dense models on
  GPUs from 0.26) counts inside its sampler's call, before sampling (`mark_non_finite_rows` around the call,
  `finite_stand_in` around its sampling);
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


def mark_non_finite_rows(logits):
    """Set every row of `logits` holding NaN or +Inf to NaN throughout, in place: vLLM's per-row NaN count (taken
    from this tensor) then reports it. Returns the rows' mask ([rows, 1]); no host synchronisation."""
    import torch

    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1, keepdim=True)
    logits.masked_fill_(bad, float("nan"))
    return bad


def finite_stand_in(logits, bad=None):
    """The logits to sample from: rows holding NaN (`bad`, else found here) replaced by zeros, every token equally
    likely, so the sampled index lies inside the vocabulary whatever sampler runs."""
    import torch

    if bad is None:
        bad = torch.isnan(logits).any(dim=-1, keepdim=True)
    return torch.where(bad, torch.zeros((), dtype=logits.dtype, device=logits.device), logits)


def sample_safely(logits):
    """For a sampler whose caller counts NaN in `logits` afterwards (vLLM's model runner): mark the rows, sample from
    the stand-in."""
    return finite_stand_in(logits, mark_non_finite_rows(logits))


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
