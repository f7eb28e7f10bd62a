"""Who is asking: API keys, tenants, and the per-tenant prefix-cache salt.

Two modes.

- **Keys configured** (``--api-key`` and/or ``--api-keys-file``): every ``/v1/*`` route and
  ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` need ``Authorization: Bearer <key>``, else 401 with an OpenAI error body (vLLM's ``--api-key``
  behaviour); ``/health`` stays open, and so do ``/openapi.json`` and ``/docs`` (vLLM's choice,
  kept on purpose: they describe the API, the same for every caller, and hold nothing about any
  tenant, request or load; see openapi.py). The key decides the tenant (quotas, cache isolation) and the
  most urgent priority class the request may use; the body's ``user`` field no longer counts.
  ``/metrics`` needs an admin key unless ``metrics_require_admin=False``: its prefix-cache counters
  move when anyone's prompt hits the cache, a direct side channel across tenants.
- **No keys**: nothing is refused; the tenant is derived as before (hashed bearer key, else the
  ``user`` field, else "anonymous", see ``admission.tenant_of``). Any client can claim any
  ``user``, so this mode separates cooperating tenants, it does not defend against hostile ones.

In both modes the engine's ``cache_salt`` is :func:`effective_salt` of (tenant, client salt): a
tenant only ever hits its own cached blocks, whether or not the client sends a salt, and sending
another tenant's salt gets nothing (issue 8: the cross-tenant TTFT side channel is closed by default).

Keys file (JSON)::

    {"keys": [
      {"key": "sk-acme-1", "tenant": "acme", "priority_class": "interactive", "admin": false},
      {"key_sha256": "<64 hex digits: sha256 of the key>", "tenant": "bulk",
       "priority_class": "batch"}
    ]}

``key`` or ``key_sha256`` (exactly one; the hash keeps plaintext keys off the server's disk),
``tenant`` (required; several keys may share one tenant, and then share its quota and its cache),
``priority_class`` (optional, default ``interactive``: the most urgent class the key may use; a
``batch`` key asking for ``interactive`` is served as ``batch``), ``admin`` (optional, default
false: may read ``/metrics`` and reset the prefix cache, ``POST /reset_prefix_cache``). Keys
given with ``--api-key`` are admin keys, each its own tenant.

Keys are never logged or echoed in errors. The presented key is hashed and looked up by its
SHA-256 digest, so no comparison ever runs over secret bytes (the lookup's timing can at most
reveal digest bytes, which say nothing usable about any key).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from starlette.responses import JSONResponse

from minserve.server.admission import INTERACTIVE, PRIORITY_CLASSES, tenant_of
from minserve.server.protocol import error_body

PRINCIPAL_SCOPE_KEY = "minserve.principal"  # where the middleware leaves the caller for the handlers
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # endpoints.py
ADMIN_ROUTES = ("/reset_prefix_cache",)  # endpoints.py: they change what every tenant sees
ROUTES_PREFIX = "/routes"  # routed_app.py: the canary's controls and every tenant's latencies
ENTRY_FIELDS = {"key", "key_sha256", "tenant", "priority_class", "admin"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _admin_only(path: str) -> bool:
    return path in ADMIN_ROUTES or path == ROUTES_PREFIX or path.startswith(ROUTES_PREFIX + "/")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    tenant: str
    max_class: str = INTERACTIVE   # the most urgent priority class it may use
    admin: bool = False


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_tenant(key: str) -> str:
    """The tenant of a key that names none: the same short hash as unauthenticated mode gives it."""
    return tenant_of("Bearer " + key, None)


def effective_salt(tenant: str, client_salt: str | None) -> str:
    """The ``cache_salt`` the engine gets. JSON keeps the pair unambiguous (no separator a tenant
    or salt could contain), so (tenant, salt) pairs never collide and a client salt alone never
    reproduces another tenant's key."""
    return hashlib.sha256(json.dumps(["minserve-salt-v1", tenant, client_salt]).encode()).hexdigest()


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class Auth:
    """The configured keys and the /metrics policy. ``keys`` maps plaintext keys, ``digests``
    maps SHA-256 digests of keys (:func:`key_digest`) to their Principal; only digests are kept."""

    def __init__(self, keys: Mapping[str, Principal] | None = None, *,
                 digests: Mapping[bytes, Principal] | None = None, metrics_require_admin: bool = True):
        self._by_digest: dict[bytes, Principal] = {}
        for d, p in [*((key_digest(k), p) for k, p in (keys or {}).items()), *(digests or {}).items()]:
            if p.max_class not in PRIORITY_CLASSES:
                raise ValueError(f"priority_class must be one of {list(PRIORITY_CLASSES)}, "
                                 f"got {p.max_class!r}")
            if d in self._by_digest:
                raise ValueError("auth: the same API key is configured twice")
            self._by_digest[d] = p
        if not self._by_digest:
            raise ValueError("auth: no API keys given; pass auth=None to serve without keys")
        self.metrics_require_admin = metrics_require_admin

    @classmethod
    def from_options(cls, api_keys: Iterable[str] = (), keys_file: str | Path | None = None,
                     metrics_require_admin: bool = True) -> "Auth | None":
        """The CLI's flags: ``--api-key`` keys (admin, one tenant each) plus a keys file; None
        when neither is given."""
        api_keys = list(api_keys)
        if any(not k or k != k.strip() for k in api_keys):  # padded keys could never match
            raise ValueError("--api-key must be non-empty, without surrounding spaces")
        digests = {key_digest(k): Principal(key_tenant(k), INTERACTIVE, admin=True) for k in api_keys}
        if keys_file is not None:
            for d, p in load_keys_file(keys_file).items():
                if d in digests:
                    raise ValueError(f"--api-keys-file {keys_file}: tenant {p.tenant!r} has a key "
                                     "that is also given with --api-key")
                digests[d] = p
        if not digests:
            return None
        return cls(digests=digests, metrics_require_admin=metrics_require_admin)

    def authenticate(self, authorization: str | None) -> Principal | None:
        key = bearer_key(authorization)
        return None if key is None else self._by_digest.get(key_digest(key))

    def protects(self, path: str) -> bool:
        # The tokenizer routes too (vLLM leaves them open): they run on the threads that prepare
        # every prompt, so an anonymous flood of them would delay the keyed clients' requests.
        return (path.startswith("/v1") or path in TOKENIZER_ROUTES or _admin_only(path)
                or (self.metrics_require_admin and path == "/metrics"))

    def refusal(self, path: str, principal: Principal | None) -> JSONResponse | None:
        """The 401/403 answer for this caller on a protected path, or None to let it through."""
        if principal is None:
            body = error_body(401, "Unauthorized: send a valid API key as 'Authorization: Bearer "
                              "<key>'", code="invalid_api_key")
            return JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
        if (path == "/metrics" or _admin_only(path)) and not principal.admin:
            return JSONResponse(error_body(403, f"Forbidden: {path} needs an admin API key",
                                           code="forbidden"), 403)
        return None


class AuthMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would re-wrap every streamed response): refuses a
    protected request before its body is read, else records the caller in the scope."""

    def __init__(self, app, auth: Auth):
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.auth.protects(scope["path"]):
            headers = dict(scope.get("headers") or ())
            raw = headers.get(b"authorization")
            principal = self.auth.authenticate(raw.decode("latin-1") if raw is not None else None)
            refusal = self.auth.refusal(scope["path"], principal)
            if refusal is not None:
                return await refusal(scope, receive, send)
            scope[PRINCIPAL_SCOPE_KEY] = principal
        await self.app(scope, receive, send)


def load_keys_file(path: str | Path) -> dict[bytes, Principal]:
    """Key digest -> Principal, from the JSON file described in the module docstring; ValueError
    naming the file and the entry on bad content (never the key itself)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys-file {path}: not valid JSON ({e})") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'--api-keys-file {path}: expected {{"keys": [{{"key": ..., "tenant": ...}}, '
                         '...]}} with at least one entry')
    out: dict[bytes, Principal] = {}
    for i, e in enumerate(entries):
        where = f"--api-keys-file {path}: keys[{i}]"
        digest, principal = _parse_entry(e, where)
        if digest in out:
            raise ValueError(f"{where}: this key is already listed in an earlier entry")
        out[digest] = principal
    return out


def _parse_entry(e, where: str) -> tuple[bytes, Principal]:
    if not isinstance(e, dict):
        raise ValueError(f"{where}: must be an object with 'key' (or 'key_sha256') and 'tenant'")
    unknown = set(e) - ENTRY_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(ENTRY_FIELDS)}")
    if ("key" in e) == ("key_sha256" in e):
        raise ValueError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if "key" in e:
        key = e["key"]
        # Surrounding spaces could never match: bearer_key strips them from the header.
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(f"{where}.key: must be a non-empty string without surrounding spaces")
        digest = key_digest(key)
    else:
        hexdigest = e["key_sha256"]
        if not isinstance(hexdigest, str) or not _HEX64.fullmatch(hexdigest.lower()):
            raise ValueError(f"{where}.key_sha256: must be 64 hex digits (sha256 of the key)")
        digest = bytes.fromhex(hexdigest)
    tenant = e.get("tenant")
    if not isinstance(tenant, str) or not tenant.strip():
        raise ValueError(f"{where}.tenant: must be a non-empty string")
    if tenant.startswith("key-"):
        raise ValueError(f"{where}.tenant: names starting with 'key-' are reserved for --api-key tenants")
    cls = e.get("priority_class", INTERACTIVE)
    if cls not in PRIORITY_CLASSES:
        raise ValueError(f"{where}.priority_class: must be one of {list(PRIORITY_CLASSES)}, got {cls!r}")
    admin = e.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}.admin: must be true or false, got {admin!r}")
    return digest, Principal(tenant, cls, admin)
