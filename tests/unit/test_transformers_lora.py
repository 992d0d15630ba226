"""LoRA adapters on the transformers model path, on the real Gemma 3 270M, against peft itself.

A small random LoRA (nonzero B, every projection) is built with peft at setup; the reference is peft's own forward
with that adapter active (whole sequence, no cache). Ours: the engine loaded with `lora_paths` like any profile, its
adapter rows chosen per packed token in prefill chunks, batched prefill and decode steps, beside rows on no adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from engine.errors import EngineError  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402

from .engine_run import Run, greedy  # noqa: E402

CACHE = Path(os.environ.get("SIE_MODEL_CACHE") or Path(__file__).resolve().parents[2] / ".cache" / "models")
GEMMA_DIR = CACHE / "gemma-3-270m"
SMOLLM2_DIR, PIRATE_DIR = CACHE / "SmolLM2-135M-Instruct", CACHE / "smollm2-lora-pirate"
TOLERANCE = 2e-3  # fp32 logits are O(30), as in test_transformers_decoder.py
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village, there lived",
           "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(adapter folder, {prompt index: (ids, peft logits with the adapter, base logits)})."""
    if not (GEMMA_DIR / "config.json").exists():
        pytest.skip(f"Gemma 3 not prepared at {GEMMA_DIR} (run `make model`)")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(GEMMA_DIR)
    base = AutoModelForCausalLM.from_pretrained(GEMMA_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    # init_lora_weights=False: B random like A (peft's default zero B would make the adapter a no-op)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)  # a visible change, not a broken model
    peft_model.eval()
    refs = {}
    with torch.inference_mode():
        for i, text in enumerate(PROMPTS):
            ids = tokenizer(" ".join([text] * 10)).input_ids[:40 - 7 * i]
            assert len(ids) == 40 - 7 * i
            with peft_model.disable_adapter():
                plain = peft_model(torch.tensor([ids])).logits[0].float()
            refs[i] = (ids, peft_model(torch.tensor([ids])).logits[0].float(), plain)
    folder = tmp_path_factory.mktemp("gemma-lora") / "tiny"
    peft_model.save_pretrained(folder)
    del peft_model, base
    return folder, refs


@pytest.fixture(scope="module")
def engine(lora):
    folder, _ = lora
    # the profile's `lora_paths`, on the path `auto` picks for Gemma; never started: the tests step it themselves
    eng = LLMEngine(EngineConfig(str(GEMMA_DIR), max_slots=4, max_len=128, threads=2, prefix_cache_tokens=0,
                                 lora_paths={"tiny": str(folder)}))
    assert type(eng.runner.decoder).__name__ == "TransformersDecoder"
    return eng


def runner(engine, slots: int = 4):
    from engine.runner.model_runner import ModelRunner

    return ModelRunner(engine.runner.decoder, slots, 128, engine.runner.adapters)


def _close(ours, theirs):
    assert (ours - theirs).abs().max().item() < TOLERANCE


def test_adapter_logits_equal_peft_at_every_position(lora, engine):
    _, refs = lora
    ids, ref, plain = refs[0]
    assert (ref - plain).abs().max().item() > 0.5  # the adapter really changes the model
    r = runner(engine)
    _close(r.prefill(0, ids[:12], 0, adapter="tiny"), ref[11])
    for t in range(12, 24):  # chunked prefill over a cached prefix, one position a chunk
        _close(r.prefill(0, ids[t:t + 1], t, adapter="tiny"), ref[t])
    for t in range(24, len(ids)):
        _close(r.decode([ids[t]], [t], ["tiny"])[0], ref[t])
    _close(r.prefill(1, ids[:20], 0), plain[19])  # the same model without the adapter is the base model


def test_a_mixed_batch_gives_each_row_its_own_logits(lora, engine):
    _, refs = lora
    rows = [("tiny", refs[0]), (None, refs[1]), ("tiny", refs[2])]
    r = runner(engine)
    starts = [len(ids) - 6 for _, (ids, _, _) in rows]  # prompts of different lengths
    logits = r.prefill_batch([0, 1, 2], [ids[:s] for (_, (ids, _, _)), s in zip(rows, starts, strict=True)],
                             [a for a, _ in rows])
    for row, ((adapter, (_, ref, plain)), s) in enumerate(zip(rows, starts, strict=True)):
        _close(logits[row], (ref if adapter else plain)[s - 1])
    for k in range(6):  # decode steps, rows at different positions, on the adapter, none, the adapter
        step = r.decode([ids[s + k] for (_, (ids, _, _)), s in zip(rows, starts, strict=True)],
                        [s + k for s in starts], [a for a, _ in rows])
        for row, ((adapter, (_, ref, plain)), s) in enumerate(zip(rows, starts, strict=True)):
            _close(step[row], (ref if adapter else plain)[s + k])


def _scheduler(engine):
    from engine.core.engine_core import EngineCore

    return EngineCore(runner(engine), engine.sampler, engine.tokenizer)


def test_a_mixed_batch_gives_each_request_the_tokens_it_gets_alone(engine):
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    adapters = ["tiny", None, "tiny"]
    alone = []
    for prompt, adapter in zip(prompts, adapters, strict=True):
        run = Run(_scheduler(engine))
        run.add("r", prompt, greedy(12, ignore_eos=True, lora_adapter=adapter))
        run.until_done()
        alone.append(run.ids("r"))
    mixed = Run(_scheduler(engine))
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        mixed.add(f"r{i}", prompt, greedy(12, ignore_eos=True, lora_adapter=adapter))
    mixed.until_done()
    assert [mixed.ids(f"r{i}") for i in range(3)] == alone
    plain = Run(_scheduler(engine))
    plain.add("r", prompts[0], greedy(12, ignore_eos=True))
    plain.until_done()
    assert plain.ids("r") != alone[0], engine.tokenizer.decode(alone[0])  # the adapter changed the tokens


def test_an_unknown_adapter_name_is_the_contract_error(engine):
    run = Run(_scheduler(engine))
    with pytest.raises(EngineError) as err:
        run.add("r", [2, 100, 200], greedy(4, lora_adapter="nope"))
    assert (err.value.code, err.value.param) == ("unknown_lora_adapter", "lora_adapter")


def _bad_copy(folder: Path, out: Path, case: str) -> Path:
    shutil.copytree(folder, out)
    config = json.loads((out / "adapter_config.json").read_text())
    if case == "target modules it lacks":
        config["target_modules"] = ["c_attn"]
    elif case == "other shapes":
        config["r"] = 8  # the saved A/B are rank 4
    elif case == "weights for layers it lacks":
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "adapter_model.safetensors")
        key = next(k for k in tensors if ".layers.0.self_attn.q_proj.lora_A" in k)
        tensors[key.replace(".layers.0.", ".layers.40.")] = tensors[key].clone()
        save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case", ["target modules it lacks", "other shapes", "weights for layers it lacks"])
