"""The model profile: every `config.pbtxt` `parameters` key, declared once, and the one parser both sides use.

Triton stores each parameter as a string. `parse_profile` turns that dict into a typed, validated `Profile`;
an unknown key (with the closest known one suggested) or a bad value raises `ProfileError` naming the key.
The engine's Triton glue (engine/triton/model.py) refuses to load such a model; the gateway (gateway/profile.py)
does not serve it. docs/configuration.md's parameter table is checked against `PARAMETERS` by
tests/unit/test_profile_schema.py. Standard library only: the gateway and the engine both import it.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

Reader = Literal["engine", "gateway", "both"]
Kind = Literal["str", "int", "float", "bool", "csv", "json", "memory"]


class ProfileError(ValueError):
    """A profile key that is unknown, missing or holds a bad value; `key` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config.pbtxt parameter `{key}`: {message}")
        self.key = key


@dataclass(frozen=True)
class Parameter:
    name: str
    kind: Kind
    default: Any  # the typed default; None: unset (or required, below)
    read_by: Reader
    meaning: str
    minimum: float | None = None
    choices: tuple[str, ...] = ()  # for `str` the value, for `csv` each item
    required: bool = False
    doc_default: str = ""  # how docs/configuration.md writes the default, when not the plain value


_GRAMMARS = ("json_schema", "regex", "ebnf")

