"""Runtime LoRA: load and unload adapters while the engine serves (vLLM's /v1/load_lora_adapter, docs/lora.md).

A load checks the folder and reads the weights on the caller's thread, off the engine loop: an
adapter_config.json, LoRA only, no DoRA, a rank within the profile's `max_lora_rank`, and every saved LoRA
matrix fitting the module it targets in this model (an adapter for another base model fails here, by shape).
The fused path builds its deltas there too. The adapter table changes only between steps, on the loop thread
(`between_steps`), never mid-step; the transformers path puts peft's LoRA layers into the modules then.

Served name -> table key: the first load of a name is keyed by the name; the same name loaded again after an
unload gets a new key (`name#2`, ...), so the prefix cache, whose blocks are keyed by the adapter, never serves
K/V computed with the old weights.

Policies: a full table (`max_loras`) refuses the load (409 lora_capacity_exceeded) rather than evicting an adapter
clients may be using; an unload while requests use the adapter is refused (409 lora_adapter_in_use).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.errors import EngineError
from engine.model.lora import load_adapters

T = TypeVar("T")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int = 8  # adapters served at once, the profile's own included
    max_lora_rank: int = 64


def _bad(param: str, message: str) -> EngineError:
    return EngineError("invalid_request", message, param)


def read_adapter_config(path: str, limits: LoraLimits) -> dict[str, Any]:
    """The adapter's config, or a 400 naming `lora_path` that says what is wrong with the folder."""
    if not path:
        raise _bad("lora_path", "lora_path is required")
    folder = Path(path)
    if not folder.is_dir():
        raise _bad("lora_path", f"no adapter folder at '{path}'")
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except OSError:
        raise _bad("lora_path", f"'{path}' is not a LoRA adapter (no adapter_config.json)") from None
    except ValueError:
        raise _bad("lora_path", f"'{path}': adapter_config.json is not JSON") from None
    if not isinstance(config, dict):
        raise _bad("lora_path", f"'{path}': adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad("lora_path", f"'{path}' is a {config.get('peft_type')} adapter; only LoRA is served")
    if config.get("use_dora"):
        raise _bad("lora_path", f"'{path}' is a DoRA adapter (use_dora); DoRA is not served")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    try:
        rank = max(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise _bad("lora_path", f"'{path}': the adapter's rank r is not a number") from None
    if rank > limits.max_lora_rank:
        raise _bad("lora_path", f"'{path}' has rank {rank}, over this model's max_lora_rank {limits.max_lora_rank}")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise _bad("lora_path", f"'{path}' has no adapter weights ({' or '.join(WEIGHT_FILES)})")
    return config


def check_fits_model(model: torch.nn.Module, path: str) -> None:
    """Every saved LoRA matrix targets a module this model has, with its shapes: an adapter trained on another
    base model is refused by name of the first module that does not fit."""
    from peft.utils import load_peft_weights

    try:
        weights = load_peft_weights(path, device="cpu")
    except Exception as exc:  # a truncated or foreign file: the client's folder, not our fault
        raise _bad("lora_path", f"'{path}': the adapter weights cannot be read ({type(exc).__name__})") from None
    for key, tensor in weights.items():
        side = "A" if ".lora_A." in key else "B" if ".lora_B." in key else None
        if side is None:
            continue
        module_name = key.removeprefix("base_model.model.").rsplit(f".lora_{side}.", 1)[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise _bad("lora_path", f"'{path}' targets {module_name}, which this base model does not have "
                                    "(an adapter for another base model?)") from None
        want = getattr(module, "in_features" if side == "A" else "out_features", None)
        got = tensor.shape[-1] if side == "A" else tensor.shape[0]
        if want is not None and got != want:
            raise _bad("lora_path", f"'{path}' does not fit this base model: {module_name} has "
                                    f"{'in' if side == 'A' else 'out'}_features {want}, the adapter {got} "
                                    "(an adapter for another base model?)")


class LoraRuntime:
    """The served adapters by name, loaded and unloaded at run time. `between_steps(fn)` runs `fn` on the engine
    loop between two steps and returns its result; `users(key)` counts the requests in flight on a table key."""

    def __init__(self, runner, model: torch.nn.Module, fused: bool, limits: LoraLimits,
                 between_steps: Callable[[Callable[[], Any]], Any], users: Callable[[str], int]) -> None:
        self.runner, self.model, self.fused, self.limits = runner, model, fused, limits
        self._between_steps, self._users = between_steps, users
        self.keys: dict[str, str] = {name: name for name in runner.adapters}  # served name -> table key
        self._loads: dict[str, int] = dict.fromkeys(self.keys, 1)  # times each name was loaded
        self._lock = threading.Lock()  # one change at a time (peft wraps the HF modules while it loads)
        if len(self.keys) > limits.max_loras:
            raise ValueError(f"the profile serves {len(self.keys)} LoRA adapters, over max_loras {limits.max_loras}")

    def names(self) -> list[str]:
        return sorted(self.keys)

    def key(self, name: str) -> str | None:
        """The adapter table's key for a served name (None: not loaded)."""
        return self.keys.get(name)

    def name_of(self, key: str) -> str:
        """The served name of a table key (itself when unknown)."""
        return next((name for name, k in self.keys.items() if k == key), key)

    def load(self, name: str, path: str) -> list[str]:
        """Load `path` as adapter `name`; returns the adapters served after. Raises EngineError (400/409)."""
        if not name:
            raise _bad("lora_name", "lora_name is required")
        with self._lock:
            if name in self.keys:
                raise _bad("lora_name", f"The lora adapter '{name}' has already been loaded.")
            if len(self.keys) >= self.limits.max_loras:
                raise EngineError("lora_capacity_exceeded",
                                  f"this model already serves max_loras={self.limits.max_loras} LoRA adapters; "
                                  "unload one first", "lora_name")
            read_adapter_config(path, self.limits)
            check_fits_model(self.model, path)
            times = self._loads.get(name, 0)
            key = name if times == 0 else f"{name}#{times + 1}"
            if self.fused:
                try:
                    entry = load_adapters(self.model, {key: path}, self.runner.decoder.dtype)[key]
                except (ValueError, RuntimeError, KeyError, OSError) as exc:
                    raise _bad("lora_path", f"'{path}' cannot be served: {str(exc).strip()[:200]}") from None
                self._between_steps(lambda: self.runner.adapters.__setitem__(key, entry))
            else:
                self._between_steps(lambda: self._add_peft(key, path))
            self.keys[name] = key
            self._loads[name] = times + 1
            return self.names()

    def _add_peft(self, key: str, path: str) -> None:
        try:
            self.runner.adapters[key] = self.runner.decoder.add_adapter(key, path)
        except ValueError as exc:  # peft refused it (engine.model.transformers_lora)
            raise _bad("lora_path", str(exc)) from None

    def unload(self, name: str) -> list[str]:
        """Stop serving adapter `name`; returns the adapters served after. 400 when it is not loaded, 409 while
        requests in flight use it (checked on the loop, so no request is admitted on it in between)."""
        if not name:
            raise _bad("lora_name", "lora_name is required")
        with self._lock:
            key = self.keys.get(name)
            if key is None:
                raise EngineError("unknown_lora_adapter", f"The lora adapter '{name}' is not loaded.", "lora_name")

            def drop() -> None:
                users = self._users(key)
                if users:
                    raise EngineError("lora_adapter_in_use", f"The lora adapter '{name}' is in use by {users} "
                                      "request(s); unload it once they have finished", "lora_name")
                del self.runner.adapters[key]
                if not self.fused:
                    self.runner.decoder.remove_adapter(key)

            self._between_steps(drop)
            del self.keys[name]
            return self.names()


def requests_info(scheduler, lora: LoraRuntime, max_loras: int) -> dict[str, str]:
    """vLLM's lora_requests_info labels: max_lora, and the adapters of the running and of the waiting requests
    (comma-separated served names, sorted). Read from the metrics thread: a list the loop changes meanwhile is
    read again."""
    running: list[Any] = []
    waiting: list[Any] = []
    for _ in range(3):
        try:
            running = [s.group for s in list(scheduler.running)]
            waiting = [s.group for s in scheduler.waiting]
            break
        except RuntimeError:
            continue

    def names(groups: list[Any]) -> str:
        keys = {g.params.lora_adapter for g in groups if g.params.lora_adapter}
        return ",".join(sorted(lora.name_of(k) for k in keys))

    return {"max_lora": str(max_loras), "running_lora_adapters": names(running),
            "waiting_lora_adapters": names(waiting)}
