"""LoRA adapters for the lean forward: loaded with peft, applied per row so mixed batches share a step.

peft loads and validates each adapter (config, target modules, scaling); we then lift its A/B
matrices out and add `scale * (x @ A^T) @ B^T` to the rows that selected that adapter. Requests on
different adapters and on the base model run in the same decode step.

Each fused weight of a layer (q/k/v, gate/up) gets one delta per adapter: its slices' A matrices stacked, and
their B matrices block-diagonal with the scale folded in, so a delta is one call however many slices it covers
(the zero blocks add exact zeros). In fp32 on the CPU that call is our kernel (kernels/lora_add.cpp); elsewhere
two matmuls and an add. Per slice in torch, LoRA rows ran ~23 % slower than base rows at 8 concurrent (2-core
box), for a few MFLOP of work: ~1,000 tiny ops a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import cpu_kernels
from engine.staging import stage

# fused weight of our forward -> (HF block that owns its slices, the slices' module names in column order)
_FUSED = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
          "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}


@dataclass
class LoraDelta:
    """One adapter's LoRA on one fused weight: out += (x @ a^T) @ b_t."""

    a: torch.Tensor  # [R, in]: the slices' A matrices stacked (R: the sum of their ranks)
    b_t: torch.Tensor  # [R, out]: scale * B^T of each slice in its own rows and column block, zeros elsewhere
    native: bool  # our kernel (engine/model/kernels/lora_add.cpp): fp32 on the CPU, where it is built

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        """out[rows] += the delta of x[rows], in place; every row when `rows` is None."""
        if self.native:
            torch.ops.sie_kernels.lora_add_(out, x, rows, self.a, self.b_t)
        elif rows is None:
            out += (x @ self.a.t()) @ self.b_t
        else:
            out.index_add_(0, rows, (x[rows] @ self.a.t()) @ self.b_t)


# adapter -> layer -> fused weight name -> its delta
AdapterTable = dict[str, list[dict[str, LoraDelta]]]


def _stack(slices: list[tuple[int, torch.Tensor, torch.Tensor, float]], widths: list[int]) -> LoraDelta:
    """One delta from (slice index, A [r, in], B [width, r], scale) of the slices an adapter targets."""
    a = torch.cat([a for _, a, _, _ in slices])
    b_t = a.new_zeros(a.shape[0], sum(widths))
    rank_at = 0
    for index, a_slice, b, scale in slices:
        col = sum(widths[:index])
        b_t[rank_at : rank_at + a_slice.shape[0], col : col + widths[index]] = b.t() * scale
        rank_at += a_slice.shape[0]
    native = (a.dtype == torch.float32 and a.device.type == "cpu" and a.shape[1] % 16 == 0
              and b_t.shape[1] % 16 == 0 and cpu_kernels.available())
    return LoraDelta(a, b_t, native)


def load_adapters(hf_model: torch.nn.Module, paths: dict[str, str], dtype: torch.dtype | None = None) -> AdapterTable:
    """Load every adapter with peft and return its per-layer deltas, in `dtype` (the forward's activations; default
    the model's); the base model is left unchanged."""
    if not paths:
        return {}
    from peft import PeftModel

    names = list(paths)
    peft_model = PeftModel.from_pretrained(hf_model, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(paths[name], adapter_name=name)
    layers = peft_model.base_model.model.model.layers
    base = next(hf_model.parameters())
    table: AdapterTable = {name: [dict() for _ in layers] for name in names}
    for i, layer in enumerate(layers):
        for fused, (owner_name, module_names) in _FUSED.items():
            modules = [getattr(getattr(layer, owner_name), m, None) for m in module_names]
            if any(m is None for m in modules):
                continue  # not the layout the fused forward reads
            widths = [m.out_features for m in modules]
            for name in names:
                # in the activations' dtype and on the model's device (peft may keep adapters in fp32)
                slices = [(index, *(w[name].weight.detach().to(base.device, dtype or base.dtype)
                                    for w in (m.lora_A, m.lora_B)),
                           float(m.scaling[name]))
                          for index, m in enumerate(modules) if hasattr(m, "lora_A") and name in m.lora_A]
                if slices:
                    table[name][i][fused] = _stack(slices, widths)
    peft_model.unload()  # restore the plain modules; our forward holds its own fused weights
    return table


class LoraBatch:
    """Which rows of a step use which adapter (rows without one run the base model)."""

    def __init__(self, table: AdapterTable, row_adapters: list[str | None], device: torch.device | str = "cpu") -> None:
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(row_adapters):
            if name is not None:
                groups.setdefault(name, []).append(row)
        self.groups: list[tuple[torch.Tensor | None, list[dict[str, LoraDelta]]]] = []
        for name, rows in groups.items():
            # every row on one adapter (a single prompt's chunk): no row index at all
            index = None if len(rows) == len(row_adapters) else stage(rows, torch.long, device)
            self.groups.append((index, table[name]))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each row's adapter delta on the fused weight `fused` (its output columns in their fused order)."""
        for rows, adapter in self.groups:
            delta = adapter[layer].get(fused)
            if delta is not None:
                delta.add_to(out, x, rows)
        return out
