"""Patches on vLLM's worker-side LoRA machinery (run in every engine/worker process)."""

from __future__ import annotations

import inspect
from functools import partial

from vllm_bdlora.compat import cpu_kv_cache_write
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.patching import UpstreamContractError, require_parameters, wrap_function, wrap_method

ADAPTER_FLAGS_WE_INTERPRET = ("use_bdlora", "use_dora")


def patch_peft_helper_defers_adapter_flags() -> bool:
    """PEFTHelper rejects `use_dora` (and, after 0.26, `use_bdlora`); both keys are ours to interpret
    (see `patch_adapter_loading`), so keep them out of PEFTHelper."""
    from vllm.lora.peft_helper import PEFTHelper

    require_parameters(PEFTHelper.from_dict, ("config_dict",), "PEFTHelper.from_dict")

    def make(original):
        def from_dict(cls, config_dict: dict):
            return original(cls, {k: v for k, v in config_dict.items() if k not in ADAPTER_FLAGS_WE_INTERPRET})

        return from_dict

    return wrap_method(PEFTHelper, "from_dict", make)


def patch_lora_layer_classes() -> bool:
    """Put the BD layer classes first in vLLM's ordered tuple of LoRA layer classes. They claim layers
    only while a BD-enabled manager is being built (see `patch_lora_manager`)."""
    import vllm.lora.utils as lora_utils

    from vllm_bdlora.layers import BD_LAYER_CLASSES

    classes = lora_utils._all_lora_classes
    if not isinstance(classes, tuple):
        raise UpstreamContractError(
            f"vllm.lora.utils._all_lora_classes is a {type(classes).__name__}, expected an ordered tuple."
        )
    if classes[: len(BD_LAYER_CLASSES)] == BD_LAYER_CLASSES:
        return False
    rest = tuple(c for c in classes if c not in BD_LAYER_CLASSES)
    lora_utils._all_lora_classes = BD_LAYER_CLASSES + rest
    return True


def patch_lora_manager() -> bool:
    """Build BD layers when `additional_config["bdlora"]` is on, put the fused ones' slots in one arena
    (`vllm_bdlora.slot_arena`), and log how they shard adapters."""
    from vllm.lora.model_manager import LoRAModelManager

    from vllm_bdlora.manager import building_bd_layers, log_startup_report
    from vllm_bdlora.slot_arena import bind_slot_arena

    require_parameters(LoRAModelManager.__init__, ("model", "lora_config", "vllm_config"), "LoRAModelManager.__init__")

    def make(original):
        def __init__(self, *args, **kwargs):
            vllm_config = kwargs.get("vllm_config")
            settings = BdLoraSettings.from_vllm_config(vllm_config)
            self._bdlora_settings = settings
            if not settings.enabled:
                return original(self, *args, **kwargs)
            model = kwargs["model"] if "model" in kwargs else args[0]
            with building_bd_layers(settings, kwargs["lora_config"], model):
                original(self, *args, **kwargs)
            bind_slot_arena(self)
            log_startup_report(self, settings, kwargs["lora_config"], vllm_config)

        return __init__

    return wrap_method(LoRAModelManager, "__init__", make)


def patch_adapter_loading() -> bool:
    """Fill a LoRA slot from what the worker admitted (checked and cut to this rank's share) rather than from the
    adapter's files, and forget it there on an unload (`vllm_bdlora.adapter_lifecycle.worker`)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_bdlora.adapter_lifecycle.worker import load_adapter, remove_adapter

    require_parameters(WorkerLoRAManager._load_adapter, ("lora_request",), "WorkerLoRAManager._load_adapter")
    require_parameters(WorkerLoRAManager.remove_adapter, ("adapter_id",), "WorkerLoRAManager.remove_adapter")

    def make_load(original):
        def _load_adapter(self, lora_request):
            return load_adapter(self, lora_request, partial(original, self))

        return _load_adapter

    def make_remove(original):
        # Only an explicit removal (the executor's remove_lora: an unload) lands here: vLLM v1's workers use the LRU
        # manager, whose per-step adapter application evicts through the model manager.
        def remove_adapter_and_forget(self, adapter_id):
            return remove_adapter(self, adapter_id, partial(original, self))

        return remove_adapter_and_forget

    loading = wrap_method(WorkerLoRAManager, "_load_adapter", make_load)
    removing = wrap_method(WorkerLoRAManager, "remove_adapter", make_remove)
    return loading or removing


def patch_add_lora_failures() -> bool:
    """Report adapter load failures from every TP rank as replies and raise them in the executor, so no
    stale reply is left in vLLM's worker queues (see `AdapterLoadFailure`)."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from vllm_bdlora.adapter_lifecycle.engine import add_lora_on_every_rank
    from vllm_bdlora.adapter_lifecycle.worker import add_lora_reporting_failures

    require_parameters(LoRAModelRunnerMixin.add_lora, ("lora_request",), "LoRAModelRunnerMixin.add_lora")
    require_parameters(Executor.add_lora, ("lora_request",), "Executor.add_lora")

    def make_runner_add_lora(original):
        def add_lora(self, lora_request):
            return add_lora_reporting_failures(self, lora_request, partial(original, self))

        return add_lora

    def make_executor_add_lora(original):
        def add_lora(self, lora_request):
            return add_lora_on_every_rank(self, lora_request)

        return add_lora

    runner = wrap_method(LoRAModelRunnerMixin, "add_lora", make_runner_add_lora)
    executor = wrap_method(Executor, "add_lora", make_executor_add_lora)
    return runner or executor


