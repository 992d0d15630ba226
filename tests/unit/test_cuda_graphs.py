"""Bucketed, padded decode steps (engine.runner.cuda_graphs) give the plain decode's logits and leave other slots alone.

On the CPU the runner goes through the same static buffers, batch/span buckets and padded rows as on a GPU,
only without capturing (capture=False); the graph capture itself is checked on the device (bench/gpu.py).
"""

from __future__ import annotations

import torch

from engine.runner.cuda_graphs import DecodeGraphs, buckets
from engine.runner.model_runner import ModelRunner

from .engine_run import PROMPTS, Run, greedy

MAX_LEN = 256


def _runner(real_engine, slots: int = 8, graphs: bool = False) -> ModelRunner:
    runner = ModelRunner(real_engine.runner.decoder, slots, MAX_LEN, cuda_graphs=graphs, capture=False)
    runner.cache.k.zero_()
    runner.cache.v.zero_()
    return runner


def test_buckets_cover_every_size_up_to_the_limit():
    assert buckets((1, 2, 4, 8, 16), 6) == [1, 2, 4, 6]
    runner_sizes = buckets((64, 128, 256), 256)
    assert runner_sizes == [64, 128, 256]


def test_the_graphs_run_a_callable_padded_into_one_shared_output():
    """DecodeGraphs knows no model: it pads the live rows to the batch bucket (token 0 at max_len - 1), rounds
    the span up to its bucket, and every bucket writes the same output buffer, of which the live rows return."""
    calls = []

    def step(tokens, positions, span):
        calls.append((tokens.tolist(), positions.tolist(), span))
        return torch.stack([tokens, positions], dim=1).float()

    graphs = DecodeGraphs(step, max_batch=8, max_len=256, width=2, dtype=torch.float32,
                          device=torch.device("cpu"), capture=False)
    out = graphs.run([7, 8, 9], [3, 70, 5])
    assert calls == [([7, 8, 9, 0], [3, 70, 5, 255], 128)]
    assert out.tolist() == [[7, 3], [8, 70], [9, 5]]
    again = graphs.run([4], [1])
    assert calls[-1] == ([4], [1], 64) and again.data_ptr() == out.data_ptr() == graphs.output.data_ptr()
    assert graphs.run([1], [256]) is None  # past the last span bucket: the caller runs it eagerly


@torch.inference_mode()
def test_padded_bucketed_decode_matches_plain_decode_and_spares_the_prefilling_slot(real_engine):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    plain, graphed = _runner(real_engine), _runner(real_engine, graphs=True)
    for runner in (plain, graphed):
        for slot, p in enumerate(prompts):
            runner.prefill(slot, p, 0)
        runner.prefill(3, prompts[0][:10], 0)  # a prompt half-way through its prefill, in the slot after the rows
    prefilling_k = graphed.cache.k[:, 3, :, :10].clone()
    tokens = [28, 29, 30]
    positions = [len(p) for p in prompts]
    for step in range(4):  # 3 rows run in the batch-4 bucket: slot 3 is a padded row every step
        want = plain.decode(tokens, [p + step for p in positions])
        got = graphed.decode(tokens, [p + step for p in positions])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1).tolist()
    assert torch.equal(graphed.cache.k[:, 3, :, :10], prefilling_k)  # the padded row wrote only at max_len - 1
    for slot, p in enumerate(prompts):  # and every live row's K/V is what the plain decode wrote
        end = len(p) + 4
        torch.testing.assert_close(graphed.cache.k[:, slot, :, :end], plain.cache.k[:, slot, :, :end],
                                   atol=2e-4, rtol=1e-4)


def test_scheduler_with_the_bucketed_runner_generates_the_same_tokens(real_engine):
    from engine.core.engine_core import EngineCore

    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    runs = []
    for graphs in (False, True):
        runner = ModelRunner(real_engine.runner.decoder, 8, MAX_LEN, cuda_graphs=graphs, capture=False)
        run = Run(EngineCore(runner, real_engine.sampler, real_engine.tokenizer))
        for i, p in enumerate(prompts[:3]):  # rows retire at different steps: batch 3 -> 2 -> 1 buckets
            run.add(f"r{i}", p, greedy(4 + 3 * i, ignore_eos=True))
        run.until_done()
        runs.append(run)
    for i in range(3):
        assert runs[1].ids(f"r{i}") == runs[0].ids(f"r{i}")
        assert len(runs[0].ids(f"r{i}")) == 4 + 3 * i
