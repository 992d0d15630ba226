"""Gateway auth (docs/contract.md, "Auth", and "Decisions" 1 and 2)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import SIE_MODEL, assert_error, assert_sie_headers

TOKENS = ("tok-one", "tok-two")


@pytest.fixture
async def secured(make_gateway):
    return await make_gateway(auth_mode="token", auth_tokens=TOKENS)


async def test_auth_mode_none_needs_no_token(gw):
    assert (await gw.chat()).status_code == 200
    assert (await gw.chat(headers={"Authorization": "Bearer whatever"})).status_code == 200


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer tok-one"},
    {"Authorization": "bearer tok-two"},
    {"Authorization": "BEARER   tok-one  "},
    {"x-api-key": "tok-two"},
    {"X-API-Key": "tok-one"},
    {"Authorization": "Bearer tok-one", "x-api-key": "tok-two"},  # both sent, both valid
    {"Authorization": "tok-one"},  # a raw token value, as SIE's gateway reads it
    {"Authorization": "  tok-two "},
    # either valid token admits (docs/contract.md, "Decisions" 2)
    {"Authorization": "Bearer wrong", "x-api-key": "tok-one"},
    {"Authorization": "Bearer tok-one", "x-api-key": "wrong"},
    {"Authorization": "Basic dG9rLW9uZQ==", "x-api-key": "tok-one"},
])
async def test_valid_token_admits(secured, headers):
    assert (await secured.chat(headers=headers)).status_code == 200
    assert (await secured.generate(headers=headers)).status_code == 200


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer wrong"},
    {"Authorization": "Bearer tok-one-and-more"},
    {"x-api-key": "tok"},
    {"Authorization": "Bearer wrong", "x-api-key": "wrong-too"},
    # other schemes and a scheme alone are raw values that match no token
    {"Authorization": "Basic dG9rLW9uZQ=="},
    {"Authorization": "Token tok-one"},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
])
async def test_wrong_token_is_401(secured, headers):
    for resp in (await secured.chat(headers=headers), await secured.generate(headers=headers)):
        err = assert_error(resp, 401, "UNAUTHORIZED", None, "authentication_error")
        assert err["message"] == "Invalid token"
        assert resp.headers["www-authenticate"] == 'Bearer realm="sie", error="invalid_token"'
    assert not secured.calls


@pytest.mark.parametrize("headers", [{}, {"Authorization": ""}, {"x-api-key": " "}])
async def test_missing_token_is_401(secured, headers):
    resp = await secured.chat(headers=headers)
    err = assert_error(resp, 401, "UNAUTHORIZED", None, "authentication_error")
    assert err["message"] == "Missing Authorization header"
    assert resp.headers["www-authenticate"] == 'Bearer realm="sie"'  # RFC 9110: every 401 names the scheme


async def test_auth_runs_before_body_parsing(secured):
    resp = await secured.client.post("/v1/chat/completions", content=b"{not json")
    assert_error(resp, 401, "UNAUTHORIZED", None)
    resp = await secured.client.post(f"/v1/generate/{SIE_MODEL}", content=b"[")
    assert_error(resp, 401, "UNAUTHORIZED", None)
    # and before the body-size limit
    resp = await secured.client.post("/v1/chat/completions", content=b"x" * (17 * 1024 * 1024))
    assert_error(resp, 401, "UNAUTHORIZED", None)
    # with a token the same bodies get their real errors
    resp = await secured.client.post("/v1/chat/completions", content=b"{not json",
                                     headers={"x-api-key": "tok-one"})
    assert_error(resp, 400, "invalid_request", None)


async def test_token_mode_without_tokens_is_500(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=())
    resp = await gw.chat(headers={"Authorization": "Bearer anything"})
    err = assert_error(resp, 500, "GATEWAY_AUTH_MISCONFIGURED", None, "server_error")
    assert "no tokens configured" in err["message"]
    assert (await gw.client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json"])
async def test_operational_routes_are_open(secured, path):
    resp = await secured.client.get(path)
    assert resp.status_code == 200
    assert_sie_headers(resp)


async def test_model_list_needs_a_token(secured):
    assert_error(await secured.client.get("/v1/models"), 401, "UNAUTHORIZED", None)
    assert (await secured.client.get("/v1/models", headers={"x-api-key": "tok-two"})).status_code == 200


async def test_every_auth_exempt_path_is_served(secured):
    """An exempt path with no route is dead configuration: it would only open a 404 to anyone."""
    from gateway.auth import OPEN_PATHS, OPERATIONAL_PATHS

    for path in sorted(OPEN_PATHS | OPERATIONAL_PATHS):
        resp = await secured.client.get(path)
        assert resp.status_code != 404, path


async def test_docs_are_open_and_the_index_is_operational(make_gateway):
    """docs/contract.md, "Auth": `/docs` always exempt; `/` only with SIE_AUTH_EXEMPT_OPERATIONAL."""
    secured = await make_gateway(auth_mode="token", auth_tokens=TOKENS)
    docs = await secured.client.get("/docs")
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in docs.text and "/v1/generate/{model}" in docs.text and "/openapi.json" in docs.text
    # Redoc over /openapi.json, its bundle served here and open like /docs (the contract's exempt list)
    assert '<redoc spec-url="/openapi.json">' in docs.text and '<script src="/docs/redoc.standalone.js">' in docs.text
    viewer = await secured.client.get("/docs/redoc.standalone.js")
    assert viewer.status_code == 200 and viewer.headers["content-type"].startswith("application/javascript")
    assert len(viewer.content) > 500_000 and b"Redoc" in viewer.content[:2000]
    assert_error(await secured.client.get("/"), 401, "UNAUTHORIZED", None)
    index = await secured.client.get("/", headers={"Authorization": "Bearer tok-one"})
    assert index.status_code == 200 and index.json()["openapi"] == "/openapi.json" and index.json()["docs"] == "/docs"
    exempt = await make_gateway(auth_mode="token", auth_tokens=TOKENS, auth_exempt_operational=True)
    assert (await exempt.client.get("/")).status_code == 200
