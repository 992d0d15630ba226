"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter against fake endpoints that keep an adapter list as the
engine does (engine/triton/lora_control.py): off by default, fanned out to every endpoint, listed at once and after
a refresh, usable as `model` and `lora_adapter`, gone after an unload, and the same on every worker at once."""

from __future__ import annotations

from typing import Any

from gateway.errors import worker_error
from gateway.settings import EndpointConfig

from .conftest import MODEL, FakeTriton, Gateway, assert_error, one_pool


def _lora_engine(fake: FakeTriton) -> None:
    """The fake serves `sql` from its profile and takes run-time loads like the engine's `lora_control`."""
    served = {"sql"}
    fake.inputs = fake.inputs | {"lora_control"}
    fake.lora_calls: list[dict[str, Any]] = []  # type: ignore[attr-defined]

    async def lora_control(triton_model: str, control: dict[str, Any], request_id: str) -> list[str]:
        fake.lora_calls.append(control)  # type: ignore[attr-defined]
        name = control.get("lora_name")
        if control["action"] == "load":
            if control["lora_path"] == "/not/an/adapter":
                raise worker_error("invalid_request", "'/not/an/adapter' is not a LoRA adapter", "lora_path")
            served.add(name)
        elif control["action"] == "unload":
            if name not in served:
                raise worker_error("unknown_lora_adapter", f"The lora adapter '{name}' is not loaded.", "lora_name")
            served.discard(name)
        return sorted(served)

    fake.lora_control = lora_control  # type: ignore[attr-defined]


def _setup(fakes: dict[str, FakeTriton]) -> None:
    for fake in fakes.values():
        _lora_engine(fake)


TWO = (one_pool(EndpointConfig(url="a"), EndpointConfig(url="b")),)


async def _ids(gw) -> list[str]:
    return [m["id"] for m in (await gw.client.get("/v1/models")).json()["data"]]


async def test_off_by_default_the_routes_answer_404_saying_how_to_turn_them_on(make_gateway):
    gw = await make_gateway(setup=_setup)
    resp = await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
    err = assert_error(resp, 404, "invalid_request")
    assert "SIE_ALLOW_RUNTIME_LORA_UPDATING" in err["message"]
    assert gw.fake("a").lora_calls == []


async def test_load_use_unload_on_every_endpoint(make_gateway):
    gw = await make_gateway(pools=TWO, setup=_setup, allow_runtime_lora=True)
    resp = await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": "/a/pirate"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'pirate' added successfully."
    for url in ("a", "b"):
        assert gw.fake(url).lora_calls[-1] == {"action": "load", "lora_name": "pirate", "lora_path": "/a/pirate"}
    assert await _ids(gw) == [MODEL, "pirate", "sql"]
    await gw.registry.refresh()  # re-discovery asks the models: the run-time adapter stays
    assert await _ids(gw) == [MODEL, "pirate", "sql"]

    assert (await gw.chat(model="pirate")).status_code == 200
    assert gw.calls[-1].req.lora_adapter == "pirate"
    assert (await gw.chat(lora_adapter="pirate")).status_code == 200
    assert gw.calls[-1].req.lora_adapter == "pirate"

    resp = await gw.client.post("/v1/unload_lora_adapter", json={"lora_name": "pirate", "model": MODEL})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'pirate' removed successfully."
    assert await _ids(gw) == [MODEL, "sql"]
    assert_error(await gw.chat(lora_adapter="pirate"), 400, "unknown_lora_adapter", "lora_adapter")
    assert_error(await gw.chat(model="pirate"), 404, "model_not_found", "model")


async def test_refusals_name_the_field(make_gateway):
    gw = await make_gateway(setup=_setup, allow_runtime_lora=True)
    assert_error(await gw.client.post("/v1/load_lora_adapter", json={"lora_path": "/a/x"}), 400,
                 "invalid_request", "lora_name")
    assert_error(await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/not/an/adapter"}),
                 400, "invalid_request", "lora_path")
    assert_error(await gw.client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 400,
                 "unknown_lora_adapter", "lora_name")
    assert_error(await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x",
                                                                     "model": "acme/none"}), 404, "model_not_found",
                 "model")
    assert await _ids(gw) == [MODEL, "sql"]


async def test_several_models_need_the_body_model(make_gateway):
    def setup(fakes: dict[str, FakeTriton]) -> None:
        _setup(fakes)
        fake = fakes["a"]
        fake.models.append(("other", "READY", {"served_name": "acme/Other"}))

    gw = await make_gateway(setup=setup, allow_runtime_lora=True)
    resp = await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
    assert_error(resp, 400, "invalid_request", "model")


async def test_behind_auth_even_where_operational_routes_are_open(make_gateway):
    gw = await make_gateway(setup=_setup, allow_runtime_lora=True, auth_mode="token", auth_tokens=("tok-1",),
                            auth_exempt_operational=True)
    body = {"lora_name": "x", "lora_path": "/a/x"}
    assert_error(await gw.client.post("/v1/load_lora_adapter", json=body), 401, "UNAUTHORIZED")
    assert_error(await gw.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 401, "UNAUTHORIZED")
    assert [c for c in gw.fake("a").lora_calls if c["action"] != "list"] == []  # (discovery lists the adapters)
    resp = await gw.client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer tok-1"})
    assert resp.status_code == 200


async def test_a_change_made_through_one_worker_is_seen_by_its_sibling_on_the_next_request(make_gateway, tmp_path):
    """Two gunicorn workers: their own registries, the same engines, one shared state folder. No background refresh
    runs here, so the sibling knows only what the shared marker tells it."""
    first = await make_gateway(setup=_setup, allow_runtime_lora=True, state_dir=str(tmp_path))
    sibling = Gateway(first.settings, first.fakes)
    try:
        await sibling.registry.refresh()
        assert await _ids(sibling) == [MODEL, "sql"]

        loaded = await first.client.post("/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": "/a/p"})
        assert loaded.status_code == 200
        assert await _ids(sibling) == [MODEL, "pirate", "sql"]
        assert (await sibling.chat(model="pirate")).status_code == 200

        unloaded = await sibling.client.post("/v1/unload_lora_adapter", json={"lora_name": "pirate"})
        assert unloaded.status_code == 200
        assert_error(await first.chat(model="pirate"), 404, "model_not_found", "model")
        assert_error(await first.chat(lora_adapter="pirate"), 400, "unknown_lora_adapter", "lora_adapter")
        assert await _ids(first) == [MODEL, "sql"]
    finally:
        await sibling.client.aclose()
