"""Run-time LoRA in the engine (engine/lora_runtime.py): load, use, unload, the refusals and the max_loras bound.

Adapters are built here with peft on the real SmolLM2 (random, nonzero B, so they change the output); a foreign one on
a tiny random Llama with other shapes. Each path (fused, transformers) runs its own started engine.
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine.errors import EngineError

from .conftest import MODEL_DIR, _require_model
from .engine_run import PROMPTS, greedy

pytest.importorskip("peft")


def _save_lora(model, out, seed: int, r: int = 4) -> str:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    peft_model.unload()
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{kind: folder}: two good adapters, a DoRA one, one over the rank limit, one for another base model, and a
    folder that is no adapter."""
    _require_model()
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("loras")
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    folders = {"a": _save_lora(base, root / "a", 1), "b": _save_lora(base, root / "b", 2),
               "c": _save_lora(base, root / "c", 3)}
    for kind, edit in (("dora", {"use_dora": True}), ("big", {"r": 128})):
        shutil.copytree(folders["a"], root / kind)
        config = json.loads((root / kind / "adapter_config.json").read_text())
        (root / kind / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        folders[kind] = str(root / kind)
    tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    folders["foreign"] = _save_lora(tiny, root / "foreign", 4)
    (root / "empty").mkdir()
    folders["empty"] = str(root / "empty")
    return folders


def _engine(impl: str, lora_paths: dict[str, str] | None = None):
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=4, max_len=256, threads=2, model_impl=impl,
                                    lora_paths=lora_paths, max_loras=2, max_lora_rank=16))
    engine.start()
    return engine


@pytest.fixture(scope="module", params=["fused", "transformers"])
def engine(request):
    _require_model()
    eng = _engine(request.param)
    yield eng
    eng.stop()


def _text(engine, adapter: str | None, tokens: int = 12, rid: str = "r") -> str:
    ids = engine.encode_prompt(messages=[{"role": "user", "content": PROMPTS[0]}])
    out = engine.generate(rid, ids, greedy(tokens, ignore_eos=True, lora_adapter=adapter))
    text = ""
    while True:
        item = out.get(timeout=120)
        if item.error is not None:
            raise item.error
        text += item.text
        if item.final:
            return text


def _refused(call, code: str, param: str) -> str:
    with pytest.raises(EngineError) as info:
        call()
    assert (info.value.code, info.value.param) == (code, param), info.value
    return str(info.value)


def test_loaded_adapter_changes_output_like_one_loaded_at_start_then_unloads(engine, adapters):
    base = _text(engine, None)
    assert engine.lora.load("a", adapters["a"]) == ["a"]
    on_a = _text(engine, "a")
    assert on_a != base
    at_start = _engine("fused" if engine.lora.fused else "transformers", {"a": adapters["a"]})
    try:
        assert _text(at_start, "a") == on_a
    finally:
        at_start.stop()
    assert engine.lora.unload("a") == []
    _refused(lambda: _text(engine, "a"), "unknown_lora_adapter", "lora_adapter")
    assert _text(engine, None) == base
    # the same name again, other weights: its own output, no prefix-cache blocks of the old ones
    engine.lora.load("a", adapters["b"])
    on_b = _text(engine, "a")
    assert on_b != on_a
    engine.lora.unload("a")


def test_bad_loads_are_400s_naming_the_field(engine, adapters, tmp_path):
    for path, words in ((str(tmp_path / "missing"), "no adapter folder"), ("", "required"),
                        (adapters["empty"], "not a LoRA adapter"), (adapters["dora"], "DoRA"),
                        (adapters["big"], "max_lora_rank 16"), (adapters["foreign"], "another base model")):
        assert words in _refused(lambda p=path: engine.lora.load("x", p), "invalid_request", "lora_path")
    assert engine.lora.names() == []
    engine.lora.load("a", adapters["a"])
    try:
        assert "already been loaded" in _refused(lambda: engine.lora.load("a", adapters["b"]), "invalid_request",
                                                 "lora_name")
        _refused(lambda: engine.lora.unload("nope"), "unknown_lora_adapter", "lora_name")
        assert _text(engine, "a")  # the engine serves on after every refusal
    finally:
        engine.lora.unload("a")


def test_max_loras_refuses_a_load_until_one_is_unloaded(engine, adapters):
    engine.lora.load("a", adapters["a"])
    engine.lora.load("b", adapters["b"])
    _refused(lambda: engine.lora.load("c", adapters["c"]), "lora_capacity_exceeded", "lora_name")
    engine.lora.unload("b")
    assert engine.lora.load("c", adapters["c"]) == ["a", "c"]
    engine.lora.unload("a")
    engine.lora.unload("c")


def test_unload_refused_while_a_request_uses_it(engine, adapters):
    engine.lora.load("a", adapters["a"])
    ids = engine.encode_prompt(messages=[{"role": "user", "content": PROMPTS[1]}])
    out = engine.generate("long", ids, greedy(48, ignore_eos=True, lora_adapter="a"))
    first = out.get(timeout=120)
    assert first.error is None
    info = engine.lora_requests_info()
    assert info["max_lora"] == "2" and "a" in info["running_lora_adapters"] + info["waiting_lora_adapters"]
    _refused(lambda: engine.lora.unload("a"), "lora_adapter_in_use", "lora_name")
    while not first.final:
        first = out.get(timeout=300)
    assert first.error is None
    assert engine.lora.unload("a") == []
    assert engine.lora_requests_info()["running_lora_adapters"] == ""
