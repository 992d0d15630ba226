"""The OpenAPI document of the contracts, generated from the same pydantic models that validate them."""

from __future__ import annotations

from typing import Any

from gateway.contracts.chat import ChatCompletionRequest
from gateway.contracts.completions import CompletionRequest
from gateway.contracts.generate import GenerateRequest
from gateway.contracts.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from gateway.contracts.responses import ResponsesRequest
from gateway.contracts.tokenize import DetokenizeRequest, TokenizeRequest
from gateway.settings import VERSION

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}


# every status the generation routes answer with an error envelope: 408 a stalled body or a cancelled
# generation, 429 the engine's rate limit, 431 request headers over GATEWAY_MAX_HEADER_BYTES (gateway/worker.py),
# 502 an inter-chunk timeout, 504 the first-chunk/overall one
_ERROR_STATUSES = (400, 401, 404, 408, 413, 429, 431, 500, 502, 503, 504)


def _errors(*statuses: int) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {str(s): {"description": "Error", "content": {"application/json": {"schema": ref}}} for s in statuses}


def _hoist(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    components.update(schema.pop("$defs", {}))
    return schema


def _tokenizer_route(operation: str, schema: str, answer: str) -> dict[str, Any]:
    return {"post": {
        "operationId": operation,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": answer, "content": {"application/json": {"schema": {"type": "object"}}}},
                      **_errors(400, 401, 404, 413, 500, 503)},
    }}


def _lora_route(operation: str, schema: str) -> dict[str, Any]:
    """Run-time LoRA (docs/lora.md): 404 while SIE_ALLOW_RUNTIME_LORA_UPDATING is off; a plain-text success."""
    return {"post": {
        "operationId": operation,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": "Success: LoRA adapter '<name>' added / removed successfully.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 404, 409, 413, 500, 503)},
    }}


def build_openapi() -> dict[str, Any]:
    components: dict[str, Any] = {"ErrorResponse": _ERROR}
    components["ChatCompletionRequest"] = _hoist(ChatCompletionRequest.model_json_schema(ref_template=_REF), components)
    components["CompletionRequest"] = _hoist(CompletionRequest.model_json_schema(ref_template=_REF), components)
    components["ResponsesRequest"] = _hoist(ResponsesRequest.model_json_schema(ref_template=_REF), components)
    components["TokenizeRequest"] = _hoist(TokenizeRequest.model_json_schema(ref_template=_REF), components)
    components["DetokenizeRequest"] = _hoist(DetokenizeRequest.model_json_schema(ref_template=_REF), components)
    components["LoadLoraAdapterRequest"] = _hoist(LoadLoraAdapterRequest.model_json_schema(ref_template=_REF),
                                                  components)
    components["UnloadLoraAdapterRequest"] = _hoist(UnloadLoraAdapterRequest.model_json_schema(ref_template=_REF),
                                                    components)
    components["GenerateRequest"] = _hoist(GenerateRequest.model_json_schema(ref_template=_REF), components)
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    headers = [
        {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
        for h in ("X-SIE-MACHINE-PROFILE", "X-SIE-Pool", "X-SIE-SDK-Version")
    ]
    return {
        "openapi": "3.1.0",
        "info": {"title": "SIE gateway on Triton", "version": VERSION},
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"apiKey": []}, {}],
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "operationId": "chatCompletions",
                    "parameters": headers,
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}},
                    "responses": {
                        "200": {"description": "chat.completion, or chat.completion.chunk SSE when stream is true",
                                "content": {"application/json": {"schema": {"type": "object"}}, **sse}},
                        **_errors(*_ERROR_STATUSES),
                    },
                }
            },
            "/v1/completions": {
                "post": {
                    "operationId": "completions",
                    "parameters": headers,
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}}},
                    "responses": {
                        "200": {"description": "text_completion, or text_completion SSE chunks when stream is true",
                                "content": {"application/json": {"schema": {"type": "object"}}, **sse}},
                        **_errors(*_ERROR_STATUSES),
                    },
                }
            },
            "/v1/responses": {
                "post": {
                    "operationId": "createResponse",
                    "parameters": headers,
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}},
                    "responses": {
                        "200": {"description": "response object, or Responses API stream events (`event:` lines) "
                                               "when stream is true",
                                "content": {"application/json": {"schema": {"type": "object"}}, **sse}},
                        **_errors(*_ERROR_STATUSES),
                    },
                }
            },
            "/v1/responses/{response_id}": {
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"operationId": "getResponse",
                        "responses": {"200": {"description": "a stored response object",
                                              "content": {"application/json": {"schema": {"type": "object"}}}},
                                      **_errors(400, 401, 404)}},
                "delete": {"operationId": "deleteResponse",
                           "responses": {"200": {"description": "{id, object: response, deleted: true}",
                                                 "content": {"application/json": {"schema": {"type": "object"}}}},
                                         **_errors(400, 401, 404)}},
            },
            "/tokenize": _tokenizer_route("tokenize", "TokenizeRequest",
                                          "{count, max_model_len, tokens, token_strs} (vLLM's shape)"),
            "/detokenize": _tokenizer_route("detokenize", "DetokenizeRequest", "{prompt} (vLLM's shape)"),
            "/v1/load_lora_adapter": _lora_route("loadLoraAdapter", "LoadLoraAdapterRequest"),
            "/v1/unload_lora_adapter": _lora_route("unloadLoraAdapter", "UnloadLoraAdapterRequest"),
            "/health": {"get": {"operationId": "health", "security": [], "responses": {
                "200": {"description": "a model can be served: {status: healthy|degraded, type: gateway, "
                                       "configured_gpu_types, live_gpu_types, cluster, workers, models}",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                "503": {"description": "no model can be served now (the same body)",
                        "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "{object: list, data: [model], models: [model]}: `data` for OpenAI clients, "
                                       "`models` for the sie-sdk; a model carries OpenAI's keys and the sie-sdk's "
                                       "ModelInfo keys",
                        "content": {"application/json": {"schema": {"type": "object"}}}}, **_errors(401)}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "one model (canonical or SIE-safe id)",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              **_errors(401, 404)}}},
            "/ws/cluster-status": {"get": {
                "operationId": "clusterStatus",
                "description": "WebSocket: {timestamp, ...the /health body} pushed once a second (the sie-sdk's "
                               "watch()); operational auth; a refused handshake is an HTTP error in the envelope",
                "responses": {"101": {"description": "switching to the WebSocket"}, **_errors(401, 404, 503)}}},
            "/version": {"get": {"operationId": "version", "security": [],
                                 "responses": {"200": {"description": "{version}", "content": {
                                     "application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/generate/{model}": {
                "post": {
                    "operationId": "generate",
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}},
                        *headers,
                        {"name": "X-SIE-Remote", "in": "header", "required": False,
                         "schema": {"type": "string", "enum": ["forbid"]}},
                    ],
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}}},
                    "responses": {
                        "200": {"description": "Generated text, or GenerateChunk SSE when stream is true",
                                "content": {"application/json": {"schema": {"type": "object"}}, **sse}},
                        **_errors(*_ERROR_STATUSES),
                    },
                }
            },
        },
    }
