"""LoRA in our forward against peft's merged model, and an adapter request alone vs in a mixed batch.

Uses the demo adapter built by `make model` (scripts/make_lora.py) through the production loader
(`engine.model.lora.load_adapters`).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import MODEL_DIR
from .engine_run import PROMPTS, Run, greedy

ADAPTER_DIR = MODEL_DIR.parent / "smollm2-lora-pirate"


@pytest.fixture(scope="module")
def lora_adapters(real_engine):
    if not (ADAPTER_DIR / ".complete").exists():
        pytest.skip(f"demo adapter not built at {ADAPTER_DIR} (run `make model`)")
    from engine.model.lora import load_adapters

    return load_adapters(real_engine.model, {"pirate": str(ADAPTER_DIR)})


@pytest.fixture(scope="module")
def merged_model():
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(ADAPTER_DIR)).merge_and_unload().eval()


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]


def lora_runner(real_engine, adapters, slots: int = 8):
    """A runner of its own over the session decoder (each slot owns its blocks: no scheduler hands them out)."""
    from engine.runner.model_runner import ModelRunner

    return ModelRunner(real_engine.runner.decoder, slots, 256, adapters)


def scheduler(real_engine, adapters, slots: int = 8):
    from engine.core.engine_core import EngineCore

    return EngineCore(lora_runner(real_engine, adapters, slots), real_engine.sampler, real_engine.tokenizer)


def test_adapter_logits_match_peft_merged_over_the_whole_prompt(real_engine, lora_adapters, merged_model, prompts):
    ids = prompts[0]
    with torch.inference_mode():
        ref = merged_model(input_ids=torch.tensor([ids])).logits[0].float()
    fwd = lora_runner(real_engine, lora_adapters, slots=1)
    # one chunk: the whole prompt on the adapter
    whole = fwd.prefill(0, ids, 0, adapter="pirate")
    torch.testing.assert_close(whole, ref[-1], atol=2e-4, rtol=2e-4)
    # token by token: every prompt position's logits
    for t in range(len(ids)):
        step = fwd.prefill(0, ids[t : t + 1], t, adapter="pirate")
        torch.testing.assert_close(step, ref[t], atol=2e-4, rtol=2e-4)
    # and the adapter really changes the model (the base logits differ from the merged ones)
    base = fwd.prefill(0, ids, 0)
    assert (base - ref[-1]).abs().max() > 1e-2


def test_adapter_request_same_tokens_alone_and_in_a_mixed_batch(real_engine, lora_adapters, prompts):
    alone = Run(scheduler(real_engine, lora_adapters))
    alone.add("p", prompts[1], greedy(16, ignore_eos=True, lora_adapter="pirate"))
    alone.until_done()
    base_alone = Run(scheduler(real_engine, lora_adapters))
    base_alone.add("b", prompts[2], greedy(16, ignore_eos=True))
    base_alone.until_done()

    mixed = Run(scheduler(real_engine, lora_adapters))
    mixed.add("b0", prompts[0], greedy(16, ignore_eos=True))
    mixed.add("p", prompts[1], greedy(16, ignore_eos=True, lora_adapter="pirate"))
    mixed.add("b", prompts[2], greedy(16, ignore_eos=True))
    mixed.add("b3", prompts[3], greedy(16, ignore_eos=True))
    mixed.until_done()
    assert mixed.ids("p") == alone.ids("p")
    assert mixed.ids("b") == base_alone.ids("b")


def test_adapter_rows_logits_are_the_same_bits_alone_and_in_a_mixed_batch(real_engine, lora_adapters, prompts):
    """With our CPU kernels every op of the forward is per row, the LoRA delta included (kernels/lora_add.cpp)."""
    from engine.model import cpu_kernels

    fwd = lora_runner(real_engine, lora_adapters, slots=4)
    decoder = fwd.decoder
    if not (cpu_kernels.available() and decoder.native_attention and decoder.ops.native):
        pytest.skip("our CPU kernels do not run this model here")
    adapters = ["pirate", None, "pirate", "pirate"]
    for slot, adapter in enumerate(adapters):
        fwd.prefill(slot, prompts[slot], 0, adapter=adapter)
    positions = [len(p) for p in prompts[:4]]
    batched = fwd.decode([28, 29, 30, 31], positions, adapters=adapters)
    alone = fwd.decode([28], positions[:1], adapters=adapters[:1])
    assert torch.equal(batched[0], alone[0])
    uniform = fwd.decode([28, 29], positions[:2], adapters=["pirate", "pirate"])  # every row on one adapter
    assert torch.equal(uniform[0], alone[0])
