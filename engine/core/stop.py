"""The one stop decision: whether a candidate has finished at the token it just recorded, and why.

The sampler only keeps a candidate from *sampling* EOS or a stop token id before `min_tokens` (logit bans);
deciding that it stopped is this function's alone, called once per sampled token by the output processor.
"""

from __future__ import annotations

from engine.core.sequence import Sequence

StopDecision = tuple[str | None, str | int | None, str]  # (finish_reason, stop_reason, released text)


def check_stop(seq: Sequence, token: int, eos_ids: frozenset[int]) -> StopDecision:
    """For `token`, already recorded on `seq`: (finish_reason or None, the stop string or id, the text the
    token releases). A stop token id or EOS releases no text; a stop string ends the text before it."""
    params = seq.params
    if token in params.stop_token_ids:
        return "stop", token, ""
    if token in eos_ids and (not params.ignore_eos or seq.grammar is not None):
        return "stop", None, ""  # ignore_eos never keeps a candidate going that its grammar has ended
    # min_tokens holds back stop strings too, as it does EOS and stop ids (the sampler's bans)
    text = seq.detok.add_token(token, check_stop=len(seq.output_ids) >= params.min_tokens)
    if seq.detok.matched_stop is not None:
        return "stop", seq.detok.matched_stop, text
    if seq.grammar is not None and seq.grammar.is_terminated():
        return "stop", None, text
    if len(seq.output_ids) >= params.max_tokens:
        return "length", None, text
    return None, None, text
