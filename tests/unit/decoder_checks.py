"""One check shared by the attention kernels' decoder tests (fp32, and bf16 products)."""

from __future__ import annotations

import torch


def assert_same_logits_chunked_cached_batched_or_decoded(dec, cache, prompt: list[int], whole: torch.Tensor) -> None:
    """`whole` is `prompt`'s last logits from one prefill into slot 0 of `cache` (3 slots): the same bits chunked,
    after a cached prefix, in a batch with another prompt, decoding the last token after the rest, and decoding it
    in the forward that prefills a third prompt."""
    dec.prefill(cache, 1, prompt[:64], 0)  # chunked, as the scheduler's prefill budget does
    dec.prefill(cache, 1, prompt[64:128], 64)
    assert torch.equal(dec.prefill(cache, 1, prompt[128:], 128), whole)
    other = prompt[:20]
    batch = dec.prefill_batch(cache, [1, 2], [prompt[100:], other], starts=[100, 0])  # slot 1 holds 0..99
    assert torch.equal(batch[0], whole)
    assert torch.equal(batch[1], dec.prefill(cache, 0, other, 0))
    # token by token: decoding the prompt's last token after its prefix gives the whole prompt's logits
    dec.prefill(cache, 0, prompt[:-1], 0)
    dec.prefill(cache, 1, other, 0)
    tokens, positions = torch.tensor([prompt[-1], 7]), torch.tensor([len(prompt) - 1, len(other)])
    stepped = dec.logits(dec.decode_hidden(cache, tokens, positions, span=len(prompt)))
    assert torch.equal(stepped[0], whole)
    assert torch.equal(stepped[1], dec.prefill(cache, 2, [*other, 7], 0))
    # one forward that decodes both rows while it prefills a third prompt: each row has the bits it has alone
    dec.prefill(cache, 0, prompt[:-1], 0)
    dec.prefill(cache, 1, other, 0)
    third = prompt[5:40]
    mixed = dec.forward_packed(cache, [0, 1, 2], [[prompt[-1]], [7], third], [len(prompt) - 1, len(other), 0],
                               decode=2)
    assert mixed.shape[0] == 3
    assert torch.equal(mixed[0], whole)
    assert torch.equal(mixed[1], stepped[1])
    assert torch.equal(mixed[2], dec.prefill(cache, 2, third, 0))
