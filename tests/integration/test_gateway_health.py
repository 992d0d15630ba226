"""GET /health in the contract's shape (docs/contract.md, "Health and operational routes"): status, gpu types, cluster,
workers and models, from the registry's view of the Triton endpoints; always 200, `degraded` in the body (as SIE's
gateway answers)."""

from __future__ import annotations

from gateway.settings import EndpointConfig
from tests.integration.conftest import BASE_PARAMS, MODEL, SIE_MODEL, TRITON_MODEL, one_pool


def worker(name: str, *, healthy: bool = True, models: list[str] | None = None, unavailable: list[str] | None = None,
           pool: str = "default", gpu: str = "default") -> dict:
    """A worker entry: the sie-sdk's WorkerInfo names (`gpu`, `loaded_models`), then the pool, remote and what is
    out of service on it."""
    return {"name": name, "gpu": gpu, "healthy": healthy, "loaded_models": [MODEL] if models is None else models,
            "pool": pool, "remote": False, "unavailable_models": unavailable or []}


def model(name: str = MODEL, sie_id: str | None = SIE_MODEL, *, workers: list[str] | None = None,
          unavailable_on: list[str] | None = None, gpu_types: list[str] | None = None) -> dict:
    """A model entry: the sie-sdk's ModelSummary names (`name`, `state`, `worker_count`, `gpu_types`) and ours."""
    workers = ["a"] if workers is None else workers
    return {"id": name, "name": name, "sie_id": sie_id, "status": "serving" if workers else "unavailable",
            "state": "loaded" if workers else "available", "workers": workers, "worker_count": len(workers),
            "unavailable_on": unavailable_on or [],
            "gpu_types": (["default"] if workers else []) if gpu_types is None else gpu_types}


async def test_healthy_cluster_body(gw):
    resp = await gw.client.get("/health")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json() == {
        "status": "healthy",
        "type": "gateway",
        "configured_gpu_types": ["default"],
        "live_gpu_types": ["default"],
        "cluster": {"worker_count": 1, "gpu_count": 0, "models_loaded": 1, "total_qps": 0.0},
        "workers": [worker("a")],
        "models": [model()],
    }


async def test_unreachable_worker_is_degraded_but_still_200(make_gateway):
    pools = (one_pool(EndpointConfig(url="a")),
             one_pool(EndpointConfig(url="b", name="gpu-0"), name="l4pool", machine_profile="l4"))
    gw = await make_gateway(pools=pools, setup=lambda fakes: setattr(fakes["b"], "down", True))
    resp = await gw.client.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "degraded"
    assert body["configured_gpu_types"] == ["default", "l4"]
    assert body["live_gpu_types"] == ["default"]
    assert body["cluster"] == {"worker_count": 2, "gpu_count": 0, "models_loaded": 1, "total_qps": 0.0}
    assert body["workers"] == [worker("a"), worker("gpu-0", healthy=False, models=[], pool="l4pool", gpu="l4")]
    assert [m["id"] for m in body["models"]] == [MODEL]


async def test_a_model_out_of_service_on_a_reachable_worker_is_degraded(make_gateway):
    def setup(fakes):
        fakes["a"].models = [(TRITON_MODEL, "READY", dict(BASE_PARAMS)), ("other_model", "UNAVAILABLE", {})]

    gw = await make_gateway(setup=setup)
    resp = await gw.client.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "degraded"
    assert body["cluster"]["models_loaded"] == 1
    assert body["workers"] == [worker("a", unavailable=["other_model"])]
    assert body["models"] == [model(), model("other_model", None, workers=[], unavailable_on=["a"])]


async def test_a_model_withdrawn_on_one_worker_is_named_with_where_it_still_runs(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a"), EndpointConfig(url="b")),))
    assert (await gw.client.get("/health")).json()["status"] == "healthy"
    gw.registry.withdraw(gw.registry.endpoints[0], TRITON_MODEL)  # its process died on `a`
    resp = await gw.client.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "degraded"
    assert body["models"] == [model(workers=["b"], unavailable_on=["a"])]
    assert body["workers"] == [worker("a", models=[], unavailable=[MODEL]), worker("b")]


async def test_nothing_served_is_still_200_and_degraded_in_the_body(make_gateway):
    """SIE's gateway answers 200 with `degraded`: the sie-sdk's get_capacity / wait_for_capacity / watch read this
    body while nothing is served, and raise on an error status. Readiness (/readyz) is what turns 503."""
    gw = await make_gateway(refresh=False, model_refresh_s=0.0,
                            setup=lambda fakes: setattr(fakes["a"], "down", True))
    resp = await gw.client.get("/health")
    assert resp.status_code == 200 and "retry-after" not in resp.headers
    assert (await gw.client.get("/readyz")).status_code == 503
    body = resp.json()
    assert body["status"] == "degraded" and body["type"] == "gateway"
    assert body["configured_gpu_types"] == ["default"] and body["live_gpu_types"] == []
    assert body["cluster"] == {"worker_count": 1, "gpu_count": 0, "models_loaded": 0, "total_qps": 0.0}
    assert body["workers"] == [worker("a", healthy=False, models=[])]
    assert body["models"] == []


async def test_a_model_on_two_machine_profiles_names_both(make_gateway):
    pools = (one_pool(EndpointConfig(url="a")),
             one_pool(EndpointConfig(url="b", name="gpu-0"), name="l4pool", machine_profile="l4"))
    gw = await make_gateway(pools=pools)
    body = (await gw.client.get("/health")).json()
    assert body["models"] == [model(workers=["a", "gpu-0"], gpu_types=["default", "l4"])]
    assert body["workers"] == [worker("a"), worker("gpu-0", pool="l4pool", gpu="l4")]
