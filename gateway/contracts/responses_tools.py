"""Tool definitions and output formats of `POST /v1/responses`: the Responses API's flat function tools, its
`tool_choice` and `text.format`, with the chat contract's schema check (gateway/contracts/tools.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from gateway.contracts.common import UNSUPPORTED, ContractModel, NonEmptyStr, violation
from gateway.contracts.tools import FormatType, checked_schema, format_grammar
from gateway.domain import GrammarSpec


class FunctionTool(ContractModel):
    """`{type: "function", name, description?, parameters?, strict?}` (the Responses API's flat shape)."""

    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(checked_schema)] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        if value != "function":
            raise violation("must be 'function' (the only tool type this server runs)", code=UNSUPPORTED)
        return value

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict if self.strict is not None else True}

    def chat_shape(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class TextFormat(ContractModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with `name`, `schema` and `strict`."""

    type: FormatType
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any], AfterValidator(checked_schema)] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> TextFormat:
        if self.type == "json_schema":
            if self.schema_ is None:
                raise violation("is required when type is 'json_schema'", "schema")
            if not self.name:
                raise violation("is required when type is 'json_schema'", "name")
        elif self.schema_ is not None or self.name is not None or self.strict is not None:
            raise violation(f"is allowed only with type 'json_schema', not '{self.type}'",
                            "schema" if self.schema_ is not None else ("name" if self.name is not None else "strict"))
        return self

    def grammar(self) -> GrammarSpec | None:
        return format_grammar(self.type, self.schema_, self.name, self.strict, "text.format")

    def echo(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "description": self.description,
                "strict": bool(self.strict)}


def checked_tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and set(value) == {"type", "name"} and value["type"] == "function" \
            and isinstance(value["name"], str) and value["name"]:
        return {"type": "function", "name": value["name"]}
    raise violation("must be 'auto', 'none', 'required' or {type: 'function', name}")


TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"enum": ["auto", "none", "required"]},
        {"type": "object", "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1}},
         "required": ["type", "name"]},
    ]
}
