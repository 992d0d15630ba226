"""Greedy tokens equal HF `generate` in fp32, for every tiny architecture the tests build (tests/tiny_architectures.py).

Each model runs through LLMEngine as served: three prompts batched together (prefill chunks of 16 tokens, so later
chunks attend to the cache; decode rows at different positions), every one against HF `generate` on the same
folder. Where `auto` picks the fused forward, the transformers path is proven too. The refused ones fail at load,
naming the feature.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model.support import UnsupportedModel  # noqa: E402
from tests.tiny_architectures import (  # noqa: E402
    REFUSED,
    SERVED,
    TOKENIZER_DIR,
    Arch,
    ensure_tiny_model,
    hf_greedy,
    trimmed,
)

from .engine_run import Run, greedy  # noqa: E402

PROMPTS = ["The capital of France is",
           "Once upon a time, in a village far away at the edge of a forest, there lived an old clockmaker who",
           "def fibonacci(n):"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 tokenizer is not prepared at {TOKENIZER_DIR} (run `make model`)")
    return tmp_path_factory.mktemp("tiny-architectures")


def engine_greedy(path, impl: str) -> tuple[str, list[list[int]]]:
    engine = LLMEngine(EngineConfig(str(path), max_slots=4, max_len=160, max_num_batched_tokens=16, threads=2,
                                    prefix_cache_tokens=0, model_impl=impl))
    run = Run(engine.core)
    for i, prompt in enumerate(PROMPTS):
        run.add(f"r{i}", engine.encode_prompt(prompt), greedy(NEW_TOKENS))
    run.until_done()
    return type(engine.runner.decoder).__name__, [trimmed(run.ids(f"r{i}")) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", SERVED, ids=[a.name for a in SERVED])
def test_greedy_tokens_equal_hf_generate(models, arch: Arch):
    path = ensure_tiny_model(arch, models)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    assert all(len(ids) > 4 for ids in expected)  # a model that ends at once would prove little
    kind, ours = engine_greedy(path, "auto")
    assert ours == expected, f"{arch.name} on {kind}"
    if kind == "Decoder":  # auto chose the fused forward: the transformers path must be exact here too
        kind, ours = engine_greedy(path, "transformers")
        assert kind == "TransformersDecoder" and ours == expected


@pytest.mark.parametrize("arch", REFUSED, ids=[a.name for a in REFUSED])
def test_unservable_models_are_refused_at_load_naming_the_feature(models, arch: Arch):
    path = ensure_tiny_model(arch, models)
    with pytest.raises(UnsupportedModel, match=arch.refused):
        LLMEngine(EngineConfig(str(path), max_slots=2, max_len=64, threads=2))
