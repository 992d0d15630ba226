"""A request's `priority` crosses the real stack (openai SDK -> gateway -> Triton's `priority` input -> the engine):
while a streamed chat of priority -2 runs, the engine counts it in the `high` band, and the band is empty again once
the client has left."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import MODEL
from tests.helpers.sse import data_payloads
from tests.helpers.waiting import poll

RUNNING = "sie_engine_num_requests_running_by_priority"


def test_a_requests_priority_reaches_the_engine(stack):
    assert stack.triton_metric(RUNNING, priority_band="high") == 0
    seen_high = 0.0
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 400, "stream": True, "priority": -2, "temperature": 0.7,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(data_payloads(r.iter_lines())):
            if i == 3:  # the engine's gauges are exported as its steps run
                seen_high = poll(lambda: stack.triton_metric(RUNNING, priority_band="high"), 10,
                                 until=lambda n: n == 1, interval_s=0.25)
                break  # leave mid-stream: the engine cancels it
    assert seen_high == 1
    poll(lambda: stack.triton_metric(RUNNING, priority_band="high"), 15, until=lambda n: n == 0, interval_s=0.25)
    assert stack.triton_metric(RUNNING, priority_band="high") == 0
