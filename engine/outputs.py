"""How a candidate's tokens become outputs: text release (stop strings, reasoning split), logprob
entries, streamed deltas, and the closing of finished candidates (ranked for best_of).

A mixin of the Scheduler: it uses the scheduler's tokenizer, sampler, stats, postprocess hook and
`_release` (the KV reservation of a finished request).
"""

from __future__ import annotations

import time
from typing import Any

from engine.sequence import RequestOutput, Sequence, SequenceGroup
from engine.stats import EngineStats


class CandidateOutputs:
    tokenizer: Any
    sampler: Any
    stats: EngineStats
    postprocess: Any

    def _release(self, group: SequenceGroup) -> None:  # provided by the Scheduler
        raise NotImplementedError

    def _advance(self, seq: Sequence, token: int, logprob: float, top) -> None:
        seq.record_token(token, logprob)
        params = seq.params
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if params.logprobs:
            seq.unsent_logprobs.append(self._logprob_entry(token, logprob, top))
        if token in self.sampler.stop_token_set and not params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            self._add_text(seq, seq.detok.add_token(token))
            if seq.detok.matched_stop is not None or seq.grammar is not None and seq.grammar.is_terminated():
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens:
                seq.finish_reason = "length"
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
        text = self.tokenizer.decode([token])
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        if top:
            for tid, lp in top:
                t = self.tokenizer.decode([tid])
                entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))})
        return entry

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

    def _maybe_finish_group(self, group: SequenceGroup) -> None:
        """Close finished candidates (each with its finish_reason); the last closure is final."""
        if group.sent_final:
            return
        remaining = [s for s in group.sequences if not s.finished]
        if group.buffered:
            if remaining:
                return
            closing = sorted(group.sequences, key=lambda s: s.cum_logprob, reverse=True)[: group.params.n]
            for new_index, seq in enumerate(closing):
                seq.index = new_index
        else:
            closing = [s for s in group.sequences if s.finished and not s.closed]
        for i, seq in enumerate(closing):
            seq.closed = True
            fields = {"finish_reason": seq.finish_reason, "stop_reason": seq.detok.matched_stop,
                      **self._timing(group, seq)}
            if self.postprocess is not None:
                fields.update(self.postprocess(seq))
            self._emit_delta(seq, final=not remaining and i == len(closing) - 1, **fields)
        if not remaining:
            self.stats.finished += 1
            self._release(group)

    def _timing(self, group: SequenceGroup, seq: Sequence) -> dict[str, float]:
        if group.first_token_at is None:
            return {}
        now = time.monotonic()
        ttft = (group.first_token_at - group.request.arrival) * 1000
        steps = len(seq.output_ids) - 1
        tpot = (now - group.first_token_at) * 1000 / steps if steps > 0 else 0.0
        if steps > 0:
            self.stats.tpot_last = tpot / 1000
        return {"ttft_ms": ttft, "tpot_ms": tpot}
