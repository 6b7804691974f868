"""Patches on the OpenAI-compatible API server process."""

from __future__ import annotations

import logging
import sys
from http import HTTPStatus

from vllm_bdlora.access import PATH_REFUSED, adapter_failure_status, is_allowed_adapter_path, needs_api_key
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.patching import UpstreamContractError, original_of, require_parameters, wrap_method

logger = logging.getLogger("vllm.bdlora")

SERVING_MODELS_MODULE = "vllm.entrypoints.openai.models.serving"
SERVE_COMMAND_MODULE = "vllm.entrypoints.cli.serve"


def in_api_server() -> bool:
    # Only the API server has (and needs) the serving module; it is imported there before plugins load, and
    # importing API-server modules into engine workers would only cost them start-up time.
    return SERVING_MODELS_MODULE in sys.modules


def as_bad_request(response):
    """vLLM answers every adapter load failure but "not found" with 500; a rejected adapter is the
    client's input, so answer 400 with the same message."""
    error = getattr(response, "error", None)
    if error is not None and adapter_failure_status(error.message) == HTTPStatus.BAD_REQUEST:
        error.code = HTTPStatus.BAD_REQUEST.value
        error.type = "BadRequestError"
    return response


def patch_load_lora_adapter_policy() -> bool:
    """Refuse adapter paths outside --allowed-adapter-roots (HTTP 403, before anything is read) and answer
    rejected adapters with 400. Every load goes through this method: /v1/load_lora_adapter, /adapters and the
    server's --lora-modules."""
    if not in_api_server():
        return False
    module = sys.modules[SERVING_MODELS_MODULE]
    require_parameters(module.OpenAIServingModels.load_lora_adapter, ("request",), "load_lora_adapter")

    def make(original):
        async def load_lora_adapter(self, request, *args, **kwargs):
            settings = BdLoraSettings.from_vllm_config(getattr(self.engine_client, "vllm_config", None))
            if not is_allowed_adapter_path(request.lora_path or "", settings.allowed_adapter_roots):
                logger.warning("vllm-bdlora: adapter '%s': path outside the allowed adapter roots refused",
                               request.lora_name)  # fmt: skip
                return module.create_error_response(
                    message=f"LoRA adapter '{request.lora_name}': {PATH_REFUSED}",
                    err_type="PermissionDenied",
                    status_code=HTTPStatus.FORBIDDEN,
                )
            return as_bad_request(await original(self, request, *args, **kwargs))

        return load_lora_adapter

    return wrap_method(module.OpenAIServingModels, "load_lora_adapter", make)


def patch_api_key_covers_every_route() -> bool:
    """vLLM's key check guards only /v1, /v2, /inference and /cohere; guard every path but the open probes."""
    if not in_api_server():
        return False
    from vllm_bdlora.compat import AUTH_MIDDLEWARE_MODULES, modules_with

    found = modules_with("AuthenticationMiddleware", AUTH_MIDDLEWARE_MODULES)
    if not found:
        logger.warning("vllm-bdlora: this vLLM's --api-key check was not found; it guards only vLLM's own routes.")
        return False
    middleware = found[0].AuthenticationMiddleware
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
        engine_died,
        engine_processes_alive,
        fail_pending_engine_calls,
        note_engine_death,
    )

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
            if engine_died():
                raise SystemExit(EXIT_ENGINE_DIED)

        return cmd

    def make_check_health(original):
        async def check_health(self):
            await original(self)
            if not engine_processes_alive():
                raise EngineDeadError()

        return check_health

    command = wrap_method(serve.ServeSubcommand, "cmd", make)
    health = wrap_method(AsyncLLM, "check_health", make_check_health)
    return command or health or changed
