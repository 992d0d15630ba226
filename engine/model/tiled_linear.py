"""Our fp32 CPU linear (engine/model/kernels/tiled_linear.cpp): weights laid out once as column tiles, one kernel
for every row count, so a row's output is bit-identical alone, in any batch, in prefill or decode.

Why: decode multiplies 1-128 rows by every weight, and there MKL and oneDNN read the weights at 10-25 GB/s; the
tiled kernel keeps 48 output columns x up to 8 rows in registers and streams each weight once per 8 rows. On the
2-core Xeon (AVX-512, 480 MB L3), SmolLM2's 120 layer linears per pass, best of 5, ms, MKL's F.linear / prepacked
oneDNN / tiled: M=1 17.7 / 21.9 / 17.1, M=8 36.8 / 26.5 / 18.6, M=16 43.4 / 31.9 / 24.7, M=32 50.7 / 43.0 / 34.9,
M=128 123 / 122 / 113, M=512 435 / 408 / 416.

The op is built with our other CPU ops (engine.model.cpu_kernels). Where it cannot be, `available()` is False and
the engine keeps MKL/oneDNN (engine.model.linear_kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import available

__all__ = ["TILE", "TiledWeight", "available", "tiled_linear"]

TILE = 16  # output columns per tile (the kernel's layout)
PAD_TILES = 6  # N is padded to a multiple of TILE * PAD_TILES: the kernel's panels of 3 (AVX-512) or 2 (AVX2) tiles


class TiledWeight:
    """A [N, K] fp32 weight laid out as [ceil(N/96)*6, K, 16] column tiles (zero rows pad N)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features = n
        padded = -(-n // (TILE * PAD_TILES)) * TILE * PAD_TILES
        w = weight.detach().float()
        if padded != n:  # only then a padded copy: the layout's own copy is the one load pays for
            w = F.pad(w, (0, 0, 0, padded - n))
        self.tiles = w.view(padded // TILE, TILE, k).transpose(1, 2).contiguous()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.tiles.shape[1]))

    def dense(self) -> torch.Tensor:
        """The [N, K] weight back (exact)."""
        return self.tiles.transpose(1, 2).reshape(-1, self.tiles.shape[1])[: self.out_features].contiguous()


def tiled_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None,
                 avx2: bool = False) -> torch.Tensor:
    """F.linear(x, W, bias) through the tiled kernel; x [..., K] fp32. `avx2`: force the AVX2 variant (tests)."""
    out = torch.ops.sie_kernels.tiled_linear(x.reshape(-1, x.shape[-1]), weight.tiles, avx2)
    if out.shape[1] != weight.out_features:
        out = out[:, : weight.out_features].contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)

