"""/v1/completions through the official openai SDK (`client.completions.create`) against the real stack."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL, SIE_MODEL

FRANCE = "The capital of France is"
ITALY = "The capital of Italy is"


def test_blocking_continues_the_raw_prompt(openai_client):
    reply = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.id.startswith("cmpl-")
    assert reply.model == MODEL and reply.system_fingerprint.startswith("fp_")
    (choice,) = reply.choices
    assert choice.index == 0 and "Paris" in choice.text
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = reply.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_default_max_tokens_is_16(openai_client):
    reply = openai_client.completions.create(model=SIE_MODEL, prompt="Count: 1, 2, 3,", temperature=0,
                                             extra_body={"ignore_eos": True})
    assert reply.model == MODEL
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_streamed_text_equals_blocking_text_at_temperature_zero(openai_client):
    blocking = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=20, temperature=0)
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "text_completion" for c in chunks)
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == blocking.choices[0].text
    finishes = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert finishes == [blocking.choices[0].finish_reason]
    assert last.choices == [] and last.usage == blocking.usage


def test_n2_blocking_and_streamed(openai_client):
    kwargs = dict(model=MODEL, prompt=FRANCE, max_tokens=6, n=2, temperature=0.9, seed=5,
                  extra_body={"ignore_eos": True})
    reply = openai_client.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    single = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1)
    # 2 candidates x 6 tokens; the prompt is counted once
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == single.usage.prompt_tokens
    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_logprobs_legacy_object(openai_client):
    reply = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=5, temperature=0, logprobs=2,
                                             extra_body={"ignore_eos": True})
    (choice,) = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert reply.usage.completion_tokens == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 2 <= len(top) <= 3 and top[token] == logprob
        # greedy: the sampled token is the most likely one
        assert logprob == max(top.values())


def test_stop_string_is_trimmed(openai_client):
    reply = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=30, temperature=0, stop=["Paris"])
    assert "Paris" not in reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop"


def test_seed_reproducibility(openai_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234)
    first = openai_client.completions.create(**kwargs).choices[0].text
    second = openai_client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_prompt_array_one_choice_set_per_prompt(openai_client):
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    reply = openai_client.completions.create(prompt=[FRANCE, ITALY], n=2, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    france = openai_client.completions.create(prompt=FRANCE, **kwargs)
    italy = openai_client.completions.create(prompt=ITALY, **kwargs)
    # choice index = prompt index * n + candidate; greedy, so both candidates equal the single answer
    assert [c.text for c in reply.choices] == [france.choices[0].text] * 2 + [italy.choices[0].text] * 2
    assert reply.usage.prompt_tokens == france.usage.prompt_tokens + italy.usage.prompt_tokens
    assert reply.usage.completion_tokens == 4 * 6
    streamed = list(openai_client.completions.create(prompt=[FRANCE, ITALY], stream=True,
                                                     stream_options={"include_usage": True}, **kwargs))
    texts: dict[int, str] = {}
    for chunk in streamed[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: france.choices[0].text, 1: italy.choices[0].text}
    assert streamed[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert streamed[-1].usage.completion_tokens == 2 * 6


def test_echo_prepends_the_prompt(openai_client):
    reply = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, echo=True)
    plain = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0)
    assert reply.choices[0].text == FRANCE + plain.choices[0].text


def test_vllm_bench_style_request(openai_client):
    """What `vllm bench serve --backend openai` posts: ignore_eos, min_tokens, logprobs null, a usage chunk."""
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt="Lorem ipsum dolor sit amet " * 8, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=None,
        extra_body={"ignore_eos": True, "min_tokens": 24, "repetition_penalty": 1.0}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert chunks[-1].usage.completion_tokens == 24


@pytest.mark.parametrize(("kwargs", "code", "param"), [
    ({"temperature": -1}, "invalid_request", "temperature"),
    ({"suffix": "and so on"}, "unsupported_field", "suffix"),
    ({"echo": True, "logprobs": 1}, "unsupported_field", "echo"),
    ({"prompt": [1, -2, 3]}, "invalid_request", "prompt[1]"),
    ({"logprobs": 6}, "invalid_request", "logprobs"),
    ({"extra_body": {"messages": []}}, "unsupported_field", "messages"),
    ({"max_tokens": 10**6}, "context_exceeded", "max_tokens"),
])
def test_bad_request_error_carries_code_and_param(openai_client, kwargs, code, param):
    request = {"model": MODEL, "prompt": FRANCE, "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(**request)
    assert info.value.code == code and info.value.param == param


def test_unknown_model_is_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.completions.create(model="nope/nothing", prompt=FRANCE, max_tokens=5)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_schema_fuzz_no_5xx_and_enveloped_4xx(stub):
    """schemathesis on the served OpenAPI operation (stub model behind a real tritonserver, token auth)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from tests.e2e.conftest import STUB, TOKEN

    op = schemathesis.openapi.from_url(stub.url + "/openapi.json")["/v1/completions"]["POST"]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def run(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = STUB  # past validation, the request reaches a real (stub) model
            for key in ("n", "best_of"):  # the stub model always answers with one choice
                case.body.pop(key, None)
        case.headers = {}  # routing headers are fuzzed by the chat operation; here the body is the point
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert response.status_code < 500, response.text[:500]
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            code = response.headers["x-sie-error-code"]
            assert (code if isinstance(code, str) else code[0]) == error["code"]

    run()


def test_min_tokens_holds_back_a_stop_string(openai_client):
    """The contract's min_tokens: no stop condition fires before it, a stop string included (as vLLM)."""
    free = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=30, temperature=0, stop=["e"])
    assert free.usage.completion_tokens < 12  # an "e" comes early: the held-back case below means something
    held = openai_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=30, temperature=0, stop=["e"],
                                            extra_body={"min_tokens": 12})
    assert held.usage.completion_tokens >= 12
    assert held.choices[0].finish_reason == "stop" and not held.choices[0].text.endswith("e")


