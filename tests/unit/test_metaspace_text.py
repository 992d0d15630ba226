"""Released text on a SentencePiece/Metaspace tokenizer (Llama-2/Mistral style), built offline.

Such decoders strip the space at the start of a text, so decoding a first new token alone loses its
leading space (`▁Paris` -> `Paris`). The prompt joined with the released text must equal the decode of
prompt + output ids, and logprob token strings must keep the space too.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.output_processor import OutputStage
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.stats import EngineStats
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.text.token_text import TokenText

CORPUS = [
    "The capital of France is Paris, the city of light.",
    "Paris is in France. The city of Rome is in Italy.",
    "Light travels fast; the capital cities are large.",
] * 20


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # the Llama-2 decoder chain: ▁ -> space, byte fallback, then strip one leading space
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def split_ids(tokenizer, text: str, prompt_text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = len(tokenizer.encode(prompt_text, add_special_tokens=False))
    assert tokenizer.convert_ids_to_tokens(ids[k]).startswith("▁")  # the first new token carries a space
    return ids[:k], ids[k:]


def test_decoding_a_metaspace_token_alone_drops_its_space(metaspace_tokenizer):
    """The premise: the tokenizer behaves like Llama-2's (otherwise the tests below prove nothing)."""
    _, output = split_ids(metaspace_tokenizer, "The capital of France is Paris, the city.", "The capital of France is")
    assert not metaspace_tokenizer.decode(output[:1]).startswith(" ")


def test_released_text_joined_to_the_prompt_equals_the_full_decode(metaspace_tokenizer):
    text = "The capital of France is Paris, the city of light."
    prompt, output = split_ids(metaspace_tokenizer, text, "The capital of France is")
    params = SamplingParams(max_tokens=100, logprobs=True)
    group = SequenceGroup(EngineRequest("m", prompt, params, lambda out: None))
    seq = Sequence(group, 0, torch.Generator(), metaspace_tokenizer)
    group.sequences = [seq]
    stage = OutputStage(metaspace_tokenizer, frozenset({metaspace_tokenizer.eos_token_id}), EngineStats(),
                        lambda g: None)
    for token in output:
        stage.advance(seq, token, -0.5, None)
    prompt_text = metaspace_tokenizer.decode(prompt, skip_special_tokens=True)
    assert prompt_text + seq.full_text == metaspace_tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert seq.full_text.startswith(" Paris")
    assert seq.unsent_logprobs[0]["token"].startswith(" ")
    assert "".join(e["token"] for e in seq.unsent_logprobs) == seq.full_text


def test_token_text_keeps_the_leading_space(metaspace_tokenizer):
    token_text = TokenText(metaspace_tokenizer)
    (paris,) = [i for t, i in metaspace_tokenizer.get_vocab().items() if t == "▁Paris"]
    assert token_text(paris) == " Paris"
