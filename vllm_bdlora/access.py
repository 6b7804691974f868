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
