"""The scheduler's output stage: how a candidate's sampled tokens become outputs.

Text release (stop strings, stop token ids, reasoning split), logprob entries, streamed deltas, and
the closing of finished candidates (ranked for best_of). The EngineCore owns one `OutputStage` and
calls it after each sampling step; `close_finished` says when a request's last candidate has closed,
so the scheduler can drop its KV reservation. Whether a candidate stopped is `check_stop`'s call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from engine.core.sequence import Sequence, SequenceGroup
from engine.core.stats import EngineStats
from engine.core.stop import check_stop
from engine.errors import EngineError
from engine.request import RequestOutput
from engine.text.token_text import TokenText

Postprocess = Callable[[Sequence], dict[str, Any]]
# a streamed request whose candidates wait preempted sends an empty output this often: it is alive, so the
# gateway's inter-chunk timeout (60 s by default) does not cut a stream that is only waiting for KV room
PREEMPTED_HEARTBEAT_S = 10.0


def send_heartbeats(seqs: Iterable[Sequence], now: float) -> None:
    """An empty output for each streamed request among `seqs` with a candidate that waits to be computed again
    after a preemption, when it has sent nothing for PREEMPTED_HEARTBEAT_S: the client's stream only pauses."""
    behind = [seq for seq in seqs if seq.output_ids and seq.num_computed < seq.num_tokens - 1]
    for group in {id(seq.group): seq.group for seq in behind}.values():
        last = group.last_output_at
        if group.request.stream and not group.sent_final and last is not None and now - last >= PREEMPTED_HEARTBEAT_S:
            group.emit(RequestOutput("", 0, "", progress=True))


class OutputStage:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], stats: EngineStats,
                 postprocess: Postprocess | None = None) -> None:
        self.token_text = TokenText(tokenizer)
        self.eos_ids = eos_ids
        self.stats = stats
        self.postprocess = postprocess  # hook(seq) -> extra closing fields (tool calls, strict grammars)

    def advance(self, seq: Sequence, token: int, logprob: float, top) -> None:
        """Append one sampled token to the candidate and decide whether it has finished."""
        params = seq.params
        if seq.grammar is not None and not seq.grammar.accept(token):
            # the sampler only offers tokens the grammar allows; never append one it rejects
            raise EngineError("inference_error", f"token {token} was rejected by the request's grammar")
        seq.record_token(token, logprob)
        if params.logprobs:
            seq.unsent_logprobs.append(self._logprob_entry(token, logprob, top))
        finish_reason, stop_reason, text = check_stop(seq, token, self.eos_ids)
        if text:
            self._add_text(seq, text)
        if finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        if seq.finished:
            self._add_text(seq, "" if seq.detok.matched_stop is not None else seq.detok.flush(), final=True)

    @staticmethod
    def _add_text(seq: Sequence, text: str, final: bool = False) -> None:
        """Released text -> content (and, for reasoning models, the reasoning part when asked for)."""
        if seq.splitter is not None:
            reasoning, text = seq.splitter.feed(text)
            if final:
                more_reasoning, more_text = seq.splitter.flush()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if seq.params.include_reasoning:
                seq.reasoning += reasoning
        seq.text += text
        seq.full_text += text

    def _logprob_entry(self, token: int, logprob: float, top) -> dict:
        text = self.token_text(token)
        entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                                 "top_logprobs": []}
        if top:
            for tid, lp in top:
                t = self.token_text(tid)
                entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))})
        return entry

    def emit_stream_deltas(self, groups: list[SequenceGroup]) -> None:
        """Send what each running candidate of a streamed request released this step."""
        for group in groups:
            if group.sent_final:
                continue
            if group.request.stream and not group.buffered:
                for seq in group.sequences:
                    if not seq.finished and (seq.text or seq.reasoning or seq.unsent_logprobs):
                        self._emit_delta(seq)
            elif not group.progress_sent:
                # blocking (or best_of-ranked) requests send nothing until a choice closes: one empty
                # progress output at the first token lets the gateway time the first token, not the whole run
                group.progress_sent = True
                group.emit(RequestOutput("", 0, "", completion_tokens=1, progress=True))

    def _emit_delta(self, seq: Sequence, **extra) -> None:
        out = RequestOutput(
            "",
            seq.index,
            seq.text,
            logprobs=seq.unsent_logprobs or None,
            completion_tokens=len(seq.output_ids),
            reasoning=seq.reasoning or None,
            **extra,
        )
        seq.text = ""
        seq.reasoning = ""
        seq.unsent_logprobs = []
        seq.group.emit(out)

    def close_finished(self, group: SequenceGroup) -> bool:
        """Close finished candidates (each with its finish_reason); the last closure is final. True when it
        was: the request is done and its KV reservation can go."""
        if group.sent_final:
            return False
        remaining = [s for s in group.sequences if not s.finished]
        if group.buffered:
            if remaining:
                return False
            closing = sorted(group.sequences, key=lambda s: s.cum_logprob, reverse=True)[: group.params.n]
            for new_index, seq in enumerate(closing):
                seq.index = new_index
        else:
            closing = [s for s in group.sequences if s.finished and not s.closed]
        for i, seq in enumerate(closing):
            seq.closed = True
            fields = {"finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason, **self._timing(group, seq)}
            if self.postprocess is not None:
                fields.update(self.postprocess(seq))
            self._emit_delta(seq, final=not remaining and i == len(closing) - 1, **fields)
        if not remaining:
            # one request, one reason (vLLM's request_success): the last candidate's, as for n = 1
            reason = closing[-1].finish_reason if closing else None
            self.stats.finish(reason or "stop")
            self.stats.observe("e2e_request_latency", time.monotonic() - group.request.arrival)
        return not remaining

    def _timing(self, group: SequenceGroup, seq: Sequence) -> dict[str, float]:
        if group.first_token_at is None:
            return {}
        now = time.monotonic()
        ttft = (group.first_token_at - group.request.arrival) * 1000
        steps = len(seq.output_ids) - 1
        tpot = (now - group.first_token_at) * 1000 / steps if steps > 0 else 0.0
        return {"ttft_ms": ttft, "tpot_ms": tpot}
