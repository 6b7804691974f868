"""Patches on the engine core and its workers: adapters admitted off the engine's step, unloads that reach the
engine (`vllm_bdlora.adapter_lifecycle.engine`, `vllm_bdlora.adapter_lifecycle.worker`)."""

from __future__ import annotations

from functools import partial

from vllm_bdlora.compat import MODEL_RUNNER_MODULES, modules_with
from vllm_bdlora.patching import UpstreamContractError, add_method, require_parameters, wrap_function, wrap_method


def patch_engine_core_admission() -> bool:
    """With BD-LoRA on, the engine core admits adapters without waiting for their files, holds requests whose
    adapter is being admitted, and removes an unloaded adapter once its requests are done."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    from vllm_bdlora.adapter_lifecycle import engine as engine_side

    contracts = {"add_lora": ("lora_request",), "remove_lora": ("lora_id",),
                 "add_request": ("request", "request_wave"), "abort_requests": ("request_ids",)}  # fmt: skip
    for name, params in contracts.items():
        require_parameters(getattr(EngineCore, name), params, f"EngineCore.{name}")
    require_parameters(EngineCoreProc._handle_client_request, ("request_type", "request"),
                       "EngineCoreProc._handle_client_request")  # fmt: skip
    import inspect

    if "self.input_queue" not in inspect.getsource(inspect.unwrap(EngineCoreProc.__init__)):
        raise UpstreamContractError("vllm-bdlora: EngineCoreProc no longer keeps an input_queue.")

    def make_add_lora(original):
        def add_lora(self, lora_request):
            return engine_side.add_lora(self, lora_request, partial(original, self))

        return add_lora

    def make_remove_lora(original):
        def remove_lora(self, lora_id):
            return engine_side.remove_lora(self, lora_id, partial(original, self))

        return remove_lora

    def make_add_request(original):
        def add_request(self, request, request_wave=0):
            return engine_side.add_request(self, request, request_wave, partial(original, self))

        return add_request

    def make_abort_requests(original):
        def abort_requests(self, request_ids):
            return engine_side.abort_requests(self, request_ids, partial(original, self))

        return abort_requests

    def make_handle(original):
        def _handle_client_request(self, request_type, request):
            return engine_side.handle_client_request(self, request_type, request, partial(original, self))

        return _handle_client_request

    changed = [
        wrap_method(EngineCore, "add_lora", make_add_lora),
        wrap_method(EngineCore, "remove_lora", make_remove_lora),
        wrap_method(EngineCore, "add_request", make_add_request),
        wrap_method(EngineCore, "abort_requests", make_abort_requests),
        wrap_method(EngineCoreProc, "_handle_client_request", make_handle),
    ]
    return any(changed)


def patch_in_process_requests_admit_first() -> bool:
    """With BD-LoRA on and the engine core in the caller's process, a request's adapter is admitted before vLLM
    registers the request, so that a refused adapter fails the call that named it and the engine goes on."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_bdlora.adapter_lifecycle import engine as engine_side

    require_parameters(LLMEngine.add_request, ("request_id", "prompt", "params", "arrival_time", "lora_request"),
                       "LLMEngine.add_request")  # fmt: skip

    def make_add_request(original):
        def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None, *args, **kwargs):
            # a prepared EngineCoreRequest (deprecated by vLLM, still accepted) carries its own adapter
            engine_side.admit_before_request(self.engine_core, getattr(prompt, "lora_request", lora_request))
            return original(self, request_id, prompt, params, arrival_time, lora_request, *args, **kwargs)

        return add_request

    return wrap_method(LLMEngine, "add_request", make_add_request)


