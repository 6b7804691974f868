"""Patches on the OpenAI-compatible API server process."""

from __future__ import annotations

import logging
import sys
from http import HTTPStatus

from vllm_bdlora.access import (
    PATH_REFUSED,
    adapter_failure_status,
    adapter_name_problem,
    adapter_path_problem,
    is_allowed_adapter_path,
    needs_api_key,
)
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.metrics import current_metrics, refusal_reason
from vllm_bdlora.patching import (
    UpstreamContractError,
    original_of,
    require_parameters,
    wrap_function,
    wrap_method,
)

logger = logging.getLogger("vllm.bdlora")

SERVING_MODELS_MODULE = "vllm.entrypoints.openai.models.serving"
SERVE_COMMAND_MODULE = "vllm.entrypoints.cli.serve"


def in_api_server() -> bool:
    # Only the API server has (and needs) the serving module; it is imported there before plugins load, and
    # importing API-server modules into engine workers would only cost them start-up time.
    return SERVING_MODELS_MODULE in sys.modules


def serving_models_module(method: str, parameters: tuple[str, ...]):
    """vLLM's module of OpenAIServingModels, once its `method` is checked to take `parameters`; None outside an API
    server process."""
    if not in_api_server():
        return None
    module = sys.modules[SERVING_MODELS_MODULE]
    require_parameters(getattr(module.OpenAIServingModels, method), parameters, method)
    return module


def api_server_module_with(attribute: str, candidates: tuple[str, ...], missing: str, level: int = logging.DEBUG):
    """The first of the `candidates` modules that defines `attribute` (vLLM moves things between releases,
    compat.py), in an API server process; None outside one, or where this vLLM has none (`missing` is logged)."""
    if not in_api_server():
        return None
    from vllm_bdlora.compat import modules_with

    found = modules_with(attribute, candidates)
    if not found:
        logger.log(level, "vllm-bdlora: %s", missing)
        return None
    return found[0]


ERROR_TYPES = {400: "BadRequestError", 403: "PermissionDenied", 507: "InsufficientStorage"}


def with_client_status(response):
    """vLLM answers every adapter load failure but "not found" with 500; a refused adapter is the client's input
    (400, 403 for a path outside the allowed roots) or a full server (507): answer that, with the same message."""
    error = getattr(response, "error", None)
    status = adapter_failure_status(error.message) if error is not None else None
    if status is not None:
        error.code = status
        error.type = ERROR_TYPES[status]
    return response


def patch_load_lora_adapter_policy() -> bool:
    """Refuse adapter paths outside --allowed-adapter-roots (HTTP 403, before anything is read) and answer
    rejected adapters with 400. Every load goes through this method: /v1/load_lora_adapter, /adapters and the
    server's --lora-modules."""
    module = serving_models_module("load_lora_adapter", ("request",))
    if module is None:
        return False

    def make(original):
        async def load_lora_adapter(self, request, *args, **kwargs):
            settings = BdLoraSettings.from_vllm_config(getattr(self.engine_client, "vllm_config", None))
            response = await checked_load(self, request, settings, *args, **kwargs)
            error = getattr(response, "error", None)
            if error is not None and (metrics := current_metrics()) is not None:
                metrics.on_refusal(refusal_reason(error.message, error.code))
            return response

        async def checked_load(self, request, settings, *args, **kwargs):
            problem = adapter_name_problem(request.lora_name) or adapter_path_problem(request.lora_path)
            if problem is not None and settings.enabled:
                logger.warning("vllm-bdlora: adapter load refused: %s", problem)
                return module.create_error_response(message=problem, err_type="BadRequestError",
                                                    status_code=HTTPStatus.BAD_REQUEST)  # fmt: skip
            if not is_allowed_adapter_path(request.lora_path or "", settings.allowed_adapter_roots):
                logger.warning("vllm-bdlora: adapter '%s': path outside the allowed adapter roots refused",
                               request.lora_name)  # fmt: skip
                return module.create_error_response(
                    message=f"LoRA adapter '{request.lora_name}': {PATH_REFUSED}",
                    err_type="PermissionDenied",
                    status_code=HTTPStatus.FORBIDDEN,
                )
            return with_client_status(await original(self, request, *args, **kwargs))

        return load_lora_adapter

    return wrap_method(module.OpenAIServingModels, "load_lora_adapter", make)