def patch_admission_leaves_engine_caches() -> bool:
    """An admission's add_lora stops at the store where vLLM's host cache or GPU slots have no room
    (`admission_leaves_engine_caches`)."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from vllm_bdlora.adapter_lifecycle.worker import admission_leaves_engine_caches

    require_parameters(LRUCacheWorkerLoRAManager.add_adapter, ("lora_request",),
                       "LRUCacheWorkerLoRAManager.add_adapter")  # fmt: skip
    source = inspect.getsource(inspect.unwrap(LRUCacheWorkerLoRAManager.add_adapter))
    for step in ("self._load_adapter(", "remove_oldest_adapter", "activate_adapter("):
        if step not in source:
            raise UpstreamContractError(f"vllm-bdlora: LRUCacheWorkerLoRAManager.add_adapter no longer calls {step}.")

    def make(original):
        def add_adapter(self, lora_request):
            if admission_leaves_engine_caches(self, lora_request):
                self._load_adapter(lora_request)  # checked, finished and kept, as vLLM's load would have it
                return True
            return original(self, lora_request)

        return add_adapter

    return wrap_method(LRUCacheWorkerLoRAManager, "add_adapter", make)


def patch_pin_registers_kept_adapters() -> bool:
    """A pin of an adapter the worker kept but vLLM's host cache does not hold registers it from the store first
    (`register_kept_before_pin`)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_bdlora.adapter_lifecycle.worker import register_kept_before_pin

    require_parameters(WorkerLoRAManager.pin_adapter, ("adapter_id",), "WorkerLoRAManager.pin_adapter")

    def make(original):
        def pin_adapter(self, adapter_id):
            register_kept_before_pin(self, adapter_id)
            return original(self, adapter_id)

        return pin_adapter

    return wrap_method(WorkerLoRAManager, "pin_adapter", make)


def patch_message_queue_waits_while_admitting() -> bool:
    """vLLM's message-queue reader waits for a message, rather than spinning for one, while its process admits
    adapters and runs no engine steps (`wait_for_engine_message`)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from vllm_bdlora.adapter_lifecycle.worker import wait_for_engine_message

    require_parameters(SpinCondition.wait, ("timeout_ms",), "SpinCondition.wait")
    if "self.last_read + self.busy_loop_s" not in inspect.getsource(inspect.unwrap(SpinCondition.wait)):
        raise UpstreamContractError("vllm-bdlora: SpinCondition.wait no longer spins until last_read + busy_loop_s.")

    def make(original):
        def wait(self, timeout_ms=None):
            return wait_for_engine_message(self, timeout_ms, original)

        return wait

    return wrap_method(SpinCondition, "wait", make)


def patch_whole_slot_fills() -> bool:
    """A slot activation of an adapter kept as a slot image copies the image whole instead of calling every BD
    layer's set_lora (`vllm_bdlora.slot_arena.activate_filling_whole_slot`)."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager

    from vllm_bdlora.slot_arena import activate_filling_whole_slot

    require_parameters(LRUCacheLoRAModelManager.activate_adapter, ("lora_id",),
                       "LRUCacheLoRAModelManager.activate_adapter")  # fmt: skip
    source = inspect.getsource(inspect.unwrap(LRUCacheLoRAModelManager.activate_adapter))
    if "super().activate_adapter(" not in source:
        raise UpstreamContractError("vllm-bdlora: LRUCacheLoRAModelManager.activate_adapter no longer activates "
                                    "through LoRAModelManager.activate_adapter.")  # fmt: skip

    def make(original):
        def activate_adapter(self, lora_id):
            return activate_filling_whole_slot(self, lora_id, lambda: original(self, lora_id))

        return activate_adapter

    return wrap_method(LRUCacheLoRAModelManager, "activate_adapter", make)


