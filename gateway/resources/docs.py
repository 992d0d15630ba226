"""GET / (what this server is and where to look) and GET /docs (the API reference), docs/contract.md, "Health and
operational routes".

/docs is Redoc over /openapi.json, as SIE's gateway serves it: the viewer is `/docs/redoc.standalone.js`, Redoc's
own bundle shipped in `gateway/static/` (redoc 2.5.4, MIT; a gateway often has no internet access, so no CDN). For a
client without JavaScript the page holds the same reference as plain HTML, every operation and its parameters.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import orjson

REDOC_JS = Path(__file__).resolve().parents[1] / "static" / "redoc.standalone.js"

METHODS = ("get", "post", "put", "patch", "delete")


class IndexResource:
    def __init__(self, version: str) -> None:
        self.body = orjson.dumps({
            "name": "SIE gateway on Triton", "version": version, "docs": "/docs", "openapi": "/openapi.json",
            "health": "/health", "models": "/v1/models",
        })

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/json"
        resp.data = self.body


class DocsResource:
    def __init__(self, document: dict[str, Any]) -> None:
        self.body = render_docs(document).encode()

    async def on_get(self, req, resp) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.data = self.body


class RedocScriptResource:
    """GET /docs/redoc.standalone.js: the viewer /docs loads (always open, like /docs)."""

    def __init__(self, path: Path = REDOC_JS) -> None:
        self.body = path.read_bytes()

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/javascript; charset=utf-8"
        resp.cache_control = ["public", "max-age=86400"]
        resp.data = self.body


def render_docs(document: dict[str, Any]) -> str:
    info = document.get("info", {})
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>" + title + "</title>"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"></head><body>"
            "<redoc spec-url=\"/openapi.json\"></redoc>"
            f"<noscript>{_reference(document, title)}</noscript>"
            "<script src=\"/docs/redoc.standalone.js\"></script></body></html>")


def _reference(document: dict[str, Any], title: str) -> str:
    """Every operation and its parameters, as plain HTML."""
    rows = []
    for path, item in document.get("paths", {}).items():
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            summary = operation.get("summary") or operation.get("description") or operation.get("operationId", "")
            params = ", ".join(p["name"] for p in operation.get("parameters", []) if "name" in p)
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(str(summary))}</td><td>{html.escape(params)}</td></tr>")
    return (f"<h1>{title}</h1><p>The machine-readable document: <a href=\"/openapi.json\">/openapi.json</a>.</p>"
            "<table><thead><tr><th>method</th><th>path</th><th>what</th><th>parameters</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")
