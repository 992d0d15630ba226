"""Supervision of model processes against the fake Triton (the real kill is tests/e2e/test_supervision.py)."""

from __future__ import annotations

from gateway.errors import ModelProcessDied
from tests.helpers.waiting import wait_until_async
from tests.integration.conftest import MODEL, TRITON_MODEL, assert_error, ev


async def _listed(gw) -> list[str]:
    return [m["id"] for m in (await gw.client.get("/v1/models")).json()["models"]]


async def test_a_dead_model_found_by_the_probe_leaves_service_and_is_reloaded(gw):
    fake = gw.fake()
    fake.dead.add(TRITON_MODEL)
    await gw.supervisor.probe_all()
    # out of routing, the model list and readiness at once
    assert await _listed(gw) == []
    resp = await gw.chat()
    assert_error(resp, 503, "MODEL_LOADING", None)
    assert resp.headers["retry-after"] == "5"
    assert (await gw.client.get("/readyz")).status_code == 503
    # a refresh while Triton still calls it READY does not bring it back
    await gw.registry.refresh()
    assert await _listed(gw) == []
    # reloaded once, then serving again
    await wait_until_async(lambda: fake.reloads == [TRITON_MODEL] and MODEL in [p.name for p in gw.registry.profiles()],
                           5.0, "the dead model was never reloaded")
    assert (await gw.chat()).status_code == 200
    assert await _listed(gw) == [MODEL]


async def test_a_request_answered_by_a_dead_process_is_503_and_starts_the_reload(gw):
    fake = gw.fake()
    error = ModelProcessDied("the model process of 'tiny' (tiny_0_0) is dead")
    fake.script = [error]
    fake.dead.add(TRITON_MODEL)
    resp = await gw.generate()
    assert_error(resp, 503, "MODEL_LOADING", None)
    assert resp.headers["retry-after"] == "5"
    assert await _listed(gw) == []
    fake.script = [ev("ok", finish="stop", completion=1)]
    await wait_until_async(lambda: fake.reloads == [TRITON_MODEL] and bool(gw.registry.profiles()),
                           5.0, "the dead model was never reloaded")
    assert (await gw.generate()).status_code == 200


async def test_a_stream_cut_by_the_dead_process_ends_in_band(gw):
    gw.fake().script = [ev("a"), ev("b"), ModelProcessDied("the model process of 'tiny' died")]
    resp = await gw.chat(stream=True)
    assert resp.status_code == 200
    assert '"code":"MODEL_LOADING"' in resp.text.replace(" ", "")
    assert resp.text.rstrip().endswith("data: [DONE]")