CPU_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
CPU_LORA_OP_NAMESPACES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)


def ignore_unadapted_tokens(op):
    """Make a CPU bgmv op treat LoRA index -1 ("no adapter") as no contribution, instead of indexing
    the last LoRA slot as Python's negative indexing does. The op runs those rows against slot 0 and their
    output rows are then put back as they were: zeroing their inputs instead would still turn a non-finite
    weight in slot 0 into NaN (0 * NaN), and leak it into base-model rows."""

    def masked(inputs, weights, output, lora_indices, *args, **kwargs):
        unadapted = lora_indices < 0  # one index per input row and output row (the ops' einsum requires it)
        if not bool(unadapted.any()):
            return op(inputs, weights, output, lora_indices, *args, **kwargs)
        kept = output[unadapted].clone()
        result = op(inputs, weights, output, lora_indices.clamp(min=0), *args, **kwargs)
        output[unadapted] = kept
        return result

    return masked


def patch_cpu_lora_ops_ignore_unadapted_tokens() -> bool:
    """vLLM's CPU LoRA ops index the stacked weights with each token's slot, -1 meaning "no adapter":
    a base-model request in a mixed batch picks up the adapter in the last slot once it is filled."""
    wrapped = [wrap_function(module, name, ignore_unadapted_tokens, ("inputs", "lora_indices_tensor"))
               for module in CPU_LORA_OP_NAMESPACES for name in CPU_LORA_OPS]  # fmt: skip
    return any(wrapped)


def patch_cpu_moe_experts_without_lora() -> bool:
    """On the CPU backend, build a mixture of experts' layers as without LoRA where a BD-LoRA server's LoRA targets
    leave them out (`vllm_bdlora.experts`): vLLM's LoRA MoE kernels need Triton, which its CPU build lacks."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    from vllm_bdlora.experts import experts_built_for_lora

    require_parameters(FusedMoEConfig.__init__, ("is_lora_enabled",), "FusedMoEConfig.__init__")

    def make(original):
        def __init__(self, *args, **kwargs):
            if kwargs.get("is_lora_enabled"):
                kwargs["is_lora_enabled"] = experts_built_for_lora(get_current_vllm_config())
            return original(self, *args, **kwargs)

        return __init__

    return wrap_method(FusedMoEConfig, "__init__", make)


# Where vLLM's linear LoRA layers look up the device for their buffers (base_linear imports the function by name).
LORA_DEVICE_LOOKUPS = ("vllm.lora.layers.utils", "vllm.lora.layers.base_linear")


def lora_device_beside_repacked_weights(lookup):
    """vLLM's LoRA device lookup, answering for a base layer whose `weight` is None: vLLM's CPU backend repacks a
    quantized layer's weight for its own kernels and drops it (compressed-tensors W8A8, W4A16), and the lookup then
    fails with "'NoneType' object has no attribute 'device'". Such a layer's remaining tensors (its scales) live on the
    same device."""

    def device(base_layer):
        if getattr(base_layer, "weight", True) is None:
            tensors = [*base_layer.parameters(recurse=False), *base_layer.buffers(recurse=False)]
            if tensors:
                return tensors[0].device
        return lookup(base_layer)

    return device


def patch_cpu_lora_device_of_repacked_layers() -> bool:
    wrapped = [wrap_function(module, "_get_lora_device", lora_device_beside_repacked_weights, ("base_layer",))
               for module in LORA_DEVICE_LOOKUPS]  # fmt: skip
    return any(wrapped)


def patch_adapter_load_order() -> bool:
    """Load the adapters of a batch in lora_int_id order on every rank. vLLM's LRU worker manager walks a
    set of LoRARequests, which hash by name: with per-process hash randomisation each TP rank loads them in
    its own order, and load-time collectives (DoRA's row-layer norms) would pair different adapters."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    from vllm_bdlora.adapter_lifecycle.worker import apply_in_id_order

    def make(original):
        def _apply_adapters(self, requests):
            return apply_in_id_order(self, requests, partial(original, self))

        return _apply_adapters

    changed = False
    for cls in (WorkerLoRAManager, LRUCacheWorkerLoRAManager):
        require_parameters(cls._apply_adapters, ("self",), f"{cls.__name__}._apply_adapters")
        changed = wrap_method(cls, "_apply_adapters", make) or changed
    return changed


def patch_cpu_pipeline_stage_buffers() -> bool:
    """Give a CPU worker of a later pipeline stage the buffers it receives the previous stage's hidden states
    into. vLLM allocates them only while warming up a compiled model, and its CPU backend runs every LoRA
    engine eagerly, so a LoRA server with --pipeline-parallel-size > 1 dies on its first request."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    def make(original):
        def compile_or_warm_up_model(self):
            result = original(self)
            allocate_stage_buffers(self.model_runner)
            return result

        return compile_or_warm_up_model

    return wrap_method(CPUWorker, "compile_or_warm_up_model", make)


def allocate_stage_buffers(runner) -> None:
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def finite_kv(key, value):
    """K and V as they may enter the KV cache: a non-finite entry (from a request whose hidden states overflowed)
    becomes 0. Only that request's own, already meaningless, attention changes."""
    import torch

    def clean(tensor):
        if tensor is None or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
            return tensor
        return torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0)

    return clean(key), clean(value)


