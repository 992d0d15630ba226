"""WS /ws/cluster-status on the real gateway under gunicorn (uvicorn's WebSocket protocol), with token auth on:
the handshake without a token is the contract's 401, with one the feed pushes the cluster's state."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.e2e.conftest import STUB, TOKEN


def ws_url(stub) -> str:
    return stub.url.replace("http://", "ws://") + "/ws/cluster-status"


def test_the_feed_needs_a_token_and_refuses_in_the_envelope(stub):
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(stub), open_timeout=10).close()
    response = refused.value.response
    assert response.status_code == 401
    assert response.headers["X-SIE-Error-Code"] == "UNAUTHORIZED"
    assert json.loads(response.body)["error"]["code"] == "UNAUTHORIZED"


def test_the_feed_pushes_the_cluster_once_a_second(stub):
    with connect(ws_url(stub), additional_headers=stub.headers, open_timeout=10) as ws:
        first, second = json.loads(ws.recv(timeout=10)), json.loads(ws.recv(timeout=10))
    assert first["type"] == "gateway"
    assert set(first) >= {"timestamp", "cluster", "workers", "models"}
    assert STUB in [m["name"] for m in first["models"]] or STUB in [m["sie_id"] for m in first["models"]]
    assert 0.5 < second["timestamp"] - first["timestamp"] < 5


def test_the_feed_survives_a_client_that_talks_and_one_that_leaves(stub):
    """A feed takes no input: what a client sends is read and dropped. A client gone mid-feed leaves the worker
    serving (the next handshake is fed)."""
    with connect(ws_url(stub), additional_headers={"x-api-key": TOKEN}, open_timeout=10) as ws:
        ws.send("hello" * 1000)
        assert json.loads(ws.recv(timeout=10))["type"] == "gateway"
    with connect(ws_url(stub), additional_headers=stub.headers, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "gateway"
