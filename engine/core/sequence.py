"""Request and candidate state inside the engine."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from engine.errors import EngineError
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.reasoning import ReasoningSplitter

DETOK_CONTEXT = 6  # prompt tokens that seed each candidate's detokenizer


def candidate_generator(seed: int | None, index: int) -> torch.Generator:
    """Candidate `index`'s host-side RNG: draws stay the same on any device (see Sampler._choose); children
    of a seeded request get distinct but reproducible streams."""
    gen = torch.Generator()
    gen.manual_seed((seed + index) % 2**63 if seed is not None else random.getrandbits(63))
    return gen


class Sequence:
    """One candidate completion; occupies one batch row (slot) while running."""

    def __init__(self, group: SequenceGroup, index: int, generator: torch.Generator, tokenizer) -> None:
        self.group = group
        self.index = index
        self.params = group.request.params
        self.prompt_ids = group.request.prompt_ids
        self.output_ids: list[int] = []
        self.generator = generator
        # seeded with the prompt's tail, so the first token keeps its leading space (SentencePiece)
        self.detok = IncrementalDetokenizer(tokenizer, self.params.stop, self.prompt_ids[-DETOK_CONTEXT:])
        # where it stands: the positions of its tokens (prompt, then output) whose K/V are in the cache; the rest
        # are computed by the next steps (a decode row's one token, a prompt's chunks, a preempted one's all)
        self.num_computed = 0
        self.blocks: list[int] = []  # its block table: the KV pool blocks of its positions, in order
        self.reserved: list[int] = []  # blocks held for its n/best_of children's copies (KVManager.fork)
        self.slot = -1  # the batch row its table is in this step
        self.table_len = 0  # entries of `blocks` written in that row's table
        self.chain: tuple[int, list] | None = None  # (length, its prefix-cache keys), made once a length
        self.last_token_at: float | None = None  # when its latest token was sampled (inter-token latency)
        self.cum_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.closed = False  # its closing output was sent
        self.text = ""  # released, not yet sent
        self.full_text = ""
        self.unsent_logprobs: list[dict[str, Any]] = []
        self.reasoning = ""  # released reasoning text, not yet sent
        self.splitter = ReasoningSplitter(group.thinking_open) if group.reasoning else None
        self.grammar: Any = None  # per-sequence grammar matcher, when constrained
        self._prompt_mask: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens (prompt, then output) at positions start..end-1, without joining the two lists."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    def prompt_mask(self, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Which tokens the prompt holds [vocab] (repetition_penalty), made once on the sampler's device."""
        if self._prompt_mask is None or self._prompt_mask.device != torch.device(device):
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._prompt_mask[torch.tensor(self.prompt_ids, dtype=torch.long, device="cpu").to(device)] = True
        return self._prompt_mask

    def record_token(self, token: int, logprob: float) -> None:
        self.output_ids.append(token)
        self.cum_logprob += logprob  # penalty counts follow output_ids in the sampler (engine.sampling.penalty_counts)

    def fork(self, index: int, generator: torch.Generator, tokenizer) -> Sequence:
        child = Sequence(self.group, index, generator, tokenizer)
        child.num_computed = self.num_computed
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        return child


class SequenceGroup:
    """All candidates of one request (n / best_of), sharing one prefill."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.sequences: list[Sequence] = []
        self.first_token_at: float | None = None
        self.admitted_at: float | None = None  # first admission into the running batch (queue time)
        self.sent_final = False
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.cache_salt: object = None  # prefix-cache key root (adapter, image digest), made once
        self.progress_sent = False  # the first-token progress output of a non-streamed request
        self.admission = -1  # the scheduler's admission order (the newest running candidates are preempted first)
        self.forked = False  # its prompt is computed and its n/best_of candidates made
        self.order = -1  # arrival order at the scheduler (the waiting queue's first come, first served)
        self.last_output_at: float | None = None  # when it last sent an output (liveness of preempted streams)
        self.reasoning = False  # the model declares reasoning: split <think> text from content
        self.thinking_open = False  # the rendered prompt already opened the thinking block

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def buffered(self) -> bool:
        """best_of > n: candidates are ranked at the end, so nothing is streamed."""
        return (self.params.best_of or 1) > self.params.n

    def end_early(self, reason: str, error: EngineError | None = None) -> None:
        """The request's one final output when it ends before its candidates close (cancelled, failed): with the
        tokens it had made, the usage of its error terminal (sie-contract 2.6)."""
        self.emit(RequestOutput("", 0, "", finish_reason=reason, final=True, error=error,
                                completion_tokens=sum(len(s.output_ids) for s in self.sequences)))

    def emit(self, output: RequestOutput) -> None:
        output.request_id = self.request.request_id
        output.prompt_tokens = len(self.request.prompt_ids)
        output.cached_tokens = self.cached_tokens
        if output.final:
            self.sent_final = True
        self.last_output_at = time.monotonic()
        self.request.on_output(output)
