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
    """DecodeGraphs knows no model: it pads the live rows to the batch bucket (token 0 at position 0, through a
    table of null blocks), rounds the span up to its bucket, and every bucket writes the same output buffer, of
    which the live rows return."""
    calls = []

    def step(tokens, positions, tables, span):
        calls.append((tokens.tolist(), positions.tolist(), tables.tolist(), span))
        return torch.stack([tokens, positions], dim=1).float()

    graphs = DecodeGraphs(step, max_batch=8, max_len=256, max_blocks=2, width=2, dtype=torch.float32,
                          device=torch.device("cpu"), capture=False)
    out = graphs.run([7, 8, 9], [3, 70, 5], torch.tensor([[1, 2], [3, 4], [5, 6]]))
    assert calls == [([7, 8, 9, 0], [3, 70, 5, 0], [[1, 2], [3, 4], [5, 6], [0, 0]], 128)]
    assert out.tolist() == [[7, 3], [8, 70], [9, 5]]
    again = graphs.run([4], [1], torch.tensor([[9, 0]]))
    assert calls[-1] == ([4], [1], [[9, 0]], 64) and again.data_ptr() == out.data_ptr() == graphs.output.data_ptr()
    graphs.run([4], [1], torch.tensor([[9, 0]]))
    graphs.run([1, 2], [1, 1], torch.tensor([[7, 0], [8, 0]]))
    assert calls[-1][2] == [[7, 0], [8, 0]]
    graphs.run([1, 2, 3], [1, 1, 1], torch.tensor([[7, 0], [8, 0], [5, 0]]))
    assert calls[-1][2][3] == [0, 0]  # a pad row never keeps a table an earlier, larger batch left there
    assert graphs.run([1], [256], torch.tensor([[1, 2]])) is None  # past the last span bucket: run eagerly


@torch.inference_mode()
def test_padded_bucketed_decode_matches_plain_decode_and_spares_the_prefilling_slot(real_engine):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    plain, graphed = _runner(real_engine), _runner(real_engine, graphs=True)
    for runner in (plain, graphed):
        for slot, p in enumerate(prompts):
            runner.prefill(slot, p, 0)
        runner.prefill(3, prompts[0][:10], 0)  # a prompt half-way through its prefill, in the slot after the rows
    pool_k = graphed.cache.k.clone()
    tokens = [28, 29, 30]
    positions = [len(p) for p in prompts]
    for step in range(4):  # 3 rows run in the batch-4 bucket: slot 3 is a padded row every step
        want = plain.decode(tokens, [p + step for p in positions])
        got = graphed.decode(tokens, [p + step for p in positions])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1).tolist()
    written = {(int(graphed.cache.rows[slot, pos // 16]), pos % 16) for slot, p in enumerate(prompts)
               for pos in range(len(p), len(p) + 4)}
    changed = (graphed.cache.k != pool_k).any(dim=(0, 2, 4)).nonzero().tolist()  # [block, offset] pairs
    changed_at = {(b, o) for b, o in changed}
    assert written <= changed_at and changed_at - written <= {(0, 0)}  # pads wrote the null block alone
    for slot, p in enumerate(prompts):  # and every live row's K/V is what the plain decode wrote
        end = len(p) + 4
        for cache in (graphed.cache, plain.cache):
            assert list(cache.rows[slot]) == list(graphed.cache.rows[slot])  # the same tables: identity layout
        blocks = graphed.cache.rows[slot, : -(-end // 16)].tolist()
        torch.testing.assert_close(graphed.cache.k[:, blocks], plain.cache.k[:, blocks], atol=2e-4, rtol=1e-4)


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
