"""The KV cache is shaped by the attention a model runs, not by config fields its architecture ignores.

GPT-2 and GPT-NeoX give every head its own keys whatever `num_key_value_heads` a config.json carries (a converted or
hand-edited folder may carry one). A cache sized from that field cannot take the keys the model writes, so such a
folder failed to load; it must load and generate exactly what the same folder without the field does.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")

from engine.llm_engine import EngineConfig, LLMEngine
from tests.tiny_architectures import ARCHITECTURES, TOKENIZER_DIR, Arch, ensure_tiny_model, trimmed

from .engine_run import Run, greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 12
EVERY_HEAD_OWN_KEYS = [a for a in ARCHITECTURES if a.name in ("gpt_neox", "gpt2")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 tokenizer is not prepared at {TOKENIZER_DIR} (run `make model`)")
    return tmp_path_factory.mktemp("kv-shape")


def _greedy(path) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(str(path), max_slots=2, max_len=64, max_num_batched_tokens=16, threads=2,
                                    prefix_cache_tokens=0))
    run = Run(engine.core)
    for i, prompt in enumerate(PROMPTS):
        run.add(f"r{i}", engine.encode_prompt(prompt), greedy(NEW_TOKENS))
    run.until_done()
    return [trimmed(run.ids(f"r{i}")) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", EVERY_HEAD_OWN_KEYS, ids=[a.name for a in EVERY_HEAD_OWN_KEYS])
def test_an_ignored_num_key_value_heads_changes_nothing(models, arch: Arch):
    plain = ensure_tiny_model(arch, models)
    edited = models / f"{arch.name}-num_key_value_heads"
    shutil.copytree(plain, edited)
    config = json.loads((edited / "config.json").read_text())
    heads = config.get("num_attention_heads") or config["n_head"]
    config["num_key_value_heads"] = heads // 2  # what a GQA model of this shape would have; these models ignore it
    (edited / "config.json").write_text(json.dumps(config, indent=2))

    expected = _greedy(plain)
    assert all(len(ids) > 2 for ids in expected)  # a model that ends at once would prove little
    assert _greedy(edited) == expected
