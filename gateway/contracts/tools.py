"""Tool definitions and output formats of `POST /v1/chat/completions` (docs/contract.md, "Chat completions"): the
function tools, `tool_choice` and `response_format`, each schema checked once (gateway/contracts/schema_limits.py).
`/v1/tokenize` takes the same tools, and the Responses API the same schema check."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from gateway.contracts.common import INVALID, UNSUPPORTED, ContractModel, NonEmptyStr, violation
from gateway.contracts.schema_limits import SchemaRejected, check_and_inline
from gateway.domain import GrammarSpec

MAX_TOOLS = 64


def checked_schema(value: dict[str, Any]) -> dict[str, Any]:
    """Run the JSON-Schema walker inside a field validator (param = that field)."""
    try:
        return check_and_inline(value)
    except SchemaRejected as exc:
        raise violation(exc.rule, code=exc.code) from None


class ToolFunction(ContractModel):
    # any deviation in a tool definition is invalid_request (docs/contract.md, "Chat completions", `tools`)
    unknown_key_code = INVALID

    name: NonEmptyStr
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(checked_schema)] | None = None
    # Not in the SIE seed, but OpenAI SDK helpers send it; accepted so those clients work.
    strict: bool | None = None


class Tool(ContractModel):
    unknown_key_code = INVALID

    type: Literal["function"]
    function: ToolFunction

    def as_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class JsonSchemaFormat(ContractModel):
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any], AfterValidator(checked_schema)] = Field(alias="schema")
    strict: bool | None = None


def checked_format_type(value: str) -> str:
    """An output format's `type`, in chat's `response_format` and the Responses API's `text.format` alike."""
    if value not in ("text", "json_object", "json_schema"):
        raise violation("must be 'text', 'json_object' or 'json_schema'", code=UNSUPPORTED)
    return value


FormatType = Annotated[str, AfterValidator(checked_format_type)]


def format_grammar(kind: str, schema: dict[str, Any] | None, name: str | None, strict: bool | None,
                   param: str) -> GrammarSpec | None:
    """The grammar an output format asks for (None for plain text); `param` names the field in errors."""
    if kind == "json_object":
        return GrammarSpec(kind="json_object", value={"type": "object"}, label="json_object", param=param)
    if kind == "json_schema" and schema is not None:
        return GrammarSpec(kind="json_schema", value=schema, label=name, strict=bool(strict), param=param)
    return None


class ResponseFormat(ContractModel):
    type: FormatType
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise violation("is required when type is 'json_schema'", "json_schema")
        return self

    def grammar(self) -> GrammarSpec | None:
        spec = self.json_schema
        return format_grammar(self.type, spec.schema_ if spec else None, spec.name if spec else None,
                              spec.strict if spec else None, "response_format")


def checked_tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and set(value) == {"type", "function"} and value["type"] == "function":
        fn = value["function"]
        if isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str) and fn["name"]:
            return {"type": "function", "function": {"name": fn["name"]}}
    raise violation(
        "must be 'auto', 'none', 'required' or an object naming a function (type 'function', function.name)"
    )


TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "minLength": 1}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
    ]
}
