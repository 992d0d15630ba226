"""Chat `messages[i]`: roles, content (string or parts), tool-call replay, inline images."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, PrivateAttr, WithJsonSchema, field_validator, model_validator

from gateway.contracts.common import INVALID, UNSUPPORTED, ContractModel, NonEmptyStr, violation
from gateway.contracts.images import ImageRejected, decode_data_uri
from gateway.domain import ImageInput

ROLES = ("system", "user", "assistant", "tool", "developer")
TEXT_PARTS = ("text", "input_text")
IMAGE_PARTS = ("image_url", "input_image")


class ToolCallFunction(ContractModel):
    """`function` of a replayed tool call; any deviation from the shape is invalid_request."""

    unknown_key_code: ClassVar[str | None] = INVALID

    name: NonEmptyStr
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, value: str) -> str:
        # the engine renders replayed calls through the chat template, which needs the decoded
        # object; catch it here so the client hears which call is at fault (empty means `{}`)
        if value.strip():
            try:
                json.loads(value)
            except ValueError:
                raise violation("must be a JSON-encoded string (the function's arguments)") from None
        return value


class ToolCall(ContractModel):
    """`{id, type:"function", function:{name, arguments}}` exactly (OpenAI replay shape)."""

    unknown_key_code: ClassVar[str | None] = INVALID

    id: NonEmptyStr
    type: Literal["function"]
    function: ToolCallFunction

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


_CONTENT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "type": {"enum": [*TEXT_PARTS, *IMAGE_PARTS]},
                    "text": {"type": "string"},
                    "image_url": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "object", "properties": {"url": {"type": "string"}}},
                        ]
                    },
                },
                "required": ["type"],
            },
        },
        {"type": "null"},
    ]
}


class ChatMessage(ContractModel):
    """One chat turn. Keys outside the schema (e.g. `name`) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    unknown_key_code: ClassVar[str | None] = None

    role: str
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: NonEmptyStr | None = None

    _text: str | None = PrivateAttr(default=None)
    # (part index, image) in the order written.
    _images: list[tuple[int, ImageInput]] = PrivateAttr(default_factory=list)

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise violation("must be one of 'system', 'user', 'assistant', 'tool', 'developer'")
        return "system" if role == "developer" else role

    @model_validator(mode="after")
    def _cross_field(self) -> ChatMessage:
        self._check_tool_fields()
        self._parse_content()
        return self

    def _check_tool_fields(self) -> None:
        if self.tool_calls and self.role != "assistant":
            raise violation("is allowed only on assistant messages", "tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise violation("is required on tool messages", "tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise violation("is allowed only on tool messages", "tool_call_id")

    def _parse_content(self) -> None:
        content = self.content
        if content is None:
            if self.role == "assistant" and self.tool_calls:
                return
            raise violation("is required (null only on assistant messages with tool_calls)", "content")
        if isinstance(content, str):
            self._text = content
            return
        if not isinstance(content, list):
            raise violation("must be a string or an array of content parts", "content")
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise violation("must be an object", "content", j)
            kind = part.get("type")
            if not isinstance(kind, str):
                raise violation("must be a string", "content", j, "type")
            if kind in TEXT_PARTS:
                text = part.get("text")
                if not isinstance(text, str):
                    raise violation("must be a string", "content", j, "text")
                texts.append(text)
            elif kind in IMAGE_PARTS:
                self._images.append((j, _image_part(part, j)))
            else:
                raise violation(
                    "is not supported; use 'text', 'input_text', 'image_url' or 'input_image'",
                    "content",
                    j,
                    "type",
                    code=UNSUPPORTED,
                )
        self._text = "".join(texts)

    def as_dict(self) -> dict[str, Any]:
        """The wire-neutral message: `{role, content, tool_calls?, tool_call_id?}`."""
        out: dict[str, Any] = {"role": self.role, "content": self._text}
        if self.tool_calls:
            out["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def images(self) -> list[tuple[int, ImageInput]]:
        return self._images


def _image_part(part: dict[str, Any], j: int) -> ImageInput:
    """Decode an `image_url` / `input_image` part: `image_url` is a data URI or `{url}`."""
    payload = part.get("image_url")
    suffix: tuple[str | int, ...] = ("content", j, "image_url")
    if isinstance(payload, dict):
        payload = payload.get("url")
        suffix = (*suffix, "url")
    if not isinstance(payload, str):
        raise violation("must be a base64 data: URI string or an object with 'url'", *suffix)
    try:
        return decode_data_uri(payload)
    except ImageRejected as exc:
        raise violation(exc.rule, *suffix) from None
