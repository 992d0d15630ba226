"""Our CPU linear (engine/model/kernels/tiled_linear.cpp, fp32; tiled_linear_bf16.cpp, bf16 on AVX512_BF16/AMX;
tiled_linear_int8.cpp, int8 weights with a scale per output column on AVX-512, the profile's `quantization: int8`):
weights laid out once as column tiles, one kernel for every row count, so a row's output is bit-identical alone,
in any batch, in prefill or decode.

Why: decode multiplies 1-128 rows by every weight, and there MKL and oneDNN read the weights at 10-25 GB/s; the
tiled kernel keeps 48 output columns x up to 8 rows in registers and streams each weight once per 8 rows. On the
2-core Xeon (AVX-512, 480 MB L3), SmolLM2's 120 layer linears per pass, best of 5, ms, MKL's F.linear / prepacked
oneDNN / tiled: M=1 17.7 / 21.9 / 17.1, M=8 36.8 / 26.5 / 18.6, M=16 43.4 / 31.9 / 24.7, M=32 50.7 / 43.0 / 34.9,
M=128 123 / 122 / 113, M=512 435 / 408 / 416.

bf16 weights (the `dtype: bfloat16` profile) run on AMX tiles where the CPU has AMX (vdpbf16ps for a K that is not a
multiple of 32), on vdpbf16ps where it has AVX512_BF16 alone (`runs`), and take fp32 or bf16 rows: SmolLM2's 120
linears at M = 1 / 8 / 16 / 512, 5.7 / 8.3 / 7.7 / 81 ms on AMX, against prepacked oneDNN bf16's 7.1 / 10.2 / 11.4 /
74 (and the fp32 kernel's 9.1 / 13.0 / 19.2 / 363, same box and day).

The op is built with our other CPU ops (engine.model.cpu_kernels). Where it cannot be, `available()` is False and
the engine keeps MKL/oneDNN (engine.model.linear_kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import available

__all__ = ["TILE", "Int4TiledWeight", "TiledWeight", "available", "runs", "tiled_linear"]

TILE = 16  # output columns per tile (the kernel's layout)
PAD_TILES = 6  # N is padded to a multiple of TILE * PAD_TILES: the kernel's panels of 3 (AVX-512) or 2 (AVX2) tiles


def runs(dtype: torch.dtype) -> bool:
    """Whether the tiled kernel runs `dtype` weights here: fp32 wherever our ops build, bf16 where the CPU also has
    AVX512_BF16 (on AMX tiles where it has AMX, else vdpbf16ps). On the AMX Xeon oneDNN's AMX GEMMs ran prefill
    7x faster than vdpbf16ps, but there our kernel has AMX too; on the AVX-512 EPYC (no AMX) oneDNN's bf16 runs
    the same vdpbf16ps, and our kernel ran SmolLM2's 120 linears at 1 / 8 / 16 / 512 rows in 9.9-11.6 / 10.8-11.5 /
    13.9-16.5 / 290-302 ms against oneDNN's 16.6 / 13.9 / 18.5 / 278, with rows that never depend on their batch."""
    if dtype == torch.float32:
        return available()
    if dtype in (torch.int8, torch.uint8):  # int8, and 4 bits two a byte (Int4TiledWeight)
        return available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return dtype == torch.bfloat16 and available() and torch.ops.sie_kernels.has_avx512_bf16()


class TiledWeight:
    """A [N, K] weight laid out as column tiles, zero rows padding N to a multiple of 96: fp32 as
    [N/16, K, 16]; bf16 as [N/16, K/2, 32], each k pair of a tile's 16 columns interleaved (column c's k, k+1 side
    by side), what one AMX B-tile row or `vdpbf16ps` multiplies; an odd K gets a zero column. One layout rule for
    both: [N/16, K/pair, 16, pair] with pair 1 (fp32, int8) or 2 (bf16). int8 tiles (`TiledWeight.int8`) carry
    `scales`, one fp32 a column."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        kept = weight.dtype in (torch.bfloat16, torch.int8)
        w = weight.detach() if kept else weight.detach().float()
        pair = 2 if w.dtype == torch.bfloat16 else 1
        padded_n = -(-n // (TILE * PAD_TILES)) * TILE * PAD_TILES
        padded_k = -(-k // pair) * pair
        if (padded_n, padded_k) != (n, k):  # only then a padded copy: the layout's own copy is the one load pays for
            w = F.pad(w, (0, padded_k - k, 0, padded_n - n))
        self.tiles = w.view(padded_n // TILE, TILE, padded_k // pair, pair).transpose(1, 2).contiguous().view(
            padded_n // TILE, padded_k // pair, pair * TILE)
        self.scales = None if scales is None else F.pad(scales.float(), (0, padded_n - n)).contiguous()

    @classmethod
    def int8(cls, weight: torch.Tensor) -> TiledWeight:
        """Symmetric int8 with one scale per output column (the largest magnitude of its row maps to 127), as
        vLLM's and TensorRT-LLM's weight-only int8 quantize: within 0.4 % of a column's largest weight, where
        groups of 32-128 would be needed at 4 bits."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(quantized, scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.tiles.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def dense(self) -> torch.Tensor:
        """The [N, K] weight back (exact; int8 weights de-quantized to fp32)."""
        tiles, pair = self.tiles, 2 if self.dtype == torch.bfloat16 else 1
        groups, steps = tiles.shape[:2]
        dense = tiles.view(groups, steps, TILE, pair).transpose(1, 2).reshape(groups * TILE, steps * pair)
        if self.scales is not None:
            dense = dense.float() * self.scales[:, None]
        return dense[: self.out_features, : self.in_features].contiguous()