def patch_prefix_cache_keyed_by_admission() -> bool:
    """With BD-LoRA on, an adapter's cached KV blocks are keyed by its admission too, not only its name and path."""
    from vllm.v1.engine.core import EngineCore

    from vllm_bdlora.adapter_lifecycle import engine as engine_side

    require_parameters(EngineCore.preprocess_add_request, ("request",), "EngineCore.preprocess_add_request")

    def make_preprocess(original):
        def preprocess_add_request(self, request):
            return engine_side.preprocess_add_request(self, request, partial(original, self))

        return preprocess_add_request

    def make_hash_keys(original):
        def _gen_lora_extra_hash_keys(request):
            return engine_side.lora_hash_keys_with_generation(original(request), request)

        return _gen_lora_extra_hash_keys

    module = "vllm.v1.core.kv_cache_utils"
    return any([
        wrap_method(EngineCore, "preprocess_add_request", make_preprocess),
        wrap_function(module, "_gen_lora_extra_hash_keys", make_hash_keys, required=("request",)),
    ])  # fmt: skip


def patch_scheduler_ends_non_finite_requests() -> bool:
    """A request whose logits the workers counted as not finite is finished with an error naming its adapter, its
    stand-in token dropped; the step's other requests go on (`vllm_bdlora.non_finite`)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_bdlora.non_finite import NON_FINITE_ATTRIBUTE, ends_request, non_finite_requests

    require_parameters(Scheduler.update_from_output, ("scheduler_output", "model_runner_output"),
                       "Scheduler.update_from_output")  # fmt: skip
    require_parameters(Scheduler._update_request_with_output, ("request", "new_token_ids"),
                       "Scheduler._update_request_with_output")  # fmt: skip

    def make_update(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            setattr(self, NON_FINITE_ATTRIBUTE, non_finite_requests(model_runner_output))
            try:
                return original(self, scheduler_output, model_runner_output)
            finally:
                setattr(self, NON_FINITE_ATTRIBUTE, frozenset())

        return update_from_output

    def make_request_update(original):
        def _update_request_with_output(self, request, new_token_ids, *args, **kwargs):
            if ends_request(self, request):
                return [], True
            return original(self, request, new_token_ids, *args, **kwargs)

        return _update_request_with_output

    return any([
        wrap_method(Scheduler, "update_from_output", make_update),
        wrap_method(Scheduler, "_update_request_with_output", make_request_update),
    ])  # fmt: skip


def bdlora_admission(self, call):
    """The workers' side of the engine core's admission calls (`vllm_bdlora.adapter_lifecycle.calls`)."""
    from vllm_bdlora.adapter_lifecycle.worker import answer_admission_call

    return answer_admission_call(self.model_runner.lora_manager, call, self.add_lora)


def patch_worker_admission_calls() -> bool:
    """Give vLLM's workers the method the engine core's admission calls name (collective_rpc by name, as vLLM calls
    its own worker methods; no function is pickled)."""
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_bdlora.adapter_lifecycle.calls import WORKER_METHOD

    return add_method(WorkerBase, WORKER_METHOD, bdlora_admission)


def bdlora_ping(self) -> bool:
    """Answered by the engine core between steps: /health's sign that it comes back to its requests."""
    return True


def patch_engine_core_answers_pings() -> bool:
    from vllm.v1.engine.core import EngineCore

    return add_method(EngineCore, "bdlora_ping", bdlora_ping)


