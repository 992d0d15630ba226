"""JSON Schema safety walker (section 2.3): limits, refused keywords, `$ref` inlining.

Used for native `grammar.json_schema`, chat `response_format.json_schema.schema` and tool
`parameters`. Grammar compilers cost time and memory proportional to the schema, so the gateway
bounds it before anything reaches a worker, and inlines internal `$ref`s so that the engine
only ever sees a self-contained tree.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from gateway.contracts.common import INVALID, UNSUPPORTED

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 16
MAX_SCHEMA_NODES = 16384

FORBIDDEN_KEYWORDS = frozenset(
    {
        "$dynamicRef",
        "$recursiveRef",  # the 2019-09 spelling of $dynamicRef
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "dependentSchemas",
    }
)
# Keywords whose value maps names to subschemas (the names themselves are not keywords).
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# Keywords whose value is data, never a subschema (a property named "if" inside is fine).
_DATA_KEYS = frozenset(
    {
        "enum",
        "const",
        "default",
        "examples",
        "required",
        "dependentRequired",
        "title",
        "description",
        "pattern",
        "format",
        "$comment",
        "$id",
        "$schema",
        "$anchor",
    }
)


class SchemaRejected(ValueError):
    """A schema that breaks a limit; `code` is the contract code, `rule` completes the sentence."""

    def __init__(self, code: str, rule: str) -> None:
        super().__init__(rule)
        self.code = code
        self.rule = rule


def serialized_size(value: Any) -> int:
    """Bytes of the compact JSON serialization (what the limit on grammar size counts)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def check_and_inline(schema: dict[str, Any]) -> dict[str, Any]:
    """Check every limit of section 2.3 and return a copy with internal `$ref`s inlined."""
    if serialized_size(schema) > MAX_SCHEMA_BYTES:
        raise SchemaRejected(INVALID, f"must serialize to at most {MAX_SCHEMA_BYTES} bytes")
    _Walker(schema, inline=False).schema(schema, 1, ())
    out = _Walker(schema, inline=True).schema(schema, 1, ())
    assert isinstance(out, dict)
    # Every internal reference is now inlined, so the definition tables are dead weight.
    return {k: v for k, v in out.items() if k not in ("$defs", "definitions")}


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


class _Walker:
    """One pass over a schema: with `inline=False` it checks the text as written, with
    `inline=True` it builds the inlined copy and checks the limits on that result."""

    def __init__(self, root: dict[str, Any], *, inline: bool) -> None:
        self.root = root
        self.inline = inline
        self.nodes = 0

    def _count(self, depth: int, *, container: bool = True) -> None:
        """Count one node; `depth` is the nesting of objects/arrays (scalars add no level)."""
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise SchemaRejected(INVALID, f"must have at most {MAX_SCHEMA_NODES} nodes")
        if container and depth > MAX_SCHEMA_DEPTH:
            raise SchemaRejected(INVALID, f"must nest at most {MAX_SCHEMA_DEPTH} levels deep")

    def data(self, value: Any, depth: int) -> Any:
        """Copy a non-schema value, counting its nodes."""
        self._count(depth, container=isinstance(value, (dict, list)))
        if isinstance(value, dict):
            return {k: self.data(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [self.data(v, depth + 1) for v in value]
        return value

    def schema(self, node: Any, depth: int, active: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            if isinstance(node, list):  # e.g. items of allOf that are themselves arrays
                return self.data(node, depth)
            self._count(depth, container=False)
            return node
        self._count(depth)
        forbidden = sorted(k for k in node if k in FORBIDDEN_KEYWORDS)
        if forbidden:
            raise SchemaRejected(UNSUPPORTED, f"uses unsupported JSON Schema keyword '{forbidden[0]}'")
        if "$ref" in node:
            return self._ref(node, depth, active)
        return self._members(node, depth, active)

    def _members(self, node: dict[str, Any], depth: int, active: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _NAME_MAPS and isinstance(value, dict):
                self._count(depth + 1)
                out[key] = {n: self.schema(s, depth + 2, active) for n, s in value.items()}
            elif key in _DATA_KEYS:
                out[key] = self.data(value, depth + 1)
            elif isinstance(value, list):
                self._count(depth + 1)
                out[key] = [self.schema(s, depth + 2, active) for s in value]
            else:
                out[key] = self.schema(value, depth + 1, active)
        return out

    def _ref(self, node: dict[str, Any], depth: int, active: tuple[str, ...]) -> Any:
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise SchemaRejected(INVALID, "has a non-string $ref")
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaRejected(UNSUPPORTED, f"uses an external or non-pointer $ref '{_short(ref)}'")
        target = self._resolve(ref)
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        if not self.inline:
            # Checking pass: the target is checked where it is written; only the siblings here.
            self._count(depth + 1)
            return self._members(siblings, depth, active)
        if ref in active:
            raise SchemaRejected(INVALID, f"has a cyclic $ref '{_short(ref)}'")
        resolved = self.schema(target, depth, active + (ref,))
        if not siblings:
            return resolved
        out = self._members(siblings, depth, active)
        existing = out.get("allOf")
        out["allOf"] = [resolved, *(existing if isinstance(existing, list) else [])]
        return out

    def _resolve(self, ref: str) -> Any:
        node: Any = self.root
        if ref == "#":
            return node
        for raw in ref[2:].split("/"):
            token = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise SchemaRejected(INVALID, f"has an unresolved $ref '{_short(ref)}'")
        return node
