"""What crosses between the engine core and its workers during admission: the calls the engine core makes on every
rank (`collective_rpc` of the one worker method `WORKER_METHOD`, each call a typed object vLLM pickles to every
worker), each rank's answers, and the rules that turn the ranks' answers into one verdict.

    engine core                                   every worker (`vllm_bdlora.adapter_lifecycle.worker`)
    BeginAdmissions(requests)      ------------>  start reading each on an admission thread
    AdmissionStates(ids)           ------------>  {id: Reading | Ready | Failed | Unknown}
    ForgetAdmissions(ids)          ------------>  drop everything of them
    AdapterFigures()               ------------>  what it holds where, and its counts (/metrics)
    RestoreAhead(ids, begin, fill) ------------>  read spilled ones back into memory on a thread, ahead of a step,
                                                  and fill a GPU slot now with those in host memory:
                                                  [the ids being read back]
    CompleteAdmissions(requests)   ------------>  vLLM's add_lora of each, in order: AdmissionReceipt |
                                                  AdapterLoadFailure each

Ranks must have read the same files (`files_differ_refusal`): each reports the digest of what it opened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_bdlora.adapter_lifecycle.files import CONFIG_FILE, REWRITE_HINT, WEIGHTS_FILE
from vllm_bdlora.adapters import AdapterLoadFailure, AdapterRejected

WORKER_METHOD = "bdlora_admission"  # the method vLLM's workers are given (`patch_worker_admission_calls`)


# -- calls ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BeginAdmissions:
    """Start admitting each LoRARequest on a thread of its own (an admission of the same id in flight is replaced)."""

    requests: Sequence


@dataclass(frozen=True)
class AdmissionStates:
    """Each id's state of admission."""

    adapter_ids: Sequence[int]


@dataclass(frozen=True)
class ForgetAdmissions:
    """Drop everything of each id (given up, refused on another rank, or unloaded)."""

    adapter_ids: Sequence[int]


@dataclass(frozen=True)
class AdapterFigures:
    """What the worker holds where, and its counts (`vllm_bdlora.metrics`)."""


@dataclass(frozen=True)
class RestoreAhead:
    """Adapters that requests just named: read back into host memory, off the step, any of them that was spilled
    (`begin` False: only say which are still being read back), and copy into a GPU slot now each LoRARequest of `fill`
    whose adapter is in host memory, taking no slot of an adapter in `keep` (those with requests in the engine,
    `fill_ahead.py`). Each rank answers the ids it is reading back."""

    adapter_ids: Sequence[int]
    begin: bool = True
    fill: Sequence = ()
    keep: frozenset = frozenset()


@dataclass(frozen=True)
class CompleteAdmissions:
    """vLLM's add_lora of each LoRARequest, in order (adapters every rank has read): the ready adapters of one poll
    in one call, where the executor's add_lora takes a call per adapter."""

    requests: Sequence


AdmissionCall = (
    BeginAdmissions | AdmissionStates | ForgetAdmissions | AdapterFigures | RestoreAhead | CompleteAdmissions
)


# -- a rank's state of one admission --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reading:
    seconds: float  # spent reading so far (time queued behind other admissions does not count)


@dataclass(frozen=True)
class Ready:
    identity: str  # digest of the files it was read from (`OpenedAdapter.identity`)


@dataclass(frozen=True)
class Failed:
    message: str  # what the client is told; the API server picks the HTTP status from it


@dataclass(frozen=True)
class Unknown:
    """The rank holds nothing of the adapter (it restarted, or the admission was forgotten)."""


AdmissionState = Reading | Ready | Failed | Unknown


@dataclass(frozen=True)
class AdmissionReceipt:
    """A worker's reply to add_lora: whether it loaded the adapter, and the digest of the files it admitted (None where
    vllm-bdlora does not admit, i.e. BD-LoRA is off)."""

    loaded: bool
    digest: str | None

    def __bool__(self) -> bool:
        return self.loaded


# -- verdicts -------------------------------------------------------------------------------------------------------
def files_differ_refusal(adapter: str, identities) -> str | None:
    """The refusal when the ranks read different files (the files changed while they were read), else None."""
    if len({identity for identity in identities if identity is not None}) <= 1:
        return None
    return str(
        AdapterRejected(
            adapter,
            ["its files changed while the tensor-parallel ranks were reading them (the ranks read different files)"],
            REWRITE_HINT,
        )
    )


def load_timeout_refusal(adapter: str, path: str, timeout_s: float) -> str:
    return str(
        AdapterRejected(
            adapter,
            [f"its files ({CONFIG_FILE}, {WEIGHTS_FILE} in {path}) were not read on every worker within "
             f"{timeout_s:g} s"],
            "check that the adapter's storage answers (a stalled network filesystem?) and load it again; the "
            'deadline is "adapter_load_timeout_s" in the bdlora section of --additional-config.',
        )
    )  # fmt: skip


def lost_admission_refusal(adapter: str) -> str:
    return f"LoRA adapter '{adapter}': a worker lost its admission (restarted?); load it again"


def verdict(adapter: str, states: list[AdmissionState]) -> tuple[str | None, float]:
    """(the refusal every rank's states add up to, or None; the longest any rank has been reading). The adapter is
    admitted once every rank is `Ready` and no refusal was found."""
    failed = next((state.message for state in states if isinstance(state, Failed)), None)
    if failed is None and any(isinstance(state, Unknown) for state in states):
        failed = lost_admission_refusal(adapter)
    if failed is None and all(isinstance(state, Ready) for state in states):
        failed = files_differ_refusal(adapter, [state.identity for state in states])
    return failed, max((state.seconds for state in states if isinstance(state, Reading)), default=0.0)


def check_admission_replies(replies: list, lora_request, remove_everywhere: Callable[[], object]) -> bool:
    """The executor's verdict on every rank's add_lora reply: the first failure is raised (after every reply was read,
    see `AdapterLoadFailure`); ranks that read different files mean the files changed during the load, so the adapter
    is removed from every rank (`remove_everywhere`) and refused."""
    failures = [r for r in replies if isinstance(r, AdapterLoadFailure)]
    if failures:
        # A rank that only learned that another rank rejected the adapter has the least to say.
        failures.sort(key=lambda f: AdapterRejected.OTHER_RANK in f.message)
        raise RuntimeError(failures[0].message)
    digests = [r.digest for r in replies if isinstance(r, AdmissionReceipt)]
    refusal = files_differ_refusal(lora_request.lora_name, digests)
    if refusal is not None:
        remove_everywhere()
        raise RuntimeError(refusal)
    return all(replies)