def patch_scheduler_lora_holds() -> bool:
    """Hold waiting requests out of a step: to bound how long a request waits for a LoRA slot, and while an adapter
    is filled ahead of the step its request joins (`vllm_bdlora.scheduling`)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_bdlora.config import BdLoraSettings
    from vllm_bdlora.scheduling import hold_back, hold_for_fills, put_back, starved_adapter

    require_parameters(Scheduler.schedule, ("self",), "Scheduler.schedule")
    for queue_method in ("remove_requests", "add_request"):
        from vllm.v1.core.sched.request_queue import RequestQueue

        if not hasattr(RequestQueue, queue_method):
            raise UpstreamContractError(f"vllm-bdlora: vLLM's RequestQueue has no {queue_method}.")

    def make(original):
        def schedule(self, *args, **kwargs):
            settings = getattr(self, "_bdlora_settings", None)
            if settings is None:
                settings = self._bdlora_settings = BdLoraSettings.from_vllm_config(getattr(self, "vllm_config", None))
            if not settings.enabled:
                return original(self, *args, **kwargs)
            starved = starved_adapter(self, settings.lora_wait_limit_s)
            held = hold_back(self, starved) if starved is not None else []
            if settings.hold_for_slot_fills:
                held += hold_for_fills(self)
            if not held:
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                put_back(held)

        return schedule

    return wrap_method(Scheduler, "schedule", make)


def patch_slots_beyond_the_step_limit() -> bool:
    """The scheduler limits its steps to --max-loras adapters while the workers have slots beyond (fill_ahead_slots),
    and names on each step the adapters its waiting requests need; each worker fills those after launching the step,
    so that the copies run beside it (`vllm_bdlora.adapter_lifecycle.fill_ahead`)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_bdlora.adapter_lifecycle.fill_ahead import name_waiting_adapters, scheduler_lora_config
    from vllm_bdlora.adapter_lifecycle.worker import fill_for_waiting_requests, note_waiting_requests

    require_parameters(Scheduler.__init__, ("vllm_config",), "Scheduler.__init__")
    require_parameters(Scheduler._update_after_schedule, ("scheduler_output",), "Scheduler._update_after_schedule")
    runners = [module.GPUModelRunner for module in modules_with("GPUModelRunner", MODEL_RUNNER_MODULES)]
    for runner in runners:
        require_parameters(runner.execute_model, ("scheduler_output",), f"{runner.__module__}.execute_model")

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if getattr(self, "lora_config", None) is not None:
                self.lora_config = scheduler_lora_config(self.lora_config)

        return __init__

    def make_after_schedule(original):
        # the last thing vLLM's schedule() does with a step's output, in every release (schedule itself is wrapped
        # by scheduler_lora_holds)
        def _update_after_schedule(self, scheduler_output, *args, **kwargs):
            original(self, scheduler_output, *args, **kwargs)
            name_waiting_adapters(self, scheduler_output)

        return _update_after_schedule

    def make_execute(original):
        # the model runners', not the worker's: the Ray executor calls them directly (the CPU one is a subclass of the
        # first; 0.26 on a GPU runs dense models on the second)
        def execute_model(self, scheduler_output, *args, **kwargs):
            note_waiting_requests(getattr(self, "lora_manager", None), scheduler_output)
            output = original(self, scheduler_output, *args, **kwargs)
            with torch.inference_mode():  # as the step's own fills run
                fill_for_waiting_requests(getattr(self, "lora_manager", None), scheduler_output)
            return output

        return execute_model

    return any([
        wrap_method(Scheduler, "__init__", make_init),
        wrap_method(Scheduler, "_update_after_schedule", make_after_schedule),
        *[wrap_method(runner, "execute_model", make_execute) for runner in runners],
    ])  # fmt: skip


def bdlora_adapter_stats(self) -> dict:
    """Answered by the engine core between steps, for /metrics (`vllm_bdlora.metrics`): its step durations, its
    scheduler's holds, and what its workers hold where, with their counts."""
    from vllm_bdlora.metrics import engine_step_stats, worker_figures
    from vllm_bdlora.scheduling import held_counts

    steps = engine_step_stats(self).steps
    stats = {"steps": steps.snapshot()}
    scheduler = getattr(self, "scheduler", None)
    if scheduler is not None:
        stats["held"] = dict(held_counts(scheduler))
    if getattr(self.vllm_config, "lora_config", None) is not None:
        stats["workers"] = worker_figures(self.model_executor).current(steps.count)
    return stats


def patch_engine_core_adapter_stats() -> bool:
    """The engine core times its steps and answers /metrics' poll with its workers' adapter figures."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    from vllm_bdlora.metrics import engine_step_stats

    require_parameters(EngineCoreProc._process_engine_step, ("self",), "EngineCoreProc._process_engine_step")

    def make(original):
        def _process_engine_step(self):
            return engine_step_stats(self).timed(lambda: original(self))

        return _process_engine_step

    timed = wrap_method(EngineCoreProc, "_process_engine_step", make)
    added = add_method(EngineCore, "bdlora_adapter_stats", bdlora_adapter_stats)
    return timed or added
