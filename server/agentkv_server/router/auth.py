"""Who may call what: tenants by API key, operators and engines by the shared secret.

Endpoints fall into three classes (docs/security.md):

- ``public``: ``GET /health``, for load balancers and process managers;
- ``operator``: the engines' holding reports (always the shared secret, ``x-agentkv-secret``)
  and, once API keys are configured, ``GET /metrics`` (the secret as ``x-agentkv-secret`` or
  as a bearer token, which Prometheus can send); metrics span every tenant;
- ``tenant``: everything else. With API keys configured a request needs
  ``Authorization: Bearer <key>``, and its tenant is the key's id (a short hash of it). Without
  keys every client is the one anonymous tenant.

Session ids are namespaced by tenant (:func:`session_key`), so two tenants using the same id
get separate holdings and neither can end the other's session. Keys are compared by their
SHA-256 digests, each against every known digest, so the time taken says nothing about a key.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping
from typing import Literal

from agentkv_server.router.errors import RouterError
from agentkv_server.wire import REPORT_PATH, SECRET_HEADER

__all__ = [
    "METRICS_PATH",
    "Access",
    "AccessPolicy",
    "session_key",
    "tenant_id",
]

METRICS_PATH = "/metrics"
_PUBLIC_PATHS = frozenset({"/health"})
# Not a session id character (docs/protocol.md section 1): "<tenant>#<id>" never equals an id.
_TENANT_SEPARATOR = "#"
_BEARER = "bearer "
_KEY_ERROR = "invalid_request_error"  # what api.openai.com answers for a missing or wrong key

Access = Literal["public", "operator", "tenant"]


def tenant_id(api_key: str) -> str:
    """A tenant's id: the first 16 hex digits of its key's SHA-256, safe to log and store."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def session_key(tenant: str | None, session_id: str) -> str:
    """The session store's key for a tenant's session id."""
    return session_id if tenant is None else f"{tenant}{_TENANT_SEPARATOR}{session_id}"


class AccessPolicy:
    """Decides, per request, whether it may proceed and as which tenant."""

    def __init__(self, *, api_keys: Iterable[str], secret: str) -> None:
        self._digests = {_digest(key): tenant_id(key) for key in api_keys}
        self._secret = _digest(secret)

    @property
    def authenticates(self) -> bool:
        """Whether clients must present an API key."""
        return bool(self._digests)

    def access(self, path: str) -> Access:
        if path == REPORT_PATH:
            return "operator"
        if path == METRICS_PATH:
            return "operator" if self.authenticates else "public"
        return "public" if path in _PUBLIC_PATHS else "tenant"

    def admit(self, path: str, headers: Mapping[str, str]) -> str | None:
        """The request's tenant (None: anonymous or not a tenant request); RouterError 401."""
        access = self.access(path)
        if access == "operator":
            offered = headers.get(SECRET_HEADER) or _bearer(headers.get("authorization"))
            if offered is None or not secrets.compare_digest(_digest(offered), self._secret):
                raise _unauthorized(
                    f"Missing or wrong {SECRET_HEADER}.", "authentication_error", "invalid_secret"
                )
            return None
        if access == "public" or not self.authenticates:
            return None
        key = _bearer(headers.get("authorization"))
        if key is None:
            raise _unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>'.", _KEY_ERROR, None
            )
        tenant = self._match(_digest(key))
        if tenant is None:
            raise _unauthorized("Incorrect API key provided.", _KEY_ERROR, "invalid_api_key")
        return tenant

    def _match(self, digest: bytes) -> str | None:
        found = None
        for known, tenant in self._digests.items():  # every key, no early exit
            if secrets.compare_digest(digest, known):
                found = tenant
        return found


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def _bearer(authorization: str | None) -> str | None:
    if authorization is None or not authorization.lower().startswith(_BEARER):
        return None
    return authorization[len(_BEARER) :].strip() or None


def _unauthorized(message: str, type: str, code: str | None) -> RouterError:
    return RouterError(401, message, type=type, code=code, headers={"www-authenticate": "Bearer"})