def test_an_adapter_that_does_not_fit_is_refused_at_load_naming_it(lora, tmp_path, case):
    bad = _bad_copy(lora[0], tmp_path / "bad", case)
    with pytest.raises(ValueError, match=r"LoRA adapter 'broken' \(.*bad\) cannot be served on this model"):
        LLMEngine(EngineConfig(str(GEMMA_DIR), max_slots=1, max_len=64, threads=2,
                               lora_paths={"broken": str(bad)}))


def test_smollm2_pirate_adapter_on_the_transformers_path_equals_the_fused_path():
    """The demo adapter with SmolLM2 forced onto the transformers path (`model_impl=transformers`): the same
    adapter logits and greedy tokens as the fused forward's LoRA."""
    if not (PIRATE_DIR / ".complete").exists():
        pytest.skip(f"demo adapter not built at {PIRATE_DIR} (run `make model`)")
    engines = {impl: LLMEngine(EngineConfig(str(SMOLLM2_DIR), max_slots=2, max_len=128, threads=2,
                                            prefix_cache_tokens=0, model_impl=impl,
                                            lora_paths={"pirate": str(PIRATE_DIR)}))
               for impl in ("fused", "transformers")}
    assert type(engines["transformers"].runner.decoder).__name__ == "TransformersDecoder"
    prompt = engines["fused"].encode_prompt(messages=[{"role": "user", "content": "What is the capital of Italy?"}])
    first = [runner(e).prefill(0, prompt, 0, adapter="pirate") for e in engines.values()]
    _close(first[0], first[1])
    tokens = {}
    for impl, eng in engines.items():
        run = Run(_scheduler(eng))
        run.add("p", prompt, greedy(20, ignore_eos=True, lora_adapter="pirate"))
        run.until_done()
        tokens[impl] = run.ids("p")
    assert tokens["transformers"] == tokens["fused"]
    assert "arr" in engines["fused"].tokenizer.decode(tokens["fused"]).lower()  # the pirate adapter is on
