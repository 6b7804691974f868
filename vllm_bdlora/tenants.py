"""Keys scoped to tenants: which adapters each key may use, load and unload, and from which directories.

vLLM's `--api-key` is one secret for everything: every holder can use, load, replace (`load_inplace`) and unload
every adapter and read every adapter's name in `/v1/models` and `/metrics`. With `--tenant-keys FILE` the server
reads instead a JSON file such as

    {"tenants": [
      {"name": "acme", "key_sha256": "<sha256 of the key, hex>", "adapters": ["acme-*"], "roots": ["/srv/acme"]},
      {"name": "globex", "key": "<the key itself>", "adapters": ["globex-chat"], "roots": ["/srv/globex"]},
      {"name": "operator", "key": "<the key itself>", "admin": true}
    ]}

and `TenantGate` (an ASGI middleware in front of vLLM's app) holds every route but the open probes to it:

* no key, or one the file does not list: 401;
* an admin key: everything, as `--api-key` would;
* a tenant key: generation routes only for its own adapters (a name listed, or starting with a listed prefix that
  ends in `*`) and the base model (unless `"base_model": false`); an adapter outside them answers 404 as an unknown
  model does, naming none of the others; loads and unloads only of its own names (403 otherwise, `load_inplace`
  over another tenant's adapter included), and loads only from its own `roots` (the same 403 as a path outside
  `--allowed-adapter-roots`; no roots, no loads); `/v1/models` and `/metrics` list only its own adapters (the base
  model and series without an adapter stay); a 404 about a model names none; every other route needs an admin key.

Keys are compared as SHA-256 digests in constant time; a key given in full is hashed when the file is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_bdlora.access import (
    OPEN_PATHS,
    PATH_REFUSED,
    adapter_name_problem,
    is_allowed_adapter_path,
    shown_name,
)

logger = logging.getLogger("vllm.bdlora")

TENANT_KEYS_FLAG = "--tenant-keys"
BODY_LIMIT = 64 * 2**20  # a tenant's request body is read (and checked) before it is let through
# The routes a tenant key may call; the rest (profiling, cache resets, sleep, scaling, ...) need an admin key.
TENANT_ROUTES = re.compile(
    r"/v1/(completions|chat/completions|responses|embeddings|score|rerank|models|tokenize|detokenize"
    r"|load_lora_adapter|unload_lora_adapter)(/.*)?|/(invocations|tokenize|detokenize|metrics|pooling|classify|score"
    r"|rerank)/?|/adapters(/.*)?"
)
LOAD_ROUTES = {("POST", "/v1/load_lora_adapter"): ("lora_name", "lora_path"), ("POST", "/adapters"): ("name", "src")}
UNLOAD_ROUTES = {("POST", "/v1/unload_lora_adapter"): "lora_name"}
KEY_FILE_HINT = f"fix the file given to {TENANT_KEYS_FLAG} (see the README's 'Keys scoped to tenants')."


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the entry and the fix."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digest: bytes
    admin: bool = False
    adapters: tuple[str, ...] = ()  # names, or prefixes ending in "*"
    roots: tuple[str, ...] = ()
    base_model: bool = True

    def may_use(self, adapter: str) -> bool:
        if self.admin:
            return True
        return any(adapter.startswith(p[:-1]) if p.endswith("*") else adapter == p for p in self.adapters)

    def may_load_from(self, path: str) -> bool:
        return self.admin or (bool(self.roots) and is_allowed_adapter_path(path, self.roots))


class TenantKeys:
    """The tenants of one key file."""

    def __init__(self, tenants: Iterable[Tenant], source: str):
        self.tenants = tuple(tenants)
        self.source = source

    @classmethod
    def read(cls, path: str) -> TenantKeys:
        try:
            with open(path, encoding="utf-8") as f:
                document = json.load(f)
        except OSError as e:
            raise KeyFileError(f"{TENANT_KEYS_FLAG} {path}: cannot be read ({e.strerror}); {KEY_FILE_HINT}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KeyFileError(f"{TENANT_KEYS_FLAG} {path}: not valid JSON ({e}); {KEY_FILE_HINT}") from None
        return cls.parse(document, path)

    @classmethod
    def parse(cls, document, source: str) -> TenantKeys:
        def refused(where: str, problem: str) -> KeyFileError:
            return KeyFileError(f"{TENANT_KEYS_FLAG} {source}: {where}{problem}; {KEY_FILE_HINT}")

        entries = document.get("tenants") if isinstance(document, dict) else None
        if not isinstance(entries, list) or not entries:
            raise refused("", 'must hold {"tenants": [...]} with at least one entry')
        tenants, digests, names = [], set(), set()
        for index, entry in enumerate(entries):
            where = f"tenants[{index}]: "
            if not isinstance(entry, dict):
                raise refused(where, "must be an object")
            unknown = set(entry) - {"name", "key", "key_sha256", "admin", "adapters", "roots", "base_model"}
            if unknown:
                raise refused(where, f"unknown fields {sorted(unknown)}")
            name = entry.get("name")
            if not isinstance(name, str) or not name or name in names:
                raise refused(where, "needs a unique, non-empty 'name'")
            where = f"tenant {name!r}: "
            digest = _key_digest(entry)
            if digest is None:
                raise refused(where, "needs exactly one of 'key' (at least 16 characters) or 'key_sha256' (64 hex)")
            if digest in digests:
                raise refused(where, "its key is another tenant's too")
            admin = entry.get("admin", False)
            base_model = entry.get("base_model", True)
            if not isinstance(admin, bool) or not isinstance(base_model, bool):
                raise refused(where, "'admin' and 'base_model' are true or false")
            adapters, roots = entry.get("adapters", []), entry.get("roots", [])
            if not _strings(adapters) or not _strings(roots):
                raise refused(where, "'adapters' and 'roots' are lists of strings")
            for pattern in adapters:
                if adapter_name_problem(pattern.removesuffix("*") or "*") is not None:
                    raise refused(where, f"adapter entry {shown_name(pattern)} is not an adapter name or prefix*")
            if not admin and not adapters:
                raise refused(where, "a tenant key needs 'adapters' (names, or prefixes ending in '*'), or admin")
            names.add(name)
            digests.add(digest)
            tenants.append(Tenant(name, digest, admin, tuple(adapters), tuple(roots), base_model))
        return cls(tenants, source)

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key the `Authorization: Bearer` header carries, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found = None
        for tenant in self.tenants:  # every entry is compared, so the time says nothing of which one matched
            if secrets.compare_digest(digest, tenant.key_digest):
                found = tenant
        return found

    def describe(self) -> str:
        admins = sum(t.admin for t in self.tenants)
        return f"{len(self.tenants) - admins} tenant key(s) and {admins} admin key(s) from {self.source}"


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def _key_digest(entry: dict) -> bytes | None:
    key, hashed = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (hashed is None):
        return None
    if key is not None:
        return hashlib.sha256(key.encode("utf-8")).digest() if isinstance(key, str) and len(key) >= 16 else None
    if isinstance(hashed, str) and re.fullmatch(r"[0-9a-fA-F]{64}", hashed):
        return bytes.fromhex(hashed)
    return None


# -- answers ---------------------------------------------------------------------------------------------------------
def error_body(message: str, kind: str, status: int) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def unknown_model_message(model) -> str:
    return f"The model {shown_name(model)} does not exist, or this key may not use it. GET /v1/models lists yours."


def not_yours_message(adapter, tenant: Tenant) -> str:
    allowed = ", ".join(tenant.adapters)
    return (
        f"LoRA adapter {shown_name(adapter)}: this key ({tenant.name}) may load and unload only adapters named "
        f"{allowed}; ask the operator to add the name to your entry in the key file."
    )


def visible_models(body: bytes, tenant: Tenant) -> bytes:
    """`/v1/models` with only the base model (where the tenant may use it) and the tenant's own adapters."""
    listing = json.loads(body)
    kept = []
    for card in listing.get("data", []):
        is_adapter = card.get("parent") is not None
        if tenant.may_use(card.get("id", "")) if is_adapter else tenant.base_model:
            kept.append(card)
    listing["data"] = kept
    return json.dumps(listing).encode()


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
ADAPTER_LABELS = ("adapter_name", "lora_name")
ALL_ADAPTERS_SERIES = ("vllm:lora_requests_info",)  # one series naming every running and waiting adapter


