"""Vectorised per-row sampler, kept apart from the model forward.

Order per row: logit_bias -> penalties -> grammar mask -> stop-token bans (min_tokens, ignore_eos;
never emptying a row) -> (greedy | temperature,
top_k, top_p, draw with the row's own generator). Logprobs are reported from the raw model
distribution (before any processing), as OpenAI-compatible servers do. Each row draws with its
own `torch.Generator`, so a seeded request samples the same tokens alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sampling import row_ops
from engine.sampling.draw import choose
from engine.sampling.penalty_counts import PenaltyCounts
from engine.sampling_params import SamplingParams
from engine.staging import row_index, stage

LOGPROB_FLOOR = -9999.0  # -inf is not valid JSON; clamp like other OpenAI-compatible servers


class SamplerRow(Protocol):
    """What the sampler needs from a running sequence."""

    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int]
    prompt_ids: list[int]

    def prompt_mask(self, vocab: int, device: torch.device | str = ...) -> torch.Tensor: ...


GrammarMask = Callable[[torch.Tensor], None]  # applies a row's allowed-token mask in place to [V] logits


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    row_errors: dict[int, Exception] = field(default_factory=dict)  # rows whose own settings failed; drop them


class Sampler:
    def __init__(self, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_set = frozenset(stop_token_ids)
        self.stop_ids = sorted(stop_token_ids)
        self.counts = PenaltyCounts()  # output-token counts of penalised rows, on the logits' device

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplerRow],
        grammar_masks: dict[int, GrammarMask] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] float32 for the B rows (modified in place), on any device.

        Every tensor is made on the logits' device (host lists are staged without a sync, see
        engine.staging); the chosen ids, their logprobs and any top logprobs cross to the host in one
        transfer, the step's only sync.
        """
        vocab, b = logits.shape[-1], len(rows)
        device = logits.device
        # the raw distribution, read before anything changes the logits: its normaliser (one reduction, no
        # [B, V] log-softmax) on the rows whose logprobs are read, the top logprobs asked for, and the raw rows
        # that bias, penalties or a grammar will change (a stop-token ban only touches tokens that are then not
        # chosen). A row that reads no logprob gets 0.0 for its token's.
        scored = [i for i, r in enumerate(rows) if r.params.reads_logprobs]
        if len(scored) == b:
            lse = row_ops.logsumexp(logits)
        else:
            lse = torch.zeros(b, dtype=logits.dtype, device=device)
            if scored:
                index = row_index(scored, b, device)
                lse[index] = row_ops.logsumexp(logits[index])
        want_top = [i for i, r in enumerate(rows) if r.params.logprobs and r.params.top_logprobs > 0]
        k = max((rows[i].params.top_logprobs for i in want_top), default=0)
        if want_top:
            top_index = row_index(want_top, b, device)
            top_values, top_id_t = row_ops.topk(logits[top_index], k)
            top_values = top_values - lse[top_index][:, None]
        changed = [i for i, r in enumerate(rows)
                   if r.params.logit_bias or r.params.uses_penalties or (grammar_masks and i in grammar_masks)]
        raw_changed = logits[row_index(changed, b, device)].clone() if changed else None
        row_errors: dict[int, Exception] = {}
        self._apply_bias_and_penalties(logits, rows, vocab, row_errors)
        for i, apply_mask in (grammar_masks or {}).items():
            try:
                apply_mask(logits[i])
            except Exception as exc:  # one request's grammar must not fail the batch
                row_errors[i] = exc
        for i in row_errors:
            logits[i] = 0.0  # a failed row still gets a (discarded) draw; keep it finite
        self._mask_stop_tokens(logits, rows)
        tokens = choose(logits, rows)
        chosen_raw = logits.gather(1, tokens[:, None])[:, 0]
        if raw_changed is not None:
            index = row_index(changed, b, device)
            chosen_raw[index] = raw_changed.gather(1, tokens[index][:, None])[:, 0]
        chosen = (chosen_raw - lse).clamp(min=LOGPROB_FLOOR)
        if len(scored) < b:
            chosen = chosen.masked_fill(stage([not r.params.reads_logprobs for r in rows], torch.bool, device), 0.0)
        parts = [tokens.double(), chosen.double()]  # float64 holds every token id exactly
        if want_top:
            parts += [top_id_t.double().flatten(), top_values.clamp(min=LOGPROB_FLOOR).double().flatten()]
        host = torch.cat(parts).tolist()  # the one device -> host transfer of the step
        ids, logprobs = host[:b], host[b : 2 * b]
        top: list[list[tuple[int, float]] | None] = [None] * b
        n_top = len(want_top) * k
        top_ids, values = host[2 * b : 2 * b + n_top], host[2 * b + n_top :]
        for j, i in enumerate(want_top):
            kk = rows[i].params.top_logprobs
            top[i] = [(int(t), v) for t, v in zip(top_ids[j * k : j * k + kk], values[j * k : j * k + kk],
                                                    strict=True)]
        return SampleOutput(tokens=[int(t) for t in ids], logprobs=logprobs, top=top, row_errors=row_errors)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
        """min_tokens bans EOS and the request's stop ids until reached; ignore_eos bans EOS. A ban never
        empties a row: when a grammar allows nothing but the end, the candidate ends (finish `stop`).

        Only the banned (row, token) entries are written, and put back on a row the ban left with nothing (one
        max per row, not a [B, V] mask)."""
        early = [len(r.output_ids) < r.params.min_tokens for r in rows]
        pairs: list[tuple[int, int]] = []
        vocab, device = logits.shape[-1], logits.device
        for i, r in enumerate(rows):
            if early[i] or r.params.ignore_eos:
                extra = r.params.stop_token_ids if early[i] else []
                pairs += [(i, t) for t in {*self.stop_ids, *extra} if 0 <= t < vocab]
        if not pairs:
            return
        where = stage(pairs, torch.long, device)
        banned_rows, banned_tokens = where[:, 0], where[:, 1]
        kept = logits[banned_rows, banned_tokens]
        logits[banned_rows, banned_tokens] = float("-inf")
        emptied = logits.amax(dim=-1) == float("-inf")  # [B]: the ban left this row nothing
        logits[banned_rows, banned_tokens] = torch.where(emptied[banned_rows], kept, float("-inf"))

    def _apply_bias_and_penalties(self, logits: torch.Tensor, rows: Sequence[SamplerRow], vocab: int,
                                  row_errors: dict[int, Exception]) -> None:
        device = logits.device
        # every row's bias in one staged (row, token, value) table and one scatter-add
        bias: list[tuple[int, int, float]] = []
        for i, row in enumerate(rows):
            try:
                bias += [(i, int(t), float(v)) for t, v in row.params.logit_bias.items() if 0 <= t < vocab]
            except Exception as exc:
                row_errors[i] = exc
        if bias:
            table = stage(bias, torch.float64, device)  # ids < 2**53 are exact in float64
            logits.index_put_((table[:, 0].long(), table[:, 1].long()), table[:, 2].to(logits.dtype),
                              accumulate=True)
        penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not penalised:
            return
        settings = stage([[rows[i].params.repetition_penalty, rows[i].params.presence_penalty,
                           rows[i].params.frequency_penalty] for i in penalised], logits.dtype, device)
        prompt = None
        if any(rows[i].params.repetition_penalty != 1.0 for i in penalised):
            prompt = torch.stack([rows[i].prompt_mask(vocab, device) for i in penalised])
        if row_ops.native_penalties(logits):  # one pass per row in place, no [P, V] temporaries
            buf, where = self.counts.update([rows[i] for i in penalised], vocab, logits.dtype, device)
            row_ops.penalize_(logits, stage(penalised, torch.long, device), buf, stage(where, torch.long, device),
                              prompt, settings)
            return
        index = row_index(penalised, len(rows), device)
        sub = logits[index]
        counts = self.counts.gather([rows[i] for i in penalised], vocab, logits.dtype, device)
        rep, pres, freq = settings[:, 0:1], settings[:, 1:2], settings[:, 2:3]
        penalise = penalise_sparse if device.type == "cpu" else penalise_dense
        logits[index] = penalise(sub, counts, prompt, rep, pres, freq)


def penalise_dense(sub: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor | None, rep: torch.Tensor,
                   pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Penalties over whole [P, V] rows: a few elementwise kernels and no host sync (the GPU's path)."""
    if prompt is not None:
        # HF/vLLM definition: over prompt and output tokens, shrink toward zero
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(prompt | (counts > 0), scaled, sub)
    # OpenAI definition: over generated tokens only
    return sub - freq * counts - pres * (counts > 0).to(sub.dtype)


def penalise_sparse(sub: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor | None, rep: torch.Tensor,
                    pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """The same arithmetic on the (row, token) entries it changes only (the CPU's path): a row has seen a few
    hundred tokens of a vocabulary of 50k-250k, and each full-row pass costs about as much as the whole rest."""
    if prompt is not None:
        r, t = (prompt | (counts > 0)).nonzero(as_tuple=True)
        v, f = sub[r, t], rep[r, 0]
        sub[r, t] = torch.where(v > 0, v / f, v * f)
    r, t = counts.nonzero(as_tuple=True)
    c = counts[r, t]
    sub[r, t] = sub[r, t] - freq[r, 0] * c - pres[r, 0]
    return sub
