"""GET / (what this server is and where to look) and GET /docs (the API reference), sie-contract 7.

/docs is rendered here from the same OpenAPI document /openapi.json serves, as plain HTML: the gateway runs with no
internet access, so it cannot pull a JavaScript viewer from a CDN, and a page that lists every operation and its
parameters needs none."""

from __future__ import annotations

import html
from typing import Any

import orjson

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


def render_docs(document: dict[str, Any]) -> str:
    info = document.get("info", {})
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
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
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>" + title + "</title></head><body>"
            f"<h1>{title}</h1><p>The machine-readable document: <a href=\"/openapi.json\">/openapi.json</a>.</p>"
            "<table><thead><tr><th>method</th><th>path</th><th>what</th><th>parameters</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></body></html>")
