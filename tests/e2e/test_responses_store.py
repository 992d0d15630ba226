"""The response store under the real gunicorn gateway (stub model behind a real tritonserver): every worker
finds what another stored, and a restarted gateway still has it."""

from __future__ import annotations

import httpx

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop

STUB_MODEL = "sie-test/stub-tokens"


def _gateway(stub, db, tmp_path, name):
    port = free_port()
    proc = start_gateway(stub.ports.grpc, port, workers=2, log_path=tmp_path / f"{name}.log",
                         extra_env={"SIE_AUTH_MODE": "none", "SIE_RESPONSES_STORE": str(db)})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz")
    return proc, url


def test_stored_responses_are_shared_by_workers_and_survive_a_restart(stub, tmp_path):
    db = tmp_path / "store" / "responses.sqlite3"
    proc, url = _gateway(stub, db, tmp_path, "first")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            ids = [client.post("/v1/responses", json={"model": STUB_MODEL, "input": f"hi {i}",
                                                       "max_output_tokens": 3}).json()["id"] for i in range(6)]
            # a new connection per read: either of the two workers may answer it
            for response_id in ids:
                got = httpx.get(f"{url}/v1/responses/{response_id}", timeout=30)
                assert got.status_code == 200 and got.json()["id"] == response_id
    finally:
        stop(proc)
    proc, url = _gateway(stub, db, tmp_path, "second")
    try:
        got = httpx.get(f"{url}/v1/responses/{ids[0]}", timeout=30)
        assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"]
        follow = httpx.post(f"{url}/v1/responses", json={"model": STUB_MODEL, "input": "and then?",
                                                          "previous_response_id": ids[0], "max_output_tokens": 2},
                            timeout=30)
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == ids[0]
    finally:
        stop(proc)