class Int4TiledWeight(TiledWeight):
    """A [N, K] weight at 4 bits in groups of 32 along K, each group of a column with an fp16 scale and minimum
    (w = q * scale + min, q in 0..15: GGUF Q4_1's arithmetic, 5 bits a weight with the scales), laid out as the int4
    kernel reads it (engine/model/kernels/tiled_linear_int4.cpp): `tiles` [N/16, K/2, 16] uint8, a column's k and
    k + 1 in one byte's low and high nibble; `group_scales` and `group_mins` [N/16, K/32, 16] fp16. N is padded to
    a multiple of 96 and K to one of 32, with zeros."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor) -> None:  # its own layout: not TiledWeight's
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        padded_n = -(-n // (TILE * PAD_TILES)) * TILE * PAD_TILES
        padded_k = -(-k // self.GROUP) * self.GROUP
        w = F.pad(weight.detach().float(), (0, padded_k - k, 0, padded_n - n))
        groups = w.view(padded_n, padded_k // self.GROUP, self.GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        mins = low.half()
        scales = ((high - mins.float()) / 15).half()  # the rounded values are the ones the kernel multiplies
        step = torch.where(scales.float() > 0, scales.float(), torch.ones_like(low))
        q = torch.round((groups - mins.float()[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(padded_n, padded_k)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        self.tiles = packed.view(padded_n // TILE, TILE, padded_k // 2).transpose(1, 2).contiguous()
        self.scales = None  # TiledWeight's one scale a column: none here
        self.group_scales = scales.view(padded_n // TILE, TILE, -1).transpose(1, 2).contiguous()
        self.group_mins = mins.view(padded_n // TILE, TILE, -1).transpose(1, 2).contiguous()

    def dense(self) -> torch.Tensor:
        """The de-quantized [N, K] weight, fp32."""
        packed = self.tiles.transpose(1, 2).reshape(-1, self.tiles.shape[1])
        q = torch.stack((packed & 0xF, packed >> 4), dim=2).view(packed.shape[0], -1).float()
        scales, mins = (t.transpose(1, 2).reshape(packed.shape[0], -1).float()
                        for t in (self.group_scales, self.group_mins))
        groups = q.view(q.shape[0], -1, self.GROUP) * scales[..., None] + mins[..., None]
        return groups.view(q.shape)[: self.out_features, : self.in_features].contiguous()


def tiled_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None,
                 avx2: bool = False, amx: bool = True) -> torch.Tensor:
    """F.linear(x, W, bias) through the tiled kernel; x [..., K]. fp32 weights take fp32 x. bf16 weights take bf16
    or fp32 x (rounded to bf16 as it is read), and the result is in x's dtype: fp32 x gets the fp32 accumulators
    unrounded. int8 and 4-bit weights take and give fp32. `avx2`: force the fp32 kernel's AVX2 variant;
    `amx=False`: the bf16 kernel's vdpbf16ps variant where the CPU has AMX (tests)."""
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(weight, Int4TiledWeight):
        padded_k = weight.tiles.shape[1] * 2
        if padded_k != weight.in_features:  # zeros: no term, no share of a group's sum (no copy when none is needed)
            rows = F.pad(rows.float(), (0, padded_k - weight.in_features))
        out = torch.ops.sie_kernels.tiled_linear_int4(rows, weight.tiles, weight.group_scales, weight.group_mins)
    elif weight.dtype == torch.int8:
        out = torch.ops.sie_kernels.tiled_linear_int8(rows.float(), weight.tiles, weight.scales)
    elif weight.dtype == torch.bfloat16:
        if weight.in_features % 2:
            rows = F.pad(rows, (0, 1))
        out = torch.ops.sie_kernels.tiled_linear_bf16(rows, weight.tiles, x.dtype == torch.float32, amx)
    else:
        out = torch.ops.sie_kernels.tiled_linear(rows, weight.tiles, avx2)
    if out.shape[1] != weight.out_features:
        out = out[:, : weight.out_features].contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)

