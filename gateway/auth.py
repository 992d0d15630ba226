"""Bearer / x-api-key authentication for the inference routes (docs/contract.md, "Auth")."""

from __future__ import annotations

import hmac

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
        self.tokens = [t.encode() for t in settings.auth_tokens]
        self.open_paths = OPEN_PATHS | (OPERATIONAL_PATHS if settings.auth_exempt_operational else frozenset())

    def check(self, path: str, authorization: str | None, api_key: str | None) -> None:
        if path in self.open_paths or self.mode == "none":
            return
        if self.mode not in ENABLED_MODES or not self.tokens:
            raise ServerMisconfigured("Gateway auth enabled but no tokens configured")
        presented = [t for t in (_bearer(authorization), (api_key or "").strip() or None) if t is not None]
        if not presented:
            raise Unauthorized("Missing Authorization header")
        # either valid token admits (docs/contract.md, "Decisions" 2); credentials that match none are a 401
        if not any(self._known(token) for token in presented):
            raise Unauthorized("Invalid token", token_sent=True)

    def _known(self, token: str) -> bool:
        # compare against every configured token, in constant time per comparison
        matched = False
        for known in self.tokens:
            matched |= hmac.compare_digest(token.encode(), known)
        return matched
