"""Bearer / x-api-key authentication for the inference routes (docs/contract.md, "Auth"), and the tenant
each request belongs to (gateway/auth_tokens.py)."""

from __future__ import annotations

from gateway.auth_tokens import ANONYMOUS, Tenant, TokenTable, keyed_hash, load_secret
from gateway.errors import ServerMisconfigured, Unauthorized
from gateway.settings import Settings

# Only paths this gateway serves. vLLM's /health and /version carry no model data and are health routes (always open:
# docs/contract.md, "Auth"); /tokenize and /detokenize expose the model's tokenizer and stay behind auth like the
# inference routes. The operational ones are `/`, `/metrics`, `/ws/*` (docs/contract.md, "Auth").
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/redoc.standalone.js", "/health",
                        "/version"})
OPERATIONAL_PATHS = frozenset({"/", "/metrics", "/ws/cluster-status"})  # open only with SIE_AUTH_EXEMPT_OPERATIONAL
ENABLED_MODES = frozenset({"token", "static"})


def _bearer(header: str | None) -> str | None:
    """The token an `Authorization` header carries: `Bearer <token>` (scheme case-insensitive, whitespace trimmed) or
    a raw token value, as SIE's gateway reads it (docs/contract.md, "Auth"); None when the header is absent or blank.
    `Bearer` with nothing after it carries an empty token, which matches none."""
    if header is None or not header.strip():
        return None
    value = header.strip()
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else value


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self.mode = settings.auth_mode
        self.open_paths = OPEN_PATHS | (OPERATIONAL_PATHS if settings.auth_exempt_operational else frozenset())
        self.tokens: TokenTable | None = None
        self._secret_file = settings.tenant_secret_file
        self._secret: bytes | None = None
        if self.mode != "none":
            self._secret = load_secret(settings.tenant_secret_file)
            self.tokens = TokenTable(settings.auth_tokens, settings.auth_tokens_file, self._secret,
                                     salted=settings.prefix_cache_scope == "tenant")

    def check(self, path: str, authorization: str | None, api_key: str | None) -> Tenant:
        """The request's tenant; raises 401 (or 500 when auth is on with no keys). With auth off, and on the open
        paths, every client is the one anonymous tenant."""
        if path in self.open_paths or self.tokens is None:
            return ANONYMOUS
        if self.mode not in ENABLED_MODES or not len(self.tokens):
            raise ServerMisconfigured("Gateway auth enabled but no tokens configured")
        presented = [t for t in (_bearer(authorization), (api_key or "").strip() or None) if t is not None]
        if not presented:
            raise Unauthorized("Missing Authorization header")
        # either valid token admits (docs/contract.md, "Decisions" 2); credentials that match none are a 401.
        # Both valid: the Authorization header's key names the tenant.
        tenants = [self.tokens.tenant_for(token) for token in presented]
        tenant = next((t for t in tenants if t is not None), None)
        if tenant is None:
            raise Unauthorized("Invalid token", token_sent=True)
        return tenant

    def user_tenant(self, user: str) -> str:
        """With auth off, the fair-share tenant of a request's `user`: a keyed hash under the shared secret, so every
        worker and replica sees one user as one tenant and the engine never sees the user. The secret is read on
        first use, so a gateway whose clients send no `user` never creates it."""
        if self._secret is None:
            self._secret = load_secret(self._secret_file)
        return keyed_hash(self._secret, "fair-share", "user:" + user)

    def reload_keys(self) -> None:
        """SIGHUP (gateway/worker.py): re-read the keys file before the next request."""
        if self.tokens is not None:
            self.tokens.reload_soon()
