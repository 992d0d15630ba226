"""`/v1/responses` `input`: a string, or items (messages, function calls and their outputs, reasoning).

Items become the wire-neutral chat messages the engine renders (docs/triton-contract.md `messages`):
a `function_call` joins the assistant turn before it as a `tool_calls` entry (OpenAI chat's replay shape),
a `function_call_output` becomes a `tool` message, and a replayed `reasoning` item rides on the next
assistant turn as `reasoning_content`, where chat templates of reasoning models look for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.contracts.common import UNSUPPORTED, violation
from gateway.contracts.images import MAX_IMAGES, ImageRejected, decode_data_uri
from gateway.domain import ImageInput

ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}

INPUT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
            "role": {"enum": list(ROLES)},
        }}},
    ]
}


@dataclass
class ParsedInput:
    """`input` as wire messages, the images in the order written, and the call ids it defines/answers."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)
    image_param: str | None = None
    image_data_params: list[str] = field(default_factory=list)
    call_ids: dict[str, int] = field(default_factory=dict)  # call_id -> item index of its function_call
    outputs: dict[str, int] = field(default_factory=dict)  # call_id -> item index of its output


def parse_input(value: Any) -> ParsedInput:
    """Validate `input` (string or items) into messages; raises `violation` with the item's path."""
    parsed = ParsedInput()
    if isinstance(value, str):
        if not value:
            raise violation("must be a non-empty string or an array of input items")
        parsed.messages.append({"role": "user", "content": value})
        return parsed
    if not isinstance(value, list) or not value:
        raise violation("must be a non-empty string or a non-empty array of input items")
    pending_reasoning: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise violation("must be an object", i)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, i, parsed)
            if message["role"] == "assistant" and pending_reasoning:
                message["reasoning_content"] = "".join(pending_reasoning)
                pending_reasoning.clear()
            parsed.messages.append(message)
        elif kind == "function_call":
            _function_call(item, i, parsed, pending_reasoning)
        elif kind == "function_call_output":
            _function_call_output(item, i, parsed)
        elif kind == "reasoning":
            pending_reasoning.append(_reasoning_text(item, i))
        elif not isinstance(kind, str):
            raise violation("is required (or 'role' for a message)", i, "type")
        else:
            raise violation("is not supported; use 'message', 'function_call', 'function_call_output' or "
                            "'reasoning'", i, "type", code=UNSUPPORTED)
    if pending_reasoning:  # reasoning with no answer after it: keep it as an assistant turn of its own
        parsed.messages.append({"role": "assistant", "content": "", "reasoning_content": "".join(pending_reasoning)})
    return parsed


def _check_keys(item: dict[str, Any], allowed: set[str], i: int) -> None:
    for key in sorted(item, key=str):
        if key not in allowed:
            raise violation("is not supported by this endpoint", i, str(key), code=UNSUPPORTED)


def _string(item: dict[str, Any], key: str, *path: str | int, empty_ok: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise violation("must be a string" if key in item else "is required", *path, key)
    if not value and not empty_ok:
        raise violation("must be a non-empty string", *path, key)
    return value


def _message(item: dict[str, Any], i: int, parsed: ParsedInput) -> dict[str, Any]:
    _check_keys(item, _MESSAGE_KEYS, i)
    role = item.get("role")
    if role not in ROLES:
        raise violation("must be one of 'user', 'assistant', 'system', 'developer'", i, "role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise violation("must be a string or an array of content parts", i, "content")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise violation("must be an object", i, "content", j)
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            if (kind == "output_text") != (role == "assistant"):
                raise violation(f"'{kind}' is not allowed on a '{role}' message", i, "content", j, "type")
            texts.append(_string(part, "text", i, "content", j, empty_ok=True))
        elif kind == "input_image" and role != "assistant":
            _image(part, i, j, parsed)
        elif kind == "refusal" and role == "assistant":
            texts.append(_string(part, "refusal", i, "content", j, empty_ok=True))
        else:
            raise violation("is not supported; use 'input_text', 'input_image' or (assistant) 'output_text'",
                            i, "content", j, "type", code=UNSUPPORTED)
    return {"role": role, "content": "".join(texts)}


def _image(part: dict[str, Any], i: int, j: int, parsed: ParsedInput) -> None:
    if part.get("file_id") is not None:
        raise violation("is not supported; send the image inline as a base64 data: URI in 'image_url'",
                        i, "content", j, "file_id", code=UNSUPPORTED)
    url = part.get("image_url")
    if not isinstance(url, str):
        raise violation("must be a base64 data: URI string", i, "content", j, "image_url")
    if len(parsed.images) >= MAX_IMAGES:
        raise violation(f"exceeds the limit of {MAX_IMAGES} images per request", i, "content", j)
    try:
        parsed.images.append(decode_data_uri(url))
    except ImageRejected as exc:
        raise violation(exc.rule, i, "content", j, "image_url") from None
    parsed.image_data_params.append(f"input[{i}].content[{j}].image_url")
    if parsed.image_param is None:
        parsed.image_param = f"input[{i}].content[{j}].type"


def _function_call(item: dict[str, Any], i: int, parsed: ParsedInput, pending_reasoning: list[str]) -> None:
    _check_keys(item, _CALL_KEYS, i)
    call_id = _string(item, "call_id", i)
    name = _string(item, "name", i)
    arguments = _string(item, "arguments", i, empty_ok=True)
    if arguments.strip():
        try:
            json.loads(arguments)
        except ValueError:
            raise violation("must be a JSON-encoded string (the function's arguments)", i, "arguments") from None
    if call_id in parsed.call_ids:
        raise violation(f"'{call_id}' is used by an earlier function_call", i, "call_id")
    parsed.call_ids[call_id] = i
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = parsed.messages[-1] if parsed.messages else None
    if last is not None and last["role"] == "assistant" and not pending_reasoning:
        last.setdefault("tool_calls", []).append(call)  # parallel calls (and any text) form one turn
        return
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    if pending_reasoning:
        message["reasoning_content"] = "".join(pending_reasoning)
        pending_reasoning.clear()
    parsed.messages.append(message)


def _function_call_output(item: dict[str, Any], i: int, parsed: ParsedInput) -> None:
    _check_keys(item, _OUTPUT_KEYS, i)
    call_id = _string(item, "call_id", i)
    output = item.get("output")
    if isinstance(output, list):  # the content-part form: text parts only
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise violation("must be an input_text part", i, "output", j, code=UNSUPPORTED)
            texts.append(_string(part, "text", i, "output", j, empty_ok=True))
        output = "".join(texts)
    if not isinstance(output, str):
        raise violation("must be a string or an array of input_text parts", i, "output")
    if call_id in parsed.outputs:
        raise violation(f"'{call_id}' already has an output", i, "call_id")
    parsed.outputs[call_id] = i
    parsed.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    _check_keys(item, _REASONING_KEYS, i)
    if item.get("encrypted_content") is not None:
        raise violation("is not supported (this server returns reasoning in clear)", i, "encrypted_content",
                        code=UNSUPPORTED)
    texts: list[str] = []
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise violation("must be an array", i, key)
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise violation(f"must be a '{part_type}' part", i, key, j)
            texts.append(_string(part, "text", i, key, j, empty_ok=True))
        if key == "content" and parts:
            break  # the full reasoning wins over its summary
    return "".join(texts)