def patch_api_key_covers_every_route() -> bool:
    """vLLM's key check guards only /v1, /v2, /inference and /cohere; guard every path but the open probes."""
    from vllm_bdlora.compat import AUTH_MIDDLEWARE_MODULES

    missing = "this vLLM's --api-key check was not found; it guards only vLLM's own routes."
    holder = api_server_module_with("AuthenticationMiddleware", AUTH_MIDDLEWARE_MODULES, missing, logging.WARNING)
    if holder is None:
        return False
    middleware = holder.AuthenticationMiddleware
    require_parameters(middleware.__call__, ("scope", "receive", "send"), "AuthenticationMiddleware.__call__")
    require_parameters(middleware.verify_token, ("headers",), "AuthenticationMiddleware.verify_token")

    def make(original):
        def __call__(self, scope, receive, send):
            if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
                from starlette.datastructures import Headers
                from starlette.responses import JSONResponse

                path = scope["path"].removeprefix(scope.get("root_path", ""))
                if needs_api_key(path) and not self.verify_token(Headers(scope=scope)):
                    return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return original(self, scope, receive, send)

        return __call__

    return wrap_method(middleware, "__call__", make)


def patch_tenant_keys_gate() -> bool:
    """With --tenant-keys, put `vllm_bdlora.tenants.TenantGate` in front of the API server's routes."""
    from vllm_bdlora.compat import tenant_gate_hook

    module = tenant_gate_hook()
    if module is None:
        return False  # --tenant-keys refuses to start on such a vLLM (patching.cli.check_tenant_keys)

    def guard(app, args) -> None:
        path = getattr(args, "tenant_keys", None)
        if path is not None:
            from vllm_bdlora.tenants import TenantGate, TenantKeys

            keys = TenantKeys.read(path)
            base_models = list(getattr(args, "served_model_name", None) or [args.model])
            app.add_middleware(TenantGate, keys=keys, base_models=base_models)
            logger.info("vllm-bdlora: every route but the probes needs one of the %s.", keys.describe())

    if hasattr(module, "init_entrypoints_middleware"):

        def make(original):
            def init_entrypoints_middleware(args, app, *rest, **kwargs):
                result = original(args, app, *rest, **kwargs)
                guard(app, args)
                return result

            return init_entrypoints_middleware

        return wrap_function(module.__name__, "init_entrypoints_middleware", make, required=("args", "app"))

    def make_build(original):
        def build_app(args, *rest, **kwargs):
            app = original(args, *rest, **kwargs)
            guard(app, args)
            return app

        return build_app

    return wrap_function(module.__name__, "build_app", make_build, required=("args",))