def visible_metrics(text: str, tenant: Tenant) -> str:
    """Prometheus's text format with every sample about another tenant's adapter left out (the overflow label
    'other' included, which sums several tenants), and the series that lists every adapter."""
    kept = []
    for line in text.splitlines():
        if line.startswith(ALL_ADAPTERS_SERIES) or any(f" {s} " in line for s in ALL_ADAPTERS_SERIES):
            continue
        if line and not line.startswith("#"):
            labels = dict(_LABEL.findall(line.split("}", 1)[0])) if "{" in line else {}
            if any(label in labels and not tenant.may_use(labels[label]) for label in ADAPTER_LABELS):
                continue
        kept.append(line)
    return "\n".join(kept) + "\n"


# -- the middleware ------------------------------------------------------------------------------------------------
class TenantGate:
    """Pure ASGI middleware enforcing `TenantKeys` (see the module's docstring)."""

    def __init__(self, app, keys: TenantKeys, base_models: Iterable[str]):
        self.app = app
        self.keys = keys
        self.base_models = frozenset(base_models)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (path.rstrip("/") or "/") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        tenant = self.keys.tenant_for(headers.get("authorization"))
        if tenant is None:
            return await _answer(send, 401, "Unauthorized: this server needs a key from its key file.",
                                 "Unauthorized")  # fmt: skip
        if tenant.admin:
            return await self.app(scope, receive, send)
        if scope["type"] != "http" or not TENANT_ROUTES.fullmatch(path):
            return await _answer(send, 403, f"{scope.get('method', '')} {path} needs an admin key.", "Forbidden")
        method = scope["method"]
        if method == "DELETE" and path.startswith("/adapters/"):
            name = path.removeprefix("/adapters/")
            if not tenant.may_use(name):
                return await _answer(send, 403, not_yours_message(name, tenant), "Forbidden")
            return await self.app(scope, receive, send)
        if path.rstrip("/") in ("/v1/models", "/metrics"):
            shown = visible_models if path.startswith("/v1") else _metrics_text
            # the answer is filtered as text: ask for it uncompressed (Prometheus asks for gzip)
            plain = {
                **scope,
                "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"accept-encoding"],
            }
            return await self.app(plain, receive, _filtered(send, lambda body: shown(body, tenant)))
        if method != "POST":
            return await self.app(scope, receive, send)
        body, replay = await _read_body(receive)
        if body is None:
            return await _answer(send, 413, f"request body over {BODY_LIMIT} bytes", "BadRequestError")
        try:
            request = json.loads(body) if body else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            return await _answer(send, 400, "a tenant key's requests carry a JSON body", "BadRequestError")
        if not isinstance(request, dict):
            return await _answer(send, 400, "a tenant key's requests carry a JSON object", "BadRequestError")
        route = (method, path.rstrip("/"))
        refusal = _refusal(route, request, tenant, self.base_models)
        if refusal is not None:
            return await _answer(send, *refusal)
        if route in LOAD_ROUTES or route in UNLOAD_ROUTES:
            return await self.app(scope, replay, send)
        return await self.app(scope, replay, _without_model_lists(send, request.get("model")))


