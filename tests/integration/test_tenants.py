"""Tenants through the real app against the fake Triton: a stored response is its key's tenant's alone (another key
gets exactly the answers of an id never stored), each tenant's requests carry their own prefix-cache salt (none
with auth off, with SIE_PREFIX_CACHE_SCOPE=global, or to a model that does not take it), and a key removed from the
keys file is refused from its next request on."""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import MODEL, assert_error, tokens

KEY_A, KEY_B, KEY_C = "tenant-a-key-7f3e9a", "tenant-b-key-51c0d2", "tenant-a-second-key-88e1"


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _respond(gw, key: str, **body):
    return await gw.client.post("/v1/responses", json={"model": MODEL, "input": "hi", **body}, headers=_as(key))


def _without_ids(error: dict, *ids: str) -> dict:
    """An error body with the ids it names blanked, to compare the answer about one id with the answer about
    another."""
    text = error["message"]
    for response_id in ids:
        text = text.replace(response_id, "<id>")
    return {**error, "message": text}


@pytest.fixture
async def tenants(make_gateway, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    return await make_gateway(auth_mode="token", auth_tokens_file=str(keys),
                              responses_store=str(tmp_path / "responses.sqlite3"))


async def test_another_key_cannot_read_delete_or_continue_a_response(tenants):
    gw = tenants
    first = await _respond(gw, KEY_A)
    assert first.status_code == 200, first.text
    mine, missing = first.json()["id"], "resp_" + "0" * 32
    for key, response_id in ((KEY_B, mine), (KEY_A, missing)):  # another tenant's id, and an id never stored
        got = await gw.client.get(f"/v1/responses/{response_id}", headers=_as(key))
        deleted = await gw.client.delete(f"/v1/responses/{response_id}", headers=_as(key))
        continued = await _respond(gw, key, previous_response_id=response_id)
        answers = [assert_error(got, 404, "invalid_request", "response_id"),
                   assert_error(deleted, 404, "invalid_request", "response_id"),
                   assert_error(continued, 400, "invalid_request", "previous_response_id")]
        if key == KEY_B:
            theirs = [_without_ids(a, mine) for a in answers]
        else:
            assert [_without_ids(a, missing) for a in answers] == theirs  # word for word the same
    # the owner still has it: B's delete did nothing
    got = await gw.client.get(f"/v1/responses/{mine}", headers=_as(KEY_A))
    assert got.status_code == 200 and got.json()["id"] == mine
    assert (await _respond(gw, KEY_A, previous_response_id=mine)).status_code == 200
    assert (await gw.client.delete(f"/v1/responses/{mine}", headers=_as(KEY_A))).status_code == 200


async def test_a_streamed_response_is_stored_for_its_tenant_only(tenants):
    gw = tenants
    gw.fake().script = tokens("streamed", " answer")
    resp = await _respond(gw, KEY_A, stream=True)
    assert resp.status_code == 200
    response_id = resp.text.split('"id":"', 1)[1].split('"', 1)[0]
    assert (await gw.client.get(f"/v1/responses/{response_id}", headers=_as(KEY_B))).status_code == 404
    assert (await gw.client.get(f"/v1/responses/{response_id}", headers=_as(KEY_A))).status_code == 200


async def test_each_tenant_sends_its_own_salt_and_never_its_key(make_gateway, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a {KEY_A}\nteam-a {KEY_C}\n{KEY_B}\n")
    gw = await make_gateway(auth_mode="token", auth_tokens_file=str(keys))
    for key in (KEY_A, KEY_B, KEY_A, KEY_C):
        assert (await gw.chat(headers=_as(key))).status_code == 200
    assert (await gw.generate(headers={"x-api-key": KEY_B})).status_code == 200
    salts = [call.req.cache_salt for call in gw.calls]
    a1, b1, a2, c1, b2 = salts
    assert a1 and b1 and a1 != b1  # two tenants: two scopes
    assert a1 == a2 == c1 and b1 == b2  # one tenant, however many keys and routes: one scope
    assert not any(key in salt for salt in salts for key in (KEY_A, KEY_B, KEY_C))
    assert all(key not in repr(call.req) and salt not in repr(call.req)
               for call, salt in zip(gw.calls, salts, strict=True) for key in (KEY_A, KEY_B))


@pytest.mark.parametrize("settings", [{"auth_mode": "none"},
                                      {"auth_mode": "token", "auth_tokens": (KEY_A,), "prefix_cache_scope": "global"}])
async def test_one_shared_cache_sends_no_salt(make_gateway, settings):
    gw = await make_gateway(**settings)
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 200
    assert gw.calls[0].req.cache_salt is None


async def test_a_model_without_the_salt_input_is_sent_none(make_gateway):
    def older_model(fakes):
        fakes["a"].inputs = frozenset({"text_input", "messages", "sampling_parameters", "stream"})

    gw = await make_gateway(auth_mode="token", auth_tokens=(KEY_A,), setup=older_model)
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 200
    assert gw.calls[0].req.cache_salt is None  # Triton would refuse an input the model does not declare


async def test_a_key_removed_from_the_file_is_refused_from_its_next_request(make_gateway, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    gw = await make_gateway(auth_mode="token", auth_tokens_file=str(keys))
    assert (await gw.chat(headers=_as(KEY_B))).status_code == 200
    rotated = tmp_path / "keys.new"
    rotated.write_text(f"{KEY_A}\n{KEY_C}\n")
    os.replace(rotated, keys)
    err = assert_error(await gw.chat(headers=_as(KEY_B)), 401, "UNAUTHORIZED", None)
    assert err["message"] == "Invalid token"
    assert (await gw.chat(headers=_as(KEY_C))).status_code == 200
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 200


async def test_with_auth_off_everyone_is_one_tenant(make_gateway, tmp_path):
    gw = await make_gateway(responses_store=str(tmp_path / "responses.sqlite3"))
    response_id = (await _respond(gw, "anything")).json()["id"]
    got = await gw.client.get(f"/v1/responses/{response_id}")
    assert got.status_code == 200 and got.json()["id"] == response_id