PARAMETERS: tuple[Parameter, ...] = (
    Parameter("hf_model", "str", None, "engine", "the model folder, under `SIE_MODEL_CACHE` unless absolute",
              required=True, doc_default="required"),
    Parameter("served_name", "str", None, "both", "the id clients send (`org/name`); the native path uses it "
              "with `__` for `/`", doc_default="the Triton model name"),
    Parameter("context_length", "int", 2048, "both", "positions a sequence may use, prompt and output together",
              minimum=1),
    Parameter("max_output_tokens", "int", 4096, "gateway", "the most tokens one request may ask for", minimum=1),
    Parameter("max_slots", "int", 64, "engine", "sequences decoded at once (n and best_of candidates each take "
              "one)", minimum=1),
    Parameter("max_queue", "int", 256, "engine", "requests waiting beyond the running ones; past it 503 "
              "`QUEUE_FULL`", minimum=1),
    Parameter("max_num_batched_tokens", "int", 1024, "engine", "tokens one step computes: a token for each decode "
              "row, the rest for prompt chunks (at least `max_slots`)", minimum=1),
    Parameter("max_num_partial_prefills", "int", 1, "engine", "prompts chunked at once; above 1 each prompt's chunk "
              "is capped at its share of the budget, so short prompts start beside a long one", minimum=1),
    Parameter("scheduling_policy", "str", "fcfs", "engine", "`fcfs`, `priority` (the request's `priority`, lower "
              "first, preempting lower ones) or `fair` (tenants share by weighted tokens served) "
              "([scheduling.md](scheduling.md))", choices=("fcfs", "priority", "fair")),
    Parameter("debug_scheduler_invariants", "bool", False, "engine", "check the scheduler's invariants (every "
              "request in one state, the KV pool's accounting) after every step; a broken one fails the engine"),
    Parameter("kv_budget_tokens", "int", None, "engine", "KV memory in positions: the paged pool that running "
              "requests' blocks and the prefix cache's idle ones share ([kv-memory.md](kv-memory.md))",
              minimum=1, doc_default="`max_slots` x `context_length`"),
    Parameter("kv_memory", "memory", None, "engine", "KV memory in bytes (`1GiB`, `512MiB`, `2000000000`) or as a "
              "fraction of the device's free memory once the weights are loaded (`0.9`); sets `kv_budget_tokens` "
              "from the model's K/V bytes a token ([kv-memory.md](kv-memory.md))", doc_default="unset"),
    Parameter("kv_cache_dtype", "str", "auto", "engine", "how K/V are stored: `auto` (the activations' dtype), "
              "`bfloat16` (half fp32's bytes a token: `kv_memory` holds twice the positions) or `int8` (a scale per "
              "position and KV head: about a quarter; [kv-memory.md](kv-memory.md))",
              choices=("auto", "bfloat16", "int8")),
    Parameter("prefix_cache_tokens", "int", 8192, "engine", "the most of that memory the prefix cache keeps; it "
              "yields to running requests (0 turns it off)",
              minimum=0),
    Parameter("kv_events_endpoint", "str", None, "engine", "ZMQ PUB endpoint (e.g. `tcp://*:5557`) for KV events in "
              "vLLM's format, topic `kv@<POD_NAME or host>@<served_name>` ([kv-memory.md](kv-memory.md))",
              doc_default="unset"),
    Parameter("kv_events_replay_endpoint", "str", None, "engine", "ZMQ ROUTER endpoint (e.g. `tcp://*:5558`) that "
              "replays buffered event batches from a sequence number", doc_default="unset"),
    Parameter("burst_window_ms", "float", 20.0, "engine", "how long an idle engine may wait to gather a burst of "
              "arrivals into its first step (0: never)", minimum=0),
    Parameter("burst_quiet_ms", "float", 3.0, "engine", "the burst is over once no request has come for this long",
              minimum=0),
    Parameter("grammar_compile_budget_s", "float", 5.0, "engine", "the longest a request waits for its grammar to "
              "compile, then 400 `grammar_invalid`", minimum=0),
    Parameter("grammar_kinds", "csv", (), "gateway", "grammar kinds the model accepts "
              "(`json_schema,regex,ebnf`)", choices=_GRAMMARS, doc_default="none"),
    Parameter("image_input", "bool", False, "gateway", "the model takes images"),
    Parameter("reasoning", "bool", False, "both", "the model writes reasoning that is split from the answer"),
    Parameter("streaming", "bool", True, "gateway", "the model may be streamed"),
    Parameter("lora_paths", "json", {}, "both", "JSON: served adapter name to folder"),
    Parameter("max_loras", "int", 8, "engine", "adapters served at once, run-time loads included "
              "([lora.md](lora.md))", minimum=1),
    Parameter("max_lora_rank", "int", 64, "engine", "the highest adapter rank a run-time load accepts "
              "([lora.md](lora.md))", minimum=1),
    Parameter("default_sampling", "json", {}, "both", "JSON: sampling defaults for requests that set none "
              "(`temperature`, `top_p`, ...)"),
    Parameter("chat_template_kwargs", "json", {}, "engine", "JSON: chat template settings that win over the "
              "request's (e.g. `enable_thinking`)"),
    Parameter("dtype", "str", "auto", "engine", "`auto`, `float32` or `bfloat16` (below)",
              choices=("auto", "float32", "bfloat16", "float16")),
    Parameter("model_impl", "str", "auto", "engine", "`auto`, `fused` or `transformers` ([models.md](models.md))",
              choices=("auto", "fused", "transformers")),
    Parameter("quantization", "str", "none", "engine", "`none`, `int8` or `int4`: the linears' weights quantized "
              "at load (int8: a scale per output column; int4: a scale and minimum per 32 weights), on our AVX-512 "
              "kernels (fused forward; [quantization.md](quantization.md))", choices=("none", "int8", "int4")),
    Parameter("chat_template", "str", None, "engine", "a template file in the model's folder, for tokenizers that "
              "have none", doc_default="the tokenizer's"),
    Parameter("stop_tokens", "csv", (), "engine", "comma-separated tokens that end a turn, with such a "
              "template", doc_default="none"),
    Parameter("cuda_graphs", "bool", True, "engine", "on a GPU, replay decode steps from captured CUDA graphs"),
    Parameter("threads", "int", None, "engine", "intra-op host threads (unset: torch's default on a CPU, "
              "`CUDA_HOST_THREADS` on a GPU)", minimum=1, doc_default="unset"),
)

BY_NAME: dict[str, Parameter] = {p.name: p for p in PARAMETERS}

# Keys Triton's Python backend itself reads from the same `parameters` (an isolated Python environment, CPU-only
# input tensors): allowed beside the profile, read by neither of our sides.
TRITON_KEYS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})


@dataclass(frozen=True)
class Profile:
    """A validated profile; one field per entry of PARAMETERS (tests/unit/test_profile_schema.py holds them equal)."""

    hf_model: str | None
    served_name: str | None
    context_length: int
    max_output_tokens: int
    max_slots: int
    max_queue: int
    max_num_batched_tokens: int
    max_num_partial_prefills: int
    scheduling_policy: str
    debug_scheduler_invariants: bool
    kv_budget_tokens: int | None
    kv_memory: int | float | None
    kv_cache_dtype: str
    prefix_cache_tokens: int
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    burst_window_ms: float
    burst_quiet_ms: float
    grammar_compile_budget_s: float
    grammar_kinds: tuple[str, ...]
    image_input: bool
    reasoning: bool
    streaming: bool
    lora_paths: dict[str, str]
    max_loras: int
    max_lora_rank: int
    default_sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    dtype: str
    model_impl: str
    quantization: str
    chat_template: str | None
    stop_tokens: tuple[str, ...]
    cuda_graphs: bool
    threads: int | None


