"""Who may use the server, and which adapter files a load request may read.

* `--api-key` (vLLM's) guards every route but the read-only probes in `OPEN_PATHS`: vLLM's own check covers only
  `/v1`, `/v2`, `/inference` and `/cohere`, and leaves routes such as `/adapters` (loads any path),
  `DELETE /adapters/{name}` and `/invocations` (generates) open to anyone who can reach the port.
* `--allowed-adapter-roots` confines every runtime adapter load, and the server's `--lora-modules`, to the
  given directories, compared after the path is resolved (symlinks, `..`, relative paths). Anything outside
  gets one answer, HTTP 403 with the same text whatever the path, so answers reveal nothing about what
  exists on disk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# Read-only probes a load balancer or monitor calls without credentials.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})

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


def adapter_failure_status(message: str) -> int | None:
    """The HTTP status a failed adapter load answers, from its message: 400 for an adapter vllm-bdlora refused (the
    client's input), 403 for a path outside the allowed roots; None for failures that are not the client's."""
    from vllm_bdlora.adapters import AdapterRejected

    if AdapterRejected.MARKER in message:
        return 400
    if PATH_REFUSED in message:
        return 403
    return None


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
