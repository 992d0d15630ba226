"""LoRA adapters for the lean forward: loaded with peft, applied per row so mixed batches share a step.

peft loads and validates each adapter (config, target modules, scaling); we then lift its A/B
matrices out and add `scale * (x @ A^T) @ B^T` to the rows that selected that adapter. Requests on
different adapters and on the base model run in the same decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.staging import stage

# module name -> (fused weight it lives in, index of its slice there)
_FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "o_proj": ("o_proj", 0), "down_proj": ("down", 0)}


@dataclass
class LoraDelta:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.t()) @ self.b.t() * self.scale


# adapter -> layer -> fused weight name -> [(slice index, delta)]
AdapterTable = dict[str, list[dict[str, list[tuple[int, LoraDelta]]]]]


def load_adapters(hf_model: torch.nn.Module, paths: dict[str, str]) -> AdapterTable:
    """Load every adapter with peft and return its per-layer deltas; the base model is left unchanged."""
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
        for owner in (layer.self_attn, layer.mlp):
            for module_name, (fused, index) in _FUSED.items():
                module = getattr(owner, module_name, None)
                if module is None or not hasattr(module, "lora_A"):
                    continue
                for name in names:
                    if name in module.lora_A:
                        # in the model's dtype and on its device (peft may keep adapters in fp32)
                        a, b = (m[name].weight.detach().to(base.device, base.dtype).clone()
                                for m in (module.lora_A, module.lora_B))
                        delta = LoraDelta(a, b, float(module.scaling[name]))
                        table[name][i].setdefault(fused, []).append((index, delta))
    peft_model.unload()  # restore the plain modules; our forward holds its own fused weights
    return table


class LoraBatch:
    """Which rows of a step use which adapter (rows without one run the base model)."""

    def __init__(self, table: AdapterTable, row_adapters: list[str | None], device: torch.device | str = "cpu") -> None:
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(row_adapters):
            if name is not None:
                groups.setdefault(name, []).append(row)
        self.groups: list[tuple[torch.Tensor | slice, list]] = []
        for name, rows in groups.items():
            # every row on one adapter (a single prompt's chunk): a plain slice, no gather/scatter
            index = slice(None) if len(rows) == len(row_adapters) else stage(rows, torch.long, device)
            self.groups.append((index, table[name]))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """out += per-row LoRA deltas of `fused` (whose output is split into `splits` column blocks)."""
        offsets = [sum(splits[:i]) for i in range(len(splits))]
        for rows, adapter in self.groups:
            for index, delta in adapter[layer].get(fused, []):
                start = offsets[index]
                out[rows, start : start + splits[index]] += delta(x[rows])
        return out
