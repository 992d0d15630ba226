"""Grammar-constrained decoding with xgrammar: compiled-grammar cache and per-sequence matchers.

The sampler calls `GrammarState.apply_mask` only for constrained rows, each step; children of an
n/best_of request fork the parent's matcher, so every candidate keeps its own grammar position.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from engine.errors import EngineError
from engine.sampling_params import GrammarRequest

_CACHE_SIZE = 128
COMPILE_THREADS = 2
# xgrammar's log prefix on its error messages: "[13:29:40] /project/cpp/json_schema_converter.cc:5082: "
_XGRAMMAR_PREFIX = re.compile(r"^\[\d{1,2}:\d{2}:\d{2}\] \S+?:\d+: ", re.MULTILINE)


def compile_error_message(exc: BaseException) -> str:
    """xgrammar's error text for a client: the rule it broke, without its log time and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip()


class GrammarState:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def apply_mask(self, logits_row: torch.Tensor) -> None:
        if logits_row.device.type == "cuda" and not self.bitmask.is_pinned():
            # pinned, so the copy below queues behind the forward without a host sync; the buffer is refilled
            # only in a later step, after that step's read of the sampled ids has waited for the copy
            self.bitmask = self.bitmask.pin_memory()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bitmask = self.bitmask if logits_row.device.type == "cpu" else self.bitmask.to(logits_row.device,
                                                                                        non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits_row.view(1, -1), bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> bool:
        """Advance the matcher; False when the grammar rejects the token (it must not be appended)."""
        if self.matcher.is_terminated():
            return True
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.fork(), self.vocab_size)


class GrammarCompilerCache:
    """Compiles grammars once per (kind, value), within a time budget, and keeps the most recent ones.

    Why a budget: a 1.3 KB schema can take minutes to compile. Compiles run on their own
    threads (xgrammar releases the GIL while it compiles); a caller waits at most `budget_s` and then gets a 400.
    A compile cannot be interrupted, so one over budget finishes in the background (and is cached for a
    retry); at most COMPILE_THREADS run at once, and waiting for one counts against the budget.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], budget_s: float = 5.0) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self._cache: collections.OrderedDict[str, xgr.CompiledGrammar] = collections.OrderedDict()
        self._compiling: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()

    def new_state(self, grammar: GrammarRequest) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self._compiled(grammar)), self.vocab_size)

    def _compiled(self, grammar: GrammarRequest) -> xgr.CompiledGrammar:
        key = json.dumps([grammar.kind, grammar.value], sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._compiling.get(key)  # the same grammar already compiling: wait for that one
            if future is None:
                future = self._compiling[key] = self._pool.submit(self._compile_and_keep, key, grammar)
        try:
            return future.result(timeout=self.budget_s)
        except TimeoutError:
            raise EngineError("grammar_invalid", f"the {grammar.kind} grammar did not compile within this "
                              f"model's {self.budget_s:g} s budget; simplify it", "grammar") from None

    def _compile_and_keep(self, key: str, grammar: GrammarRequest) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(grammar)
            _check_not_empty(compiled, grammar.kind)
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, grammar: GrammarRequest) -> xgr.CompiledGrammar:
        try:
            if grammar.kind in ("json_schema", "json_object"):
                schema = grammar.value if grammar.kind == "json_schema" else {"type": "object"}
                # compact JSON: small models otherwise wander into unbounded whitespace
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                         strict_mode=True)
            if grammar.kind == "regex":
                return self.compiler.compile_regex(grammar.value)
            if grammar.kind == "ebnf":
                return self.compiler.compile_grammar(grammar.value)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a useful message
            raise EngineError("grammar_invalid", f"the {grammar.kind} grammar does not compile: "
                              f"{compile_error_message(exc)}",
                              "grammar") from None
        raise EngineError("unsupported_field", f"grammar kind '{grammar.kind}' is not supported", "grammar")


def _check_not_empty(compiled: xgr.CompiledGrammar, kind: str) -> None:
    """A grammar whose language is empty (`root ::= root`) compiles, then allows no token at all: say so now."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()) and not matcher.is_terminated():
        raise EngineError("grammar_invalid", f"the {kind} grammar matches no text at all", "grammar")
