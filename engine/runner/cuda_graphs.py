"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes and attention spans.

Why: on a GPU a decode step of a small or mid-sized model is launch-bound (about 700 kernels a step for the
SmolLM2 body, 11 ms of host time against 1.7 ms of GPU time at batch 1). A captured graph launches all of
them in one call, as vLLM and SGLang do for decode.

How: inputs go into static buffers sized for the largest batch; a step of B rows reading `span` positions
runs the graph captured for the smallest batch bucket >= B and span bucket >= span, with the rows past B
padded. The rows' block tables are inputs too (a static buffer, refilled each step), so a graph follows the
blocks wherever the scheduler put them. Padded rows feed token 0 at position 0 through a table of null blocks:
they write only the null block, which nothing reads as a real position (engine.model.kv_cache). Each row's own
mask, or our kernel's own length, hides the positions past its length, so a larger span changes nothing it reads.
Graphs are captured lazily, one per (batch, span) bucket, in one shared memory pool.

What is captured is a callable, `step(tokens, positions, span) -> [batch, width]` (the runner's decoder body up
to the final norm): this module knows neither the model nor the runner. Every graph writes its result into one
shared `[max_batch, width]` buffer, and the LM head runs outside the graph on the live rows only, as in
nano-vllm: a graph's own logits buffer would cost batch x vocab x 4 bytes per captured bucket (about 1.1 GB at
a 152k vocabulary over the default buckets). Batches with LoRA rows run eagerly (the caller checks).

On the CPU (tests), `capture=False` runs the same padded, bucketed step eagerly through the same buffers, so
the padding and bucketing are checked against the plain decode without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.staging import stage

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
SPAN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# (tokens [batch], positions [batch], block tables [batch, max_blocks], span) -> [batch, width], on device tensors
# and with no host sync
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def buckets(candidates: tuple[int, ...], limit: int) -> list[int]:
    """The candidates up to `limit`, plus `limit` itself, so every size up to it has a bucket."""
    return sorted({c for c in candidates if c < limit} | {limit})


class DecodeGraphs:
    def __init__(self, step: Step, max_batch: int, max_len: int, max_blocks: int, width: int, dtype: torch.dtype,
                 device: torch.device, capture: bool | None = None) -> None:
        self.step = step
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        self.batch_buckets = buckets(BATCH_BUCKETS, max_batch)
        self.span_buckets = buckets(SPAN_BUCKETS, max_len)
        # rows: token ids, positions
        self.inputs = torch.zeros(2, max_batch, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=device)  # pads: null blocks
        self.output = torch.zeros(max_batch, width, dtype=dtype, device=device)  # what every graph writes
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the graphs' shared memory pool (an opaque handle)
        self.disabled = False

    def run(self, token_ids: list[int], positions: list[int], tables: torch.Tensor) -> torch.Tensor | None:
        """The step's [B, width] result for B live rows (`tables`: their block tables, on the device), or None
        when this step must run eagerly. A view of the shared output buffer: valid until the next call."""
        if self.disabled:
            return None
        b = len(token_ids)
        batch = self._bucket(self.batch_buckets, b)
        span = self._bucket(self.span_buckets, max(positions) + 1)
        if batch is None or span is None:
            return None
        pad = batch - b
        self.inputs[:, :batch].copy_(stage([token_ids + [0] * pad, positions + [0] * pad],
                                           torch.long, self.device), non_blocking=True)
        self.tables[:b].copy_(tables, non_blocking=True)
        self.tables[b:batch].zero_()  # pad rows: null blocks (a larger batch before left its tables there)
        if not self.capture:
            self._body(batch, span)
            return self.output[:b]
        key = (batch, span)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(batch, span)
            except Exception:  # never worse than eager: log once, stop trying
                log.exception("CUDA graph capture failed at batch %d, span %d; decoding eagerly", batch, span)
                self.disabled = True
                return None
        self.graphs[key].replay()
        return self.output[:b]

    @staticmethod
    def _bucket(sizes: list[int], n: int) -> int | None:
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def _body(self, batch: int, span: int) -> None:
        self.output[:batch].copy_(self.step(self.inputs[0, :batch], self.inputs[1, :batch], self.tables[:batch],
                                            span))

    def _capture(self, batch: int, span: int) -> torch.cuda.CUDAGraph:
        # warm-up on a side stream (allocator and kernel selection), as torch.cuda.graphs recommends; it
        # computes this very step, so its K/V writes are the ones the replay makes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(batch, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: the engine loop captures while other threads (Triton, the caller) may use CUDA
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._body(batch, span)
        self.pool = graph.pool()
        log.info("captured a decode CUDA graph at batch %d, span %d", batch, span)
        return graph
