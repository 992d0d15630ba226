"""The engine's guarantees on the transformers model path, on the real Gemma 3 270M through LLMEngine.

Same tokens alone and in a batch (greedy and seeded), a prefix-cache hit gives what a miss gives, grammars
obey, streaming equals blocking, a failing row fails only its request, cancellation frees the slot.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling_params import GrammarRequest, SamplingParams  # noqa: E402

from .engine_run import RaisingGrammar, generate_all, joined_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GEMMA_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "gemma-3-270m"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are"]


@pytest.fixture(scope="module")
def gemma_engine():
    if not (GEMMA_DIR / "config.json").exists():
        pytest.skip(f"Gemma 3 not prepared at {GEMMA_DIR} (run `make model`)")
    engine = LLMEngine(EngineConfig(str(GEMMA_DIR), max_slots=6, max_len=512, threads=2, prefix_cache_tokens=1024))
    assert type(engine.runner.decoder).__name__ == "TransformersDecoder"  # `auto` picks the generic path for Gemma
    engine.start()
    yield engine
    engine.stop()


def logprobs(outs) -> list[float]:
    """The chosen tokens' logprobs, to compare within float noise: a batch's GEMMs sum in another order than one
    row's (the tokens themselves must match exactly; rounding to a fixed decimal flipped near a boundary)."""
    return [e["logprob"] for o in outs for e in (o.logprobs or [])]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and a == pytest.approx(b, abs=1e-4)


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=10, ignore_eos=True, logprobs=True)


@pytest.mark.parametrize("make", [lambda: greedy(), lambda: seeded(7)], ids=["greedy", "seeded"])
def test_same_tokens_alone_and_batched(gemma_engine, make):
    (alone,) = generate_all(gemma_engine, PROMPTS[:1], [make()])
    batched = generate_all(gemma_engine, PROMPTS, [make(), greedy(6), seeded(3), greedy(14)])
    assert joined_text(batched[0]) == joined_text(alone) and close(logprobs(batched[0]), logprobs(alone))


def test_a_prefix_cache_hit_gives_the_same_tokens(gemma_engine):
    prompt = "A long shared preamble about the weather in the mountains, " * 4 + "and so"
    (first,) = generate_all(gemma_engine, [prompt], [greedy(8)])
    (second,) = generate_all(gemma_engine, [prompt], [greedy(8)])
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens >= 16
    assert joined_text(second) == joined_text(first) and close(logprobs(second), logprobs(first))


def test_streaming_equals_blocking(gemma_engine):
    (streamed,) = generate_all(gemma_engine, PROMPTS[1:2], [greedy(12)], stream=True)
    (blocking,) = generate_all(gemma_engine, PROMPTS[1:2], [greedy(12)], stream=False)
    assert len([o for o in streamed if o.text]) > 1
    assert joined_text(streamed) == joined_text(blocking)


@pytest.mark.parametrize("grammar, check", [
    (GrammarRequest("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                    "additionalProperties": False}),
     lambda s: set(json.loads(s)) == {"n"}),
    (GrammarRequest("regex", r"(red|green|blue)-[0-9]{3}"),
     lambda s: s.split("-")[0] in ("red", "green", "blue") and len(s.split("-")[1]) == 3),
], ids=["json_schema", "regex"])
def test_grammars_are_obeyed(gemma_engine, grammar, check):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=40, grammar=grammar)
    (outs,) = generate_all(gemma_engine, PROMPTS[3:4], [params])
    assert outs[-1].finish_reason == "stop" and check(joined_text(outs))


def test_a_failing_row_fails_only_its_request(gemma_engine):
    (reference,) = generate_all(gemma_engine, PROMPTS[:1], [greedy(8)])
    bad, good = queue.Queue(), queue.Queue()
    gemma_engine.submit(EngineRequest("bad", gemma_engine.encode_prompt(PROMPTS[2]), greedy(8), bad.put, False,
                                      grammar=lambda: RaisingGrammar(fail_at=3)))
    gemma_engine.submit(EngineRequest("good", gemma_engine.encode_prompt(PROMPTS[0]), greedy(8), good.put, False))
    failed = drain(bad)[-1]
    assert failed.error is not None and failed.error.code == "inference_error"
    served = drain(good)
    assert joined_text(served) == joined_text(reference) and close(logprobs(served), logprobs(reference))


def drain(q: queue.Queue) -> list:
    outs = []
    while not (outs and outs[-1].final):
        outs.append(q.get(timeout=300))
    return outs


def test_cancellation_frees_the_slot(gemma_engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    (outs,) = generate_all(gemma_engine, PROMPTS[:1], [params], stream=True, cancel_after=2)
    assert outs[-1].final and outs[-1].completion_tokens < 200
    sched = gemma_engine.core.scheduler
    for _ in range(100):
        if not sched.has_work():
            break
        threading.Event().wait(0.05)
    assert not sched.has_work() and sched.kv.pool.used == 0
