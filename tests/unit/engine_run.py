"""A synchronous scheduler harness for the engine tests: requests in, every output and token id recorded."""

from __future__ import annotations

import threading

from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "Name three primary colors.",
    "How do bees make honey?",
]


class Run:
    """Requests added to a synchronous scheduler; records every output and each candidate's token ids."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.groups = {}
        sched.outputs.postprocess = self._capture

    def _capture(self, seq) -> dict:
        self.tokens[(seq.group.request.request_id, seq.index)] = list(seq.output_ids)
        return {}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, stream: bool = True, is_cancelled=None,
            grammar=None):
        self.outputs[rid] = []
        self.sched.scheduler.add(EngineRequest(rid, prompt_ids, params, self.outputs[rid].append, stream, is_cancelled,
                                     grammar=grammar))
        self.groups[rid] = list(self.sched.scheduler.requests.values())[-1]

    def step(self) -> None:
        self.sched.step()

    def until_done(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.scheduler.has_work():
                return
            self.sched.step()
        raise AssertionError("scheduler did not finish")

    def ids(self, rid: str, index: int = 0) -> list[int]:
        return self.tokens[(rid, index)]

    def final(self, rid: str) -> RequestOutput:
        (out,) = self.finals(rid)
        return out

    def text(self, rid: str, index: int = 0) -> str:
        return "".join(o.text for o in self.outputs[rid] if o.index == index)

    def finals(self, rid: str) -> list[RequestOutput]:
        return [o for o in self.outputs[rid] if o.final]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


class RaisingGrammar:
    """A grammar state whose mask fails at the given step (an xgrammar failure for one request)."""

    def __init__(self, fail_at: int = 2) -> None:
        self.calls, self.fail_at = 0, fail_at

    def apply_mask(self, logits_row) -> None:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("matcher failed")

    def accept(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def fork(self):
        return RaisingGrammar(self.fail_at)


def generate_all(engine, prompts: list[str], params: list[SamplingParams], stream: bool = False,
                 cancel_after: int | None = None) -> list[list[RequestOutput]]:
    """Submit every prompt to a started LLMEngine at once; each request's outputs, in order, up to its final one
    (`cancel_after`: the first request is cancelled after that many outputs)."""
    queues, cancelled = [], threading.Event()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        probe = (lambda: cancelled.is_set()) if cancel_after is not None and i == 0 else None
        queues.append(engine.generate(f"r{i}-{id(p)}", engine.encode_prompt(prompt), p, stream=stream,
                                      is_cancelled=probe))
    results = []
    for i, q in enumerate(queues):
        outs = []
        while not (outs and outs[-1].final):
            outs.append(q.get(timeout=300))
            if cancel_after is not None and i == 0 and len(outs) >= cancel_after:
                cancelled.set()
        results.append(outs)
    return results


def joined_text(outs) -> str:
    return "".join(o.text for o in outs)
