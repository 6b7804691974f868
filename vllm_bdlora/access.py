"""Who may use the server, and which adapter files a load request may read.

* `--api-key` (vLLM's) guards every route but the read-only probes in `OPEN_PATHS`: vLLM's own check covers only
  `/v1`, `/v2`, `/inference` and `/cohere`, and leaves routes such as `/adapters` (loads any path),
  `DELETE /adapters/{name}` and `/invocations` (generates) open to anyone who can reach the port. `/metrics` needs
  the key too: it names every adapter that has run (scrapers send it as a bearer token).
* Adapter names are `ADAPTER_NAME_RULE` (they end up in logs, metric labels and model lists), and a load's path
  holds no control characters.
* `--allowed-adapter-roots` confines every runtime adapter load, and the server's `--lora-modules`, to the
  given directories, compared after the path is resolved (symlinks, `..`, relative paths). Anything outside
  gets one answer, HTTP 403 with the same text whatever the path, so answers reveal nothing about what
  exists on disk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# Read-only probes a load balancer or monitor calls without credentials; none of them names an adapter.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/load"})

ADAPTER_NAME_MAX = 128
# The label value the metrics give every adapter past `metrics_max_adapters`: an adapter of that name would have its
# figures summed with others'.
METRICS_OVERFLOW_LABEL = "other"
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/@+-]{{0,{ADAPTER_NAME_MAX - 1}}}")
ADAPTER_NAME_RULE = (
    f"1 to {ADAPTER_NAME_MAX} characters: letters, digits and . _ - : / @ +, starting with a letter or a digit"
)

ROOTS_FLAG = "--allowed-adapter-roots"
PATH_REFUSED = (
    f"adapter path refused: it is not inside the server's allowed adapter directories ({ROOTS_FLAG}); ask the "
    "operator for a directory you may load adapters from."
)


class AdapterLoadRefused(Exception):
    """A refused adapter load that keeps its HTTP status (`status_code`) wherever it is raised: Ray Serve pickles a
    replica's exception to the process that answers the request, and answers with the exception's status_code."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self):
        return type(self), (str(self), self.status_code)


STORE_FULL = "no room for it on this server"


def adapter_failure_status(message: str) -> int | None:
    """The HTTP status a failed adapter load answers, from its message: 400 for an adapter vllm-bdlora refused (the
    client's input), 403 for a path outside the allowed roots, 507 where the server has no room left for it; None for
    failures that are not the client's."""
    from vllm_bdlora.adapters import AdapterRejected

    if PATH_REFUSED in message:
        return 403
    if STORE_FULL in message:
        return 507
    if AdapterRejected.MARKER in message:
        return 400
    return None


def shown_name(name) -> str:
    """A client-given name as it may appear in a log line or an answer: escaped (no newline can forge a log line)
    and cut short."""
    text = ascii(name)
    return text if len(text) <= 80 else text[:77] + "..."


def adapter_name_problem(name) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if name == METRICS_OVERFLOW_LABEL:
        return (f"LoRA adapter name {shown_name(name)} is not allowed: it is reserved (the metrics label the "
                "adapters past metrics_max_adapters with it); choose another name.")  # fmt: skip
    if isinstance(name, str) and _NAME.fullmatch(name):
        return None
    return f"LoRA adapter name {shown_name(name)} is not allowed: a name is {ADAPTER_NAME_RULE}."


def adapter_path_problem(path) -> str | None:
    """Why `path` cannot be an adapter's path, or None (what it points at is checked when it is read)."""
    if isinstance(path, str) and path and not any(ord(c) < 32 or ord(c) == 127 for c in path):
        return None
    return f"LoRA adapter path {shown_name(path)} is not allowed: give a directory path without control characters."


def needs_api_key(path: str) -> bool:
    """Every path but the open probes (and their sub-paths, e.g. /metrics/ as mounted) needs the key."""
    trimmed = path.rstrip("/") or "/"
    return trimmed not in OPEN_PATHS


def resolve_adapter_path(path: str, cwd: str | None = None) -> str:
    """Where `path` really points: `~` expanded, made absolute against the server's working directory,
    `..` and every symlink resolved."""
    expanded = os.path.expanduser(path)
    return os.path.realpath(os.path.join(cwd or os.getcwd(), expanded))


def is_allowed_adapter_path(path: str, roots: Sequence[str], cwd: str | None = None) -> bool:
    """True without roots (no confinement), else only for paths inside one of them after resolution."""
    if not roots:
        return True
    resolved = resolve_adapter_path(path, cwd)
    for root in roots:
        real_root = resolve_adapter_path(root, cwd)
        if os.path.commonpath([resolved, real_root]) == real_root:
            return True
    return False
