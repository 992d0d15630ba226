"""LoRA adapters on the transformers model path: peft's LoRA layers in the HF modules, chosen per packed token.

peft loads every adapter into the model (`PeftModel.from_pretrained`, then `load_adapter`), which swaps each
targeted module for a peft LoRA layer around the original (`base_layer`). peft's own mixed-adapter batches pass
`adapter_names` (one per batch row, "__base__" for none) to each LoRA layer's forward. Our forward packs every
row's tokens into one batch row ([1, N]), so each LoRA layer's forward is re-pointed here: during a forward that has
adapter rows, it calls peft's forward on the N packed tokens as N batch rows with their tokens' adapter names
(peft's `_mixed_batch_forward`: the base layer on every token, then each adapter's delta on its own tokens only);
otherwise it calls the base layer alone.

What this does to the prepacked oneDNN linears (`use_linear_kind`): nothing on the base weights. Each base linear
keeps its packed forward and peft calls it as `base_layer`; only the low-rank lora_A/lora_B run on plain F.linear,
and only for the tokens of rows on an adapter. Adapters are never merged into the weights (the packed copies would
go stale). A step with no adapter rows pays one extra module call per targeted linear and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

BASE = "__base__"  # peft's adapter name for rows on the base model


class AdapterRows:
    """The adapter name of each packed token of the forward in flight; None outside forwards with adapter rows."""

    def __init__(self) -> None:
        self.names: list[str] | None = None

    @contextlib.contextmanager
    def using(self, names: list[str] | None) -> Iterator[None]:
        self.names = names
        try:
            yield
        finally:
            self.names = None


@dataclass
class PeftAdapter:
    """A served adapter on the transformers path: its weights live in the model's peft LoRA layers."""

    path: str
    layers: int  # LoRA layers it adds to the model


def _row_forward(layer: Any, rows: AdapterRows) -> None:  # a peft LoRA layer (BaseTunerLayer)
    peft_forward, base = layer.forward, layer.get_base_layer()

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        names = rows.names
        if names is None:  # no adapter rows in this forward: the base module alone, as without adapters
            return base(x, *args, **kwargs)
        # [1, N, ...] packed tokens -> N rows of peft's mixed batch, one adapter name each
        return peft_forward(x[0], *args, adapter_names=names, **kwargs)[None]

    layer.forward = forward


def _refuse(name: str, path: str, reason: str) -> ValueError:
    return ValueError(f"LoRA adapter '{name}' ({path}) cannot be served on this model: {reason}")


def _check_config(name: str, path: str) -> None:
    from peft import PeftConfig

    try:
        config = PeftConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise _refuse(name, path, f"no readable adapter_config.json ({exc})") from exc
    if config.peft_type != "LORA":
        raise _refuse(name, path, f"peft_type {config.peft_type} (only LoRA is served)")
    if getattr(config, "use_dora", False):
        raise _refuse(name, path, "use_dora (peft's mixed-adapter batches do not support DoRA)")
    if getattr(config, "modules_to_save", None):
        raise _refuse(name, path, f"modules_to_save {sorted(config.modules_to_save)} (full module copies are not "
                                  "served per row)")


def _check_weights_fit(peft_model, name: str, path: str) -> None:
    """The adapter's saved tensors are exactly the LoRA tensors peft made for it in this model: nothing left
    unloaded (a layer this model lacks) and nothing left at its initial value (a layer the file lacks)."""
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    saved = set(load_peft_weights(path, device="cpu"))
    expected = set(get_peft_model_state_dict(peft_model, adapter_name=name))
    for problem, keys in (("weights for modules this model does not have", saved - expected),
                          ("no weights for modules it targets", expected - saved)):
        if keys:
            raise _refuse(name, path, f"{problem}: {', '.join(sorted(keys)[:3])}"
                                      f"{f' and {len(keys) - 3} more' if len(keys) > 3 else ''}")


def add_peft_adapter(hf_model: torch.nn.Module, head: torch.nn.Module, rows: AdapterRows, peft_model: Any,
                     name: str, path: str) -> tuple[Any, PeftAdapter]:
    """Load one adapter into `hf_model` with peft (wrapping it on the first), its LoRA layers chosen per token
    through `rows`; returns the peft model and the adapter. A refused adapter is taken out again."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    _check_config(name, path)
    try:
        if peft_model is None:
            peft_model = PeftModel.from_pretrained(hf_model, path, adapter_name=name)
        else:
            peft_model.load_adapter(path, adapter_name=name)
    except (ValueError, RuntimeError, KeyError) as exc:  # target modules not found, size mismatch
        raise _refuse(name, path, str(exc).strip().splitlines()[0]) from exc
    peft_model.eval()  # no LoRA dropout
    targeted = {module_name: m for module_name, m in hf_model.named_modules() if isinstance(m, BaseTunerLayer)}
    try:
        _check_weights_fit(peft_model, name, path)
        for module_name, layer in targeted.items():
            if layer.get_base_layer() is head and name in getattr(layer, "lora_A", {}):
                raise _refuse(name, path, f"it targets the LM head ({module_name}), which this path runs "
                                          "outside the per-row forward")
    except ValueError:
        remove_peft_adapter(peft_model, name)  # the caller keeps its peft model (or None) from before
        raise
    for layer in targeted.values():
        if not getattr(layer, "_sie_rows", False):  # a layer this adapter added: choose its rows per token
            _row_forward(layer, rows)
            layer._sie_rows = True  # type: ignore[attr-defined]
    return peft_model, PeftAdapter(path, sum(name in getattr(m, "lora_A", {}) for m in targeted.values()))


def remove_peft_adapter(peft_model: Any, name: str) -> Any:
    """Take adapter `name` out of the model; returns the peft model, or None once no adapter is left (peft's
    layers are unwrapped then, and the next adapter wraps the model anew)."""
    if set(peft_model.peft_config) <= {name}:
        peft_model.unload()  # the base modules back in place (the packed linears themselves)
        return None
    peft_model.delete_adapter(name)  # peft also makes another adapter its active one
    return peft_model


def load_peft_adapters(hf_model: torch.nn.Module, head: torch.nn.Module, rows: AdapterRows,
                       paths: dict[str, str]) -> tuple[Any, dict[str, PeftAdapter]]:
    """Load every adapter into `hf_model` with peft, its LoRA layers chosen per token through `rows`; returns the
    peft model (None without adapters) and the adapters.

    An adapter that does not fit the model (target modules it lacks, other shapes, weights for other layers) or
    that this path cannot serve per row is refused here, by name. `head`: the LM head the decoder calls itself,
    outside the per-row forward, so an adapter may not target it."""
    peft_model = None
    adapters: dict[str, PeftAdapter] = {}
    for name, path in paths.items():
        peft_model, adapters[name] = add_peft_adapter(hf_model, head, rows, peft_model, name, path)
    return peft_model, adapters
