"""/v1/chat/completions through the official openai SDK against the real stack."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL, SIE_MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_blocking_answer_mentions_paris(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_sie_safe_model_id_is_accepted_and_canonical_id_returned(openai_client):
    reply = openai_client.chat.completions.create(model=SIE_MODEL, messages=QUESTION, max_tokens=5, temperature=0)
    assert reply.model == MODEL


def test_streamed_text_equals_blocking_text_at_temperature_zero(openai_client):
    blocking = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == blocking.choices[0].message.content
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [blocking.choices[0].finish_reason]


def test_n2_streaming_one_finish_reason_per_index_and_usage(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, n=2, temperature=0.9, seed=3, stream=True,
        stream_options={"include_usage": True}))
    finishes: dict[int, list[str]] = {0: [], 1: []}
    roles: dict[int, int] = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
            if choice.delta.role:
                roles[choice.index] += 1
    assert {i: len(f) for i, f in finishes.items()} == {0: 1, 1: 1}
    assert roles == {0: 1, 1: 1}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0


def test_n3_blocking_returns_three_choices_and_sums_usage(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=3, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    # 3 choices x 6 tokens, unless one stopped early; the prompt is counted once
    stopped_early = any(c.finish_reason == "stop" for c in reply.choices)
    assert reply.usage.completion_tokens == 18 or (stopped_early and reply.usage.completion_tokens < 18)
    single = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens


def test_logprobs_shape(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert isinstance(entry.bytes, list)
    # greedy: the chosen token is the most likely one
    assert content[0].token == content[0].top_logprobs[0].token


def test_seed_reproducibility(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, seed=1234)
    first = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    second = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == second


def test_stop_string_is_trimmed(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, stop=["Paris"])
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_bad_request_error_carries_code_and_param(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=-1)
    assert info.value.code == "invalid_request"
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"store": True})
    assert info.value.code == "unsupported_field" and info.value.param == "store"


def test_unknown_model_is_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="nope/nothing", messages=QUESTION, max_tokens=5)
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


def test_models_list(openai_client):
    ids = [m.id for m in openai_client.models.list()]
    assert MODEL in ids


def test_128_candidates_of_a_long_prompt_share_its_blocks_and_all_run(openai_client):
    """128 copies of a 700-token prompt would take 89,600 positions, past SmolLM2's 81,920-position KV memory; the
    candidates share the prompt's blocks (each copies only a partly filled last one), so all 128 run, as on vLLM
    (docs/kv-memory.md)."""
    long_prompt = [{"role": "user", "content": "Summarise this: " + "the quick brown fox jumps. " * 120}]
    reply = openai_client.chat.completions.create(model=MODEL, messages=long_prompt, n=128, max_tokens=4)
    assert sorted(c.index for c in reply.choices) == list(range(128))
    assert reply.usage.prompt_tokens > 600 and 128 <= reply.usage.completion_tokens <= 128 * 4
    # and the engine goes on
    again = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert again.choices[0].message.content


def test_models_retrieve_by_canonical_and_safe_id(openai_client):
    assert openai_client.models.retrieve(MODEL).id == MODEL
    assert openai_client.models.retrieve(SIE_MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope/nothing")


def test_a_repeated_history_is_served_from_the_prefix_cache(openai_client):
    history = [{"role": "system", "content": "You answer in one short sentence. " * 8},
               {"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "Mars."}]
    first = openai_client.chat.completions.create(
        model=MODEL, messages=[*history, {"role": "user", "content": "Another?"}], max_tokens=4, temperature=0)
    second = openai_client.chat.completions.create(
        model=MODEL, messages=[*history, {"role": "user", "content": "A moon?"}], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 64 <= cached < second.usage.prompt_tokens  # whole 16-token blocks of the shared history