def parse_profile(raw: Mapping[str, str], reader: Reader = "both") -> Profile:
    """Typed, validated profile from a config's `parameters` (string values, as Triton stores them).

    An empty string means the default. `reader` says who asks: a key required by the other side only may be absent.
    """
    for key in raw:
        if key not in BY_NAME and key not in TRITON_KEYS:
            close = difflib.get_close_matches(key, BY_NAME, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ProfileError(key, f"unknown key{hint}")
    values = {p.name: _value(p, raw.get(p.name, ""), reader) for p in PARAMETERS}
    return Profile(**values)


def _value(p: Parameter, text: str, reader: Reader) -> Any:
    if not isinstance(text, str):
        raise ProfileError(p.name, f"must be a string, not {type(text).__name__}")
    text = text.strip()
    if not text:
        if p.required and (reader == "both" or p.read_by in (reader, "both")):
            raise ProfileError(p.name, "is required")
        return p.default
    if p.kind == "str":
        if p.choices and text not in p.choices:
            raise ProfileError(p.name, f"{text!r} is not one of {', '.join(p.choices)}")
        return text
    if p.kind in ("int", "float"):
        try:
            number: float = int(text) if p.kind == "int" else float(text)
        except ValueError:
            raise ProfileError(p.name, f"{text!r} is not {'an integer' if p.kind == 'int' else 'a number'}") from None
        if number != number or (p.minimum is not None and number < p.minimum):  # NaN, or below the bound
            raise ProfileError(p.name, f"{text} is below the minimum {p.minimum:g}" if number == number
                               else "is not a number")
        return number
    if p.kind == "memory":
        return memory_value(p.name, text)
    if p.kind == "bool":
        if text.lower() not in ("true", "false"):
            raise ProfileError(p.name, f"{text!r} is not true or false")
        return text.lower() == "true"
    if p.kind == "csv":
        items = tuple(i.strip() for i in text.split(",") if i.strip())
        bad = [i for i in items if p.choices and i not in p.choices]
        if bad:
            raise ProfileError(p.name, f"{bad[0]!r} is not one of {', '.join(p.choices)}")
        return items
    try:  # json: an object
        value = json.loads(text)
    except ValueError:
        raise ProfileError(p.name, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise ProfileError(p.name, "must be a JSON object")
    if p.name == "lora_paths" and not all(isinstance(v, str) for v in value.values()):
        raise ProfileError(p.name, "must map each adapter name to a folder (a string)")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def memory_value(key: str, text: str) -> int | float:
    """Bytes (an int: `1GiB`, `512MB`, `2000000000`, at least 1 MiB), or a fraction of free memory (a float in
    (0, 1] written with a decimal point: `0.9`)."""
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ProfileError(key, f"{text!r} is neither bytes (`1GiB`, `512MiB`) nor a fraction of free memory (`0.9`)")
    number = float(match.group(1))
    if "." in match.group(1) and not unit:
        if not 0 < number <= 1:
            raise ProfileError(key, f"{text} is not a fraction in (0, 1]")
        return number
    size = int(number * _UNITS[unit])
    if size < 2**20:
        raise ProfileError(key, f"{text} is under 1 MiB")
    return size


def field_names() -> list[str]:
    """The Profile's fields, in order (for the schema test)."""
    return [f.name for f in fields(Profile)]


def _doc_default(p: Parameter) -> str:
    if p.doc_default:
        return p.doc_default
    if isinstance(p.default, bool):
        return f"`{str(p.default).lower()}`"
    if isinstance(p.default, (int, float)):
        return f"{p.default:g}"
    return f"`{json.dumps(p.default) if isinstance(p.default, dict) else p.default}`"


def doc_table() -> str:
    """The parameter table of docs/configuration.md, as tests/unit/test_profile_schema.py expects it."""
    rows = ["| parameter | default | read by | meaning |", "|---|---|---|---|"]
    rows += [f"| `{p.name}` | {_doc_default(p)} | {p.read_by} | {p.meaning} |" for p in PARAMETERS]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m contract.profile: the table to paste into docs/configuration.md
    print(doc_table())
