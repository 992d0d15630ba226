"""Per-row work over a step's [B, V] logits: logsumexp, argmax, the k largest, and penalties in place.

In fp32 on the CPU they run our kernels (engine/model/kernels/row_ops.cpp); elsewhere torch's ops. torch's CPU
kernels are slow on a few wide rows: at [8, 49152] argmax took 313 us, logsumexp 153 us and topk(50) 367 us,
ours 13, 68 and 91 us, and every step runs the first two. Ours reduce each row alone in a fixed order, so a
row's results do not depend on its batch. Ties in topk go to the lower token id, as in argmax.
"""

from __future__ import annotations

import torch

from engine.model import cpu_kernels


def _native(logits: torch.Tensor) -> bool:
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(-1) == 1 and cpu_kernels.available())


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """[B] log(sum(exp(row)))."""
    if _native(logits):
        return torch.ops.sie_kernels.row_logsumexp(logits)
    return torch.logsumexp(logits, dim=-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's first maximum."""
    if _native(logits):
        return torch.ops.sie_kernels.row_argmax(logits)
    return logits.argmax(dim=-1)


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, k] values, [B, k] ids) of each row's k largest, in descending order."""
    if _native(logits):
        return torch.ops.sie_kernels.row_topk(logits, k)
    return logits.topk(k, dim=-1)


def native_penalties(logits: torch.Tensor) -> bool:
    """`penalize_` runs here (else the sampler's torch path: engine.sampling.sampler.penalise_sparse/_dense)."""
    return _native(logits)


def penalize_(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, count_rows: torch.Tensor,
              prompt: torch.Tensor | None, settings: torch.Tensor) -> None:
    """Repetition (over `prompt` and counted tokens), then frequency and presence penalties on logits[rows] in
    place: the arithmetic of penalise_sparse, bit for bit. counts[count_rows[p]]: row p's output-token counts;
    settings [P, 3]: repetition, presence, frequency."""
    torch.ops.sie_kernels.penalize_(logits, rows, counts, count_rows, prompt, settings)