def _refusal(route, request: dict, tenant: Tenant, base_models: frozenset[str]) -> tuple[int, str, str] | None:
    method, path = route
    if (method, path) in LOAD_ROUTES:
        name_field, path_field = LOAD_ROUTES[(method, path)]
        name, adapter_path = request.get(name_field), request.get(path_field)
        if not isinstance(name, str) or not tenant.may_use(name):
            return 403, not_yours_message(name, tenant), "Forbidden"
        if not isinstance(adapter_path, str) or not tenant.may_load_from(adapter_path):
            return 403, f"LoRA adapter {shown_name(name)}: {PATH_REFUSED}", "Forbidden"
        return None
    if (method, path) in UNLOAD_ROUTES:
        name = request.get(UNLOAD_ROUTES[(method, path)])
        return None if isinstance(name, str) and tenant.may_use(name) else (403, not_yours_message(name, tenant),
                                                                               "Forbidden")  # fmt: skip
    model = request.get("model")
    if model is None:
        return None if tenant.base_model else (404, unknown_model_message(model), "NotFoundError")
    if not isinstance(model, str):
        return 400, "'model' must be a string", "BadRequestError"
    if tenant.may_use(model):
        return None
    if tenant.base_model and model in base_models:
        return None
    return 404, unknown_model_message(model), "NotFoundError"


def _metrics_text(body: bytes, tenant: Tenant) -> bytes:
    return visible_metrics(body.decode("utf-8"), tenant).encode("utf-8")


async def _answer(send, status: int, message: str, kind: str) -> None:
    body = error_body(message, kind, status)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive):
    """The request's whole body (None past `BODY_LIMIT`) and a `receive` that hands it to the app again."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > BODY_LIMIT:
            return None, receive
        more = message.get("more_body", False)
    body, delivered = b"".join(chunks), False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _filtered(send, rewrite):
    """A `send` that buffers a 200 answer and sends `rewrite(body)` instead (other answers pass as they are)."""
    start, chunks = None, []

    async def filtered(message):
        nonlocal start
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                return await send(message)
            start = message
            return None
        if message["type"] != "http.response.body" or start is None:
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        body = rewrite(b"".join(chunks))
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return filtered


def _without_model_lists(send, model):
    """A `send` that replaces a 404's body (vLLM's and vllm-bdlora's unknown-model answers list served models,
    other tenants' included) with one that names none."""
    replaced = False

    async def guarded(message):
        nonlocal replaced
        if message["type"] == "http.response.start" and message["status"] == 404:
            replaced = True
            body = error_body(unknown_model_message(model), "NotFoundError", 404)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**message, "headers": headers})
            return await send({"type": "http.response.body", "body": body})
        if replaced:
            return None
        return await send(message)

    return guarded
