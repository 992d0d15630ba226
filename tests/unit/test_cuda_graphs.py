"""Bucketed, padded decode steps (engine.runner.cuda_graphs) give the plain decode's logits and leave other slots alone.

On the CPU the runner goes through the same static buffers, batch/span buckets and padded rows as on a GPU,
only without capturing (capture=False); the graph capture itself is checked on the device (bench/gpu.py).
"""

from __future__ import annotations

import copy

import torch

from engine.model.kv_cache import KVCache
from engine.runner.cuda_graphs import DecodeGraphs, buckets

from .engine_run import PROMPTS, Run, greedy

MAX_LEN = 256


def _forward(real_engine, slots: int = 8):
    fwd = copy.copy(real_engine.forward)
    fwd.cache = KVCache(len(fwd.layers), slots, fwd.n_kv, MAX_LEN, fwd.head_dim, fwd.dtype, fwd.device)
    fwd.cache.k.zero_()
    fwd.cache.v.zero_()
    return fwd


def test_buckets_cover_every_size_up_to_the_limit():
    assert buckets((1, 2, 4, 8, 16), 6) == [1, 2, 4, 6]
    runner_sizes = buckets((64, 128, 256), 256)
    assert runner_sizes == [64, 128, 256]


@torch.inference_mode()
def test_padded_bucketed_decode_matches_plain_decode_and_spares_the_prefilling_slot(real_engine):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    plain, graphed = _forward(real_engine), _forward(real_engine)
    graphed.graphs = DecodeGraphs(graphed, capture=False)
    for fwd in (plain, graphed):
        for slot, p in enumerate(prompts):
            fwd.prefill(slot, p, 0)
        fwd.prefill(3, prompts[0][:10], 0)  # a prompt half-way through its prefill, in the slot after the rows
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


def test_a_replaced_cache_falls_back_to_the_eager_decode(real_engine):
    fwd = _forward(real_engine)
    fwd.graphs = DecodeGraphs(fwd, capture=False)
    fwd.cache = KVCache(len(fwd.layers), 2, fwd.n_kv, MAX_LEN, fwd.head_dim, fwd.dtype, fwd.device)
    assert fwd.graphs.decode([28], [0]) is None  # graphs read the old cache's storage: never replay them


def test_scheduler_with_the_bucketed_runner_generates_the_same_tokens(real_engine, make_scheduler):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    runs = []
    for graphs in (False, True):
        sched = make_scheduler(slots=8)
        if graphs:
            sched.forward.graphs = DecodeGraphs(sched.forward, capture=False)
        run = Run(sched)
        for i, p in enumerate(prompts[:3]):  # rows retire at different steps: batch 3 -> 2 -> 1 buckets
            run.add(f"r{i}", p, greedy(4 + 3 * i, ignore_eos=True))
        run.until_done()
        runs.append(run)
    for i in range(3):
        assert runs[1].ids(f"r{i}") == runs[0].ids(f"r{i}")
        assert len(runs[0].ids(f"r{i}")) == 4 + 3 * i
