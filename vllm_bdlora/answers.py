"""What the API server answers where vLLM's own answer leaves the client guessing: a model name that is not served,
and the adapter load and unload routes of a server that does not load adapters at run time."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

LISTED_ADAPTERS = 20  # names an unknown-model answer lists before it counts the rest

RUNTIME_LOADING_OFF = (
    "Loading and unloading adapters at run time is off on this server. Start it with "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (and --allowed-adapter-roots DIR to confine the paths "
    "a load may read), or name the adapters at start-up with --lora-modules NAME=PATH."
)
# The routes vLLM registers only while runtime loading is on (its own and SageMaker's), which answer
# RUNTIME_LOADING_OFF otherwise.
RUNTIME_LOADING_ROUTES = (
    ("/v1/load_lora_adapter", "POST"),
    ("/v1/unload_lora_adapter", "POST"),
    ("/adapters", "POST"),
    ("/adapters/{adapter_name}", "DELETE"),
)


def unknown_model_message(requested: str, base_models: Sequence[str], adapters: Sequence[str]) -> str:
    """vLLM's "The model `x` does not exist" with what is served: the base model(s), the adapters (the closest names
    first, at most LISTED_ADAPTERS), and a guess where one name is close to the one asked for."""
    close = difflib.get_close_matches(requested, adapters, n=3, cutoff=0.6)
    ordered = close + sorted(name for name in adapters if name not in close)
    listed = ", ".join(f"`{name}`" for name in ordered[:LISTED_ADAPTERS])
    if len(ordered) > LISTED_ADAPTERS:
        listed += f" and {len(ordered) - LISTED_ADAPTERS} more (GET /v1/models lists them all)"
    served = "base model " + ", ".join(f"`{name}`" for name in base_models)
    served += f"; adapters: {listed}" if adapters else "; no adapters"
    guess = f" Did you mean `{close[0]}`?" if close else ""
    return f"The model `{requested}` does not exist.{guess} Served: {served}."