def patch_cpu_kv_cache_holds_finite_values() -> bool:
    """vLLM's CPU attention reads every row of a KV-cache block and weighs the rows past a sequence's length by
    zero: a NaN left in a freed block by one request becomes NaN (0 x NaN) in the next request that reuses the
    block, whatever its adapter. Keep the cache finite where it is written."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    method, key_at = cpu_kv_cache_write(CPUAttentionBackendImpl)
    target = f"CPUAttentionBackendImpl.{method}"
    require_parameters(getattr(CPUAttentionBackendImpl, method), ("key", "value"), target)

    def make(original):
        def write_finite(self, *args, **kwargs):
            args = list(args)
            key = args[key_at] if len(args) > key_at else kwargs["key"]
            value = args[key_at + 1] if len(args) > key_at + 1 else kwargs["value"]
            key, value = finite_kv(key, value)
            for at, name, tensor in ((key_at, "key", key), (key_at + 1, "value", value)):
                if len(args) > at:
                    args[at] = tensor
                else:
                    kwargs[name] = tensor
            return original(self, *args, **kwargs)

        return write_finite

    return wrap_method(CPUAttentionBackendImpl, method, make)


def patch_sampling_survives_non_finite_rows() -> bool:
    """A row of logits holding NaN or +Inf is sampled from a finite stand-in (a valid token index) and reported in
    vLLM's per-row NaN count, which ends its request (`vllm_bdlora.non_finite`); in both of vLLM's model runners."""
    import importlib

    from vllm.v1.sample.sampler import Sampler

    from vllm_bdlora.non_finite import finite_stand_in, mark_non_finite_rows, sample_safely

    require_parameters(Sampler.forward, ("logits", "sampling_metadata"), "Sampler.forward")

    def make(original):
        def forward(self, logits, sampling_metadata, *args, **kwargs):
            return original(self, sample_safely(logits), sampling_metadata, *args, **kwargs)

        return forward

    changed = [wrap_method(Sampler, "forward", make)]
    try:  # the second model runner's sampler (0.26 on): counts NaN inside its call, before it samples
        runner_v2 = importlib.import_module("vllm.v1.worker.gpu.sample.sampler").Sampler
    except (ImportError, AttributeError):
        return any(changed)
    require_parameters(runner_v2.__call__, ("logits", "input_batch"), "gpu.sample.sampler.Sampler.__call__")
    require_parameters(runner_v2.sample, ("logits",), "gpu.sample.sampler.Sampler.sample")

    def make_call(original):
        def __call__(self, logits, input_batch, *args, **kwargs):
            mark_non_finite_rows(logits)
            return original(self, logits, input_batch, *args, **kwargs)

        return __call__

    def make_sample(original):
        def sample(self, logits, *args, **kwargs):
            return original(self, finite_stand_in(logits), *args, **kwargs)

        return sample

    changed += [wrap_method(runner_v2, "__call__", make_call), wrap_method(runner_v2, "sample", make_sample)]
    return any(changed)
