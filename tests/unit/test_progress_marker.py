"""Blocking requests get one first-token progress marker from the engine (docs/triton-contract.md)."""

from __future__ import annotations

import pytest

from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams


def _is_marker(out: RequestOutput) -> bool:
    return out.text == "" and out.finish_reason is None and not out.final and out.completion_tokens > 0 \
        and out.error is None


def _run(make_scheduler, tokenizer, requests: dict[str, tuple[SamplingParams, bool]]) -> dict[str, list]:
    sched = make_scheduler()
    outputs: dict[str, list[RequestOutput]] = {}
    for rid, (params, stream) in requests.items():
        outputs[rid] = []
        sched.scheduler.add(EngineRequest(rid, tokenizer.encode(f"Tell me a story about {rid}."), params,
                                outputs[rid].append, stream))
    for _ in range(200):
        if not sched.scheduler.has_work():
            break
        sched.step()
    return outputs


@pytest.mark.parametrize("n", [1, 2])
def test_blocking_request_sends_one_marker_then_its_closures(make_scheduler, tokenizer, n):
    params = SamplingParams(max_tokens=6, n=n, ignore_eos=True, temperature=0.0)
    outs = _run(make_scheduler, tokenizer, {"b": (params, False)})["b"]
    assert _is_marker(outs[0]) and outs[0].completion_tokens == 1
    assert sum(_is_marker(o) for o in outs) == 1
    closures = outs[1:]
    assert [o.finish_reason for o in closures] == ["length"] * n
    assert closures[-1].final and all(len(o.text) > 0 for o in closures)


def test_streams_and_single_token_requests_get_no_marker(make_scheduler, tokenizer):
    outs = _run(make_scheduler, tokenizer, {
        "stream": (SamplingParams(max_tokens=6, ignore_eos=True), True),
        "one": (SamplingParams(max_tokens=1, ignore_eos=True), False),  # closed by its first token
    })
    assert not any(_is_marker(o) for o in outs["stream"])
    assert [o.final for o in outs["one"]] == [True]


def test_batched_prefill_marks_every_blocking_request(make_scheduler, tokenizer):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = _run(make_scheduler, tokenizer, {f"r{i}": (params, False) for i in range(3)})
    for rid, got in outs.items():
        assert _is_marker(got[0]), rid
        assert sum(_is_marker(o) for o in got) == 1 and got[-1].final
