"""Admitted adapters are served from what was admitted: a private copy of their files on each worker.

vLLM reads an adapter's files again whenever it has dropped the adapter from its host-memory cache
(`--max-cpu-loras`) and a request asks for it later. That read happens inside the engine step, where any
failure stops the engine: an adapter whose files were re-saved, half-synced or deleted after it was admitted
would take every request down with it, or be served as something other than what was admitted.

So when a worker admits an adapter (the server's `--lora-modules`, a load request, or a request naming an
adapter this worker has not seen), it copies the files vLLM reads into a directory of its own, checks and
reads that copy, and every later read is of the same bytes, which passed the same checks before. Nothing
that happens to the source afterwards reaches the engine step. Tensor-parallel ranks copy independently, so
each reports the digest of what it copied and the executor refuses the adapter if they differ (its files
changed while the ranks read them). A copy lives until the adapter is removed from the engine or the worker
exits; copies of a dead worker are removed by the next worker that starts.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass

from vllm_bdlora.adapter_files import SERVED_FILES, check_adapter_dir

COPY_DIR_PREFIX = "vllm-bdlora-adapters-"
_CHUNK = 8 * 2**20

# True while a worker loads an adapter for an add_lora call (admission), as opposed to a step's request.
_admitting = contextvars.ContextVar("bdlora_admitting", default=False)


@contextlib.contextmanager
def admitting():
    token = _admitting.set(True)
    try:
        yield
    finally:
        _admitting.reset(token)


def is_admitting() -> bool:
    return _admitting.get()


@dataclass(frozen=True)
class AdmittedCopy:
    directory: str
    digest: str  # sha256 over the copied files' names and bytes


class AdmittedCopies:
    """One worker's copies of its admitted adapters, keyed by vLLM's adapter id."""

    def __init__(self, parent: str | None = None):
        self.parent = parent or tempfile.gettempdir()
        self._root: str | None = None
        self._copies: dict[int, AdmittedCopy] = {}
        self._serial = 0

    def get(self, adapter_id: int) -> AdmittedCopy | None:
        return self._copies.get(adapter_id)

    def stage(self, source: str, adapter: str) -> AdmittedCopy:
        """Copy the files vLLM reads from `source` (checked first, so that problems name the source's files)
        into a new directory; `keep` makes it the adapter's once it has loaded, `discard` drops it if not."""
        check_adapter_dir(source, adapter)
        self._serial += 1
        directory = os.path.join(self._ensure_root(), str(self._serial))
        os.mkdir(directory)
        digest = hashlib.sha256()
        try:
            for name in SERVED_FILES:
                path = os.path.join(source, name)
                if os.path.isfile(path):
                    digest.update(name.encode() + b"\0")
                    _copy_hashing(path, os.path.join(directory, name), digest)
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return AdmittedCopy(directory, digest.hexdigest())

    def keep(self, adapter_id: int, copy: AdmittedCopy) -> None:
        """`copy` is now what `adapter_id` is served from (an in-place reload replaces the previous copy)."""
        previous = self._copies.get(adapter_id)
        self._copies[adapter_id] = copy
        if previous is not None and previous != copy:
            self.discard(previous)

    def forget(self, adapter_id: int) -> None:
        copy = self._copies.pop(adapter_id, None)
        if copy is not None:
            self.discard(copy)

    @staticmethod
    def discard(copy: AdmittedCopy) -> None:
        shutil.rmtree(copy.directory, ignore_errors=True)

    def remove_all(self) -> None:
        self._copies.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _ensure_root(self) -> str:
        if self._root is None:
            remove_copies_of_dead_processes(self.parent)
            self._root = tempfile.mkdtemp(prefix=f"{COPY_DIR_PREFIX}{os.getpid()}-", dir=self.parent)
            atexit.register(self.remove_all)
        return self._root


def _copy_hashing(source: str, destination: str, digest) -> None:
    with open(source, "rb") as src, open(destination, "wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)


def remove_copies_of_dead_processes(parent: str) -> None:
    """Workers killed without running their exit handlers leave their copies behind; their directory names
    carry the pid, so a later worker can tell which are orphaned."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(COPY_DIR_PREFIX):
            continue
        pid = name[len(COPY_DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class AdmissionReceipt:
    """A worker's reply to add_lora: whether it loaded the adapter, and the digest of the copy it admitted
    (None where vllm-bdlora does not copy, i.e. BD-LoRA is off)."""

    loaded: bool
    digest: str | None

    def __bool__(self) -> bool:
        return self.loaded


def admission_receipt(worker_manager, lora_request, loaded: bool) -> AdmissionReceipt:
    copies = getattr(worker_manager, "_bdlora_admitted", None)
    copy = copies.get(lora_request.lora_int_id) if copies is not None else None
    return AdmissionReceipt(bool(loaded), copy.digest if copy else None)


def check_admission_replies(replies: list, lora_request, remove_everywhere) -> bool:
    """The executor's verdict on every rank's add_lora reply: the first failure is raised (after every reply
    was read, see `AdapterLoadFailure`); ranks that copied different bytes mean the files changed during the
    load, so the adapter is removed from every rank and refused."""
    from vllm_bdlora.adapters import AdapterLoadFailure, AdapterRejected

    failures = [r for r in replies if isinstance(r, AdapterLoadFailure)]
    if failures:
        # A rank that only learned that another rank rejected the adapter has the least to say.
        failures.sort(key=lambda f: AdapterRejected.OTHER_RANK in f.message)
        raise RuntimeError(failures[0].message)
    digests = {r.digest for r in replies if isinstance(r, AdmissionReceipt)}
    if len(digests) > 1:
        remove_everywhere()
        raise RuntimeError(
            str(
                AdapterRejected(
                    lora_request.lora_name,
                    ["its files changed while the tensor-parallel ranks were reading them (the ranks copied different "
                     "bytes)"],
                    "load it again once its files are completely written (write elsewhere, then rename into place).",
                )
            )
        )  # fmt: skip
    return all(replies)
