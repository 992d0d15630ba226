"""Every tensor a step builds is made on the forward's device (on a GPU a host tensor is a copy and a sync).

CPU CI has no second device, so the steps run under `ImplicitDeviceFactories` (tests/unit/device_check.py):
any engine factory call (torch.tensor/zeros/arange/rand...) without an explicit `device=` is reported, since on
a GPU it would land on the host. The requests cover every path of a step: batched and single (chunked)
prefill, n > 1 forks, decode, slot compaction on retire, every sampler feature, grammar, LoRA rows, and the
one-by-one fallbacks after a failed batched prefill/decode.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from engine.core.sequence import Sequence
from engine.sampling_params import GrammarRequest, SamplingParams

from .conftest import MODEL_DIR
from .device_check import ENGINE_DIR, HostReads, ImplicitDeviceFactories
from .engine_run import PROMPTS, Run, greedy

ADAPTER_DIR = MODEL_DIR.parent / "smollm2-lora-pirate"


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def adapters(real_engine):
    if not (ADAPTER_DIR / ".complete").exists():
        pytest.skip(f"demo adapter not built at {ADAPTER_DIR} (run `make model`)")
    from engine.model.lora import load_adapters

    table = load_adapters(real_engine.model, {"pirate": str(ADAPTER_DIR)})
    table["doomed"] = table["pirate"]  # removed mid-run to make a batched step fail
    return table


def _scheduler(real_engine, adapters, slots: int = 8, max_num_batched_tokens: int = 512):
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(real_engine.runner.decoder, slots, 256, dict(adapters))
    return EngineCore(runner, real_engine.sampler, real_engine.tokenizer, max_num_batched_tokens, check_invariants=True)


def _every_feature(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed, max_tokens=6, logprobs=True,
                          top_logprobs=3, logit_bias={28: -100.0, 30: 2.0}, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=3, stop_token_ids=[13])


def _run_all_paths(real_engine, adapters, prompts) -> Run:
    run = Run(_scheduler(real_engine, adapters))
    regex = real_engine.grammar_factory(SamplingParams(grammar=GrammarRequest(kind="regex", value="[a-z ]+")))
    # one batched prefill: plain greedy + logprobs, every sampler feature (n=2 forks a slot), LoRA, grammar
    run.add("greedy", prompts[0], greedy(4, logprobs=True, top_logprobs=2, ignore_eos=True))
    run.add("features", prompts[1], dataclasses.replace(_every_feature(7), n=2))
    run.add("lora", prompts[2], greedy(5, lora_adapter="pirate", ignore_eos=True))
    run.add("grammar", prompts[3], SamplingParams(temperature=1.0, seed=3, max_tokens=5), grammar=regex)
    run.step()
    # a long prompt prefilled in chunks (the single-prompt path) while the others decode
    run.sched.scheduler.token_budget = 16
    run.add("chunked", prompts[0] + prompts[1], _every_feature(11))
    for _ in range(3):
        run.step()
    run.sched.scheduler.token_budget = 512
    # a batched decode that fails (its adapter is gone): rows are retried one by one
    run.add("doomed", prompts[1], greedy(8, lora_adapter="doomed", ignore_eos=True))
    run.add("batched2", prompts[2], greedy(3, ignore_eos=True))
    run.step()
    del run.sched.runner.adapters["doomed"]
    run.step()
    # a batched prefill that fails: prompts are prefilled one by one
    run.sched.runner.adapters["doomed"] = adapters["doomed"]
    run.add("doomed2", prompts[0], greedy(3, lora_adapter="doomed"))
    run.add("alone-ok", prompts[3], _every_feature(5))
    del run.sched.runner.adapters["doomed"]
    run.until_done()
    return run


def test_no_step_builds_a_tensor_off_the_forwards_device(real_engine, adapters, prompts):
    with ImplicitDeviceFactories() as check:
        run = _run_all_paths(real_engine, adapters, prompts)
    # the run really went through every path (so an empty report means something)
    finals = {rid: run.final(rid) for rid in run.outputs}
    assert finals["doomed"].error is not None and finals["doomed2"].error is not None
    for rid in ("greedy", "features", "lora", "grammar", "chunked", "batched2", "alone-ok"):
        assert finals[rid].error is None, (rid, finals[rid].error)
    assert len([o for o in run.finals("features")]) == 1 and ("features", 1) in run.tokens
    assert finals["greedy"].completion_tokens == 4 and finals["lora"].completion_tokens == 5
    assert check.found == [], "tensors built without device= (they land on the host on a GPU):\n" + "\n".join(
        sorted(set(check.found)))


_PLANTED = """
def prompt_mask(self, vocab, device="cpu"):
    mask = torch.zeros(vocab, dtype=torch.bool)  # implicit: on a GPU this is a host tensor
    mask[self.prompt_ids] = True
    return mask.to(device)
"""


def test_the_check_catches_an_implicit_factory_in_engine_code(real_engine, adapters, prompts, monkeypatch):
    # the same code with an engine file name is reported; from a test file (library-like) it is not
    with ImplicitDeviceFactories() as check:
        exec(compile("torch.arange(3)\ntorch.arange(3, device='cpu')", str(ENGINE_DIR / "planted.py"), "exec"),
             {"torch": torch})
        torch.arange(3)
    assert check.found == ["engine/planted.py:1 torch.arange"]

    # planted in a real step path (the repetition penalty's prompt mask): the full run reports it, with its place
    scope: dict = {"torch": torch}
    exec(compile(_PLANTED, str(ENGINE_DIR / "core" / "sequence.py"), "exec"), scope)
    monkeypatch.setattr(Sequence, "prompt_mask", scope["prompt_mask"])
    with ImplicitDeviceFactories() as check:
        _run_all_paths(real_engine, adapters, prompts)
    assert check.found and set(check.found) == {"engine/core/sequence.py:3 torch.zeros"}


def test_a_decode_step_reads_the_device_once(real_engine, adapters, prompts):
    """Lever (b): only the sampled ids (with logprobs and top logprobs) cross to the host, in one read a step,
    with every feature on. On a GPU any other read (`.item()`, `.tolist()`, `bool(t)`) waits for the device."""
    run = Run(_scheduler(real_engine, adapters))
    regex = real_engine.grammar_factory(SamplingParams(grammar=GrammarRequest(kind="regex", value="[a-z ]+")))
    run.add("greedy", prompts[0], greedy(12, logprobs=True, top_logprobs=2, ignore_eos=True))
    run.add("features", prompts[1], dataclasses.replace(_every_feature(7), n=2, max_tokens=12, min_tokens=12))
    run.add("lora", prompts[2], greedy(12, lora_adapter="pirate", ignore_eos=True))
    run.add("grammar", prompts[3], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
            grammar=regex)
    run.step()  # the batched prefill
    run.step()  # the first decode step makes the penalty counts
    with HostReads() as check:
        for _ in range(3):
            run.step()
    assert len(run.sched.scheduler.running) == 5  # every row was still decoding
    assert len(check.reads) == 3, check.reads
    assert all(re.fullmatch(r"engine/sampling/sampler\.py:\d+ tolist", r) for r in check.reads), check.reads


def test_the_read_check_counts_device_results_only():
    code = "t = torch.ones(3)\nt.sum().item()\nbool(t.any())\ntorch.ones(1, device='cpu').item()\n"
    with HostReads() as check:
        exec(compile(code, str(ENGINE_DIR / "planted.py"), "exec"), {"torch": torch})
        torch.ones(2).tolist()  # not engine code
    assert check.reads == ["engine/planted.py:2 item", "engine/planted.py:3 __bool__"]