def patch_failed_generations_name_their_adapter() -> bool:
    """A request ended because its logits were not finite answers an error naming its adapter
    (`vllm_bdlora.non_finite`), not vLLM's bare "Internal server error"."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_bdlora.non_finite import raise_if_ended

    def make(original):
        async def generate(self, *args, **kwargs):
            outputs = original(self, *args, **kwargs)
            try:
                async for output in outputs:
                    raise_if_ended(output)
                    yield output
            finally:
                await outputs.aclose()

        return generate

    return wrap_method(AsyncLLM, "generate", make)


def patch_engine_death_exit_status() -> bool:
    """/health answers 503 as soon as an engine process is gone; the watchdog's verdict that the engine died is
    recorded, calls still waiting on the engine are answered with EngineDeadError (so the HTTP server's shutdown
    does not wait for them forever), and `vllm serve` exits non-zero after it."""
    if not in_api_server():
        return False
    import importlib

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_bdlora.compat import (
        ENGINE_ERROR_HANDLER_MODULES,
        SERVER_LAUNCHER_MODULES,
        modules_with,
        pending_engine_calls,
    )
    from vllm_bdlora.serve.lifecycle import (
        EXIT_ENGINE_DIED,
        EngineStallWatch,
        engine_died,
        exit_without_teardown,
        fail_pending_engine_calls,
        note_engine_death,
    )

    class EngineStalled(EngineDeadError):
        """The engine is alive but has not come back to its requests in time (a stopped or hung worker)."""

    stall_watch = EngineStallWatch()

    serve = importlib.import_module(SERVE_COMMAND_MODULE)
    # The watchdog and the error handler of in-flight requests each imported the function by name.
    holders = modules_with("terminate_if_errored", SERVER_LAUNCHER_MODULES + ENGINE_ERROR_HANDLER_MODULES)
    if not holders:
        logger.warning("vllm-bdlora: this vLLM's engine watchdog was not found; a dead engine may exit with status 0.")
        return False
    launcher = holders[0]
    original_check = original_of(launcher.terminate_if_errored) or launcher.terminate_if_errored
    require_parameters(original_check, ("server", "engine"), "terminate_if_errored")
    require_parameters(serve.ServeSubcommand.cmd, ("args",), "ServeSubcommand.cmd")

    def terminate_if_errored(server, engine):
        original_check(server, engine)
        if getattr(server, "should_exit", False) and engine.errored:
            note_engine_death()
            fail_pending_engine_calls(pending_engine_calls(engine), EngineDeadError)

    terminate_if_errored.__bdlora_original__ = original_check
    changed = False
    for module in holders:
        if module.terminate_if_errored is not original_check:
            if original_of(module.terminate_if_errored) is None:
                raise UpstreamContractError(f"vllm-bdlora: {module.__name__}.terminate_if_errored is not vLLM's.")
            continue
        module.terminate_if_errored = terminate_if_errored
        changed = True

    def make(original):
        def cmd(args):
            original(args)
            exit_without_teardown(EXIT_ENGINE_DIED if engine_died() else 0)

        return cmd

    stall_timeout = BdLoraSettings.engine_stall_timeout_s

    def make_check_health(original):
        async def check_health(self):
            await original(self)
            settings = BdLoraSettings.from_vllm_config(getattr(self, "vllm_config", None))
            timeout = settings.engine_stall_timeout_s if settings.enabled else stall_timeout
            await stall_watch.check(self, timeout, EngineStalled, EngineDeadError)

        return check_health

    command = wrap_method(serve.ServeSubcommand, "cmd", make)
    health = wrap_method(AsyncLLM, "check_health", make_check_health)
    return command or health or changed


def patch_unload_reaches_engine() -> bool:
    """vLLM's unload (/v1/unload_lora_adapter, DELETE /adapters/{name}) forgets the name in the API server only; the
    engine keeps the adapter's GPU slot, host-cache entry and everything its workers keep. After vLLM's unload
    succeeds, remove it from the engine too (which waits for the adapter's requests in flight), and its per-adapter
    metric series."""
    module = serving_models_module("unload_lora_adapter", ("request",))
    if module is None:
        return False

    def make(original):
        async def unload_lora_adapter(self, request, *args, **kwargs):
            loaded = self.lora_requests.get(getattr(request, "lora_name", None))
            response = await original(self, request, *args, **kwargs)
            if loaded is not None and request.lora_name not in self.lora_requests:
                await self.engine_client.remove_lora(loaded.lora_int_id)
                from vllm_bdlora.metrics import current_metrics

                metrics = current_metrics()
                if metrics is not None:
                    metrics.forget(loaded.lora_name)
            return response

        return unload_lora_adapter

    return wrap_method(module.OpenAIServingModels, "unload_lora_adapter", make)


def patch_unknown_model_lists_served_models() -> bool:
    """vLLM answers a request for a model it does not serve with "Valid aliases: <the base model>", naming none of
    the adapters; answer with what is served, the closest adapter names first (vllm_bdlora.answers)."""
    from vllm_bdlora.compat import SERVING_ENGINE_MODULES

    missing = "this vLLM's model check was not found; unknown models get vLLM's answer."
    holder = api_server_module_with("BaseServing", SERVING_ENGINE_MODULES, missing)
    if holder is None:
        return False
    serving = holder.BaseServing
    require_parameters(serving._check_model, ("request",), "BaseServing._check_model")

    def make(original):
        async def _check_model(self, request, *args, **kwargs):
            error = await original(self, request, *args, **kwargs)
            if error is not None and getattr(error.error, "code", None) == HTTPStatus.NOT_FOUND:
                from vllm_bdlora.answers import unknown_model_message

                base = [model.name for model in self.models.base_model_paths]
                error.error.message = unknown_model_message(request.model, base, list(self.models.lora_requests))
            return error

        return _check_model

    return wrap_method(serving, "_check_model", make)


def patch_runtime_loading_routes_say_how_to_enable() -> bool:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM registers no adapter load or unload route, and a client's load
    gets a bare `{"detail": "Not Found"}`; register those routes answering 404 with how to turn loading on."""
    from vllm_bdlora.compat import LORA_ROUTER_MODULES

    missing = "this vLLM's adapter routes were not found; a load where loading is off gets vLLM's answer."
    holder = api_server_module_with("attach_router", LORA_ROUTER_MODULES, missing)
    if holder is None:
        return False

    def make(original):
        def attach_router(app, *args, **kwargs):
            result = original(app, *args, **kwargs)
            from vllm import envs

            if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
                from fastapi.responses import JSONResponse

                from vllm_bdlora.answers import RUNTIME_LOADING_OFF, RUNTIME_LOADING_ROUTES

                async def runtime_loading_off():
                    body = {"error": {"message": RUNTIME_LOADING_OFF, "type": "NotFoundError", "code": 404}}
                    return JSONResponse(body, status_code=HTTPStatus.NOT_FOUND)

                for path, method in RUNTIME_LOADING_ROUTES:
                    app.add_api_route(path, runtime_loading_off, methods=[method], include_in_schema=False)
            return result

        return attach_router

    return wrap_function(holder.__name__, "attach_router", make, required=("app",))


STATIC_LOADS_AT_ONCE = 16


def patch_static_loras_in_parallel() -> bool:
    """vLLM loads the --lora-modules adapters one after another at start-up; with BD-LoRA each load only asks the
    workers to begin reading, so start them all (a few at a time per worker, see `admission_threads`) and wait."""
    module = serving_models_module("init_static_loras", ("self",))
    if module is None:
        return False
    import inspect

    source = inspect.getsource(module.OpenAIServingModels.init_static_loras)
    for needed in ("static_lora_modules", "LoadLoRAAdapterRequest", "load_lora_adapter", "ErrorResponse"):
        if needed not in source:
            raise UpstreamContractError(f"vllm-bdlora: OpenAIServingModels.init_static_loras no longer uses {needed}.")

    def make(original):
        async def init_static_loras(self):
            vllm_config = getattr(self.engine_client, "vllm_config", None)
            settings = BdLoraSettings.from_vllm_config(vllm_config)
            if getattr(vllm_config, "lora_config", None) is not None:  # stock LoRA servers too: comparable figures
                start_adapter_metrics(self.engine_client, settings)
            if not settings.enabled or not self.static_lora_modules:
                return await original(self)
            import asyncio

            gate = asyncio.Semaphore(STATIC_LOADS_AT_ONCE)

            async def load(lora):
                fields = {"lora_path": lora.path, "lora_name": lora.name}
                if hasattr(lora, "is_3d_lora_weight"):
                    fields["is_3d_lora_weight"] = lora.is_3d_lora_weight
                async with gate:
                    return await self.load_lora_adapter(
                        request=module.LoadLoRAAdapterRequest(**fields), base_model_name=lora.base_model_name
                    )

            results = await asyncio.gather(*(load(lora) for lora in self.static_lora_modules))
            failures = [r.error.message for r in results if isinstance(r, module.ErrorResponse)]
            if failures:
                raise ValueError(failures[0])

        return init_static_loras

    return wrap_method(module.OpenAIServingModels, "init_static_loras", make)


def patch_lora_info_gauge_keeps_one_series() -> bool:
    """vLLM's `vllm:lora_requests_info` gauge labels each update with the running and waiting adapters' names joined
    by commas, and never drops an old label set: its series grow with every combination of adapters ever seen.
    Keep the current one only. Ray Serve's metric wrappers have no way to drop a label set and stay as they are.
    Its `max_lora` label reads the config's `max_loras`, which counts the workers' slots for fills ahead too
    (`fill_ahead.add_spare_slots`): it says the adapters one step may run, `--max-loras`, again."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vllm_bdlora.adapter_lifecycle.fill_ahead import adapters_per_step

    require_parameters(PrometheusStatLogger.__init__, ("vllm_config",), "PrometheusStatLogger.__init__")

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            gauge = getattr(self, "gauge_lora_info", None)
            if callable(getattr(gauge, "clear", None)):
                self.gauge_lora_info = CurrentSeriesOnly(gauge)
            lora_config = getattr(getattr(self, "vllm_config", None), "lora_config", None)
            if hasattr(self, "max_lora") and lora_config is not None:
                self.max_lora = adapters_per_step(lora_config)

        return __init__

    return wrap_method(PrometheusStatLogger, "__init__", make)


class CurrentSeriesOnly:
    """A labelled gauge whose `labels(...)` first removes every other label set."""

    def __init__(self, gauge):
        self.gauge = gauge

    def labels(self, *args, **kwargs):
        self.gauge.clear()
        return self.gauge.labels(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.gauge, name)


_metrics_poller = None


def start_adapter_metrics(engine_client, settings: BdLoraSettings) -> None:
    """The API server's adapter metrics and their poll of the engine (once per process; `vllm_bdlora.metrics`)."""
    global _metrics_poller
    import asyncio

    from vllm_bdlora.metrics import adapter_metrics

    if _metrics_poller is None:
        metrics = adapter_metrics(settings.metrics_max_adapters)
        _metrics_poller = asyncio.get_running_loop().create_task(metrics.poll(engine_client))


def patch_adapter_metrics_in_merged_registry() -> bool:
    """With several API-server processes vLLM's `/metrics` answers from a registry built for each scrape that merges
    the processes' metric files (prometheus_client's multiprocess mode); collectors registered in-process, as the
    engine's adapter figures are, are not in it. Add those figures to every merge (each API server polls the same
    engine)."""
    if not in_api_server():
        return False
    from prometheus_client.multiprocess import MultiProcessCollector

    def make(original):
        def collect(self):
            from vllm_bdlora.metrics import latest_engine_figures

            return [*original(self), *latest_engine_figures()]

        return collect

    return wrap_method(MultiProcessCollector, "collect", make)


def patch_adapter_request_metrics() -> bool:
    """Per-adapter request metrics from vLLM's own per-request statistics, which know each request's adapter (API
    server process; only where vLLM keeps statistics, i.e. without --disable-log-stats)."""
    if not in_api_server():
        return False
    from vllm.v1.metrics.stats import IterationStats

    require_parameters(IterationStats.update_from_output, ("output", "is_prefilling", "req_stats", "lora_name"),
                       "IterationStats.update_from_output")  # fmt: skip
    require_parameters(IterationStats.update_from_finished_request, ("request_id", "num_prompt_tokens", "req_stats"),
                       "IterationStats.update_from_finished_request")  # fmt: skip

    def make_output(original):
        def update_from_output(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kwargs):
            result = original(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kwargs)
            metrics = current_metrics()
            if metrics is not None:
                lora_name = kwargs.get("lora_name", args[1] if len(args) > 1 else None)
                first = req_stats.first_token_latency if is_prefilling else None
                metrics.on_output(req_stats, lora_name, first)
            return result

        return update_from_output

    def make_finished(original):
        def update_from_finished_request(self, finish_reason, request_id, num_prompt_tokens, *args, **kwargs):
            result = original(self, finish_reason, request_id, num_prompt_tokens, *args, **kwargs)
            metrics = current_metrics()
            req_stats = kwargs.get("req_stats", args[1] if len(args) > 1 else None)
            if metrics is not None and req_stats is not None:
                tokens = req_stats.num_generation_tokens
                tpot = (req_stats.last_token_ts - req_stats.first_token_ts) / (tokens - 1) if tokens > 1 else 0.0
                metrics.on_finished(req_stats, num_prompt_tokens, tokens, tpot)
            return result

        return update_from_finished_request

    output = wrap_method(IterationStats, "update_from_output", make_output)
    finished = wrap_method(IterationStats, "update_from_finished_request", make_finished)
    return output or finished