def test_a_completion_cut_inside_a_character_ends_the_same_streamed_and_blocking(openai_client):
    """Cut after the first byte token of an emoji, both modes return U+FFFD, as OpenAI does."""
    from transformers import AutoTokenizer

    from tests.unit.conftest import MODEL_DIR

    first_byte = AutoTokenizer.from_pretrained(MODEL_DIR).encode("😀", add_special_tokens=False)[0]
    kwargs = dict(model=MODEL, prompt=FRANCE, max_tokens=1, temperature=0, logit_bias={str(first_byte): 100})
    blocking = openai_client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert blocking.choices[0].text == streamed == "\ufffd"
    assert blocking.choices[0].finish_reason == "length"


def test_token_id_prompts_continue_as_their_text_does(openai_client, stack):
    """The token-id forms (lm-eval-harness sends them): ids from /tokenize continue exactly as the text does."""
    import httpx

    ids = [httpx.post(f"{stack.base_url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()["tokens"]
           for text in (FRANCE, ITALY)]
    by_text = openai_client.completions.create(model=MODEL, prompt=[FRANCE, ITALY], max_tokens=6, temperature=0)
    by_ids = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert "Paris" in by_ids.choices[0].text and "Rome" in by_ids.choices[1].text
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    one = openai_client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.completions.create(model=MODEL, prompt=[ids[0][0], 10**9], max_tokens=2)
    assert refused.value.body["param"] == "prompt[1]" and "vocabulary" in refused.value.body["message"]


def test_a_model_that_declares_no_token_id_input_answers_400(stub):
    """A model repository older than token-id prompts (the stub model declares no `prompt_token_ids`): Triton refuses
    the input, and the client gets a 400 naming `prompt`, not a 500."""
    import httpx

    from tests.e2e.conftest import STUB

    resp = httpx.post(stub.url + "/v1/completions", json={"model": STUB, "prompt": [1, 2, 3], "max_tokens": 2},
                      headers=stub.headers, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_field", "prompt") and "token ids" in error["message"]
    assert resp.headers["x-sie-error-code"] == "unsupported_field"
