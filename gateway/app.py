"""App factory: wires settings, registry, supervisor, service, resources, middleware and the error envelope."""

from __future__ import annotations

from typing import Any

import falcon
import falcon.asgi

from gateway.admission import Admission
from gateway.auth import Authenticator
from gateway.disconnect import DisconnectAware
from gateway.drain import Drain
from gateway.error_responses import gateway_error, http_error, unexpected_error
from gateway.errors import GatewayError
from gateway.middleware import Lifespan, ObserveRequests, RequestContextMiddleware
from gateway.openapi_doc import build_openapi
from gateway.prefix_routing import PrefixRouting
from gateway.registry import ModelRegistry
from gateway.resources.chat import ChatCompletionsResource
from gateway.resources.cluster_status import ClusterStatusFeed
from gateway.resources.completions import CompletionsResource
from gateway.resources.docs import DocsResource, IndexResource, RedocScriptResource
from gateway.resources.generate import GenerateResource
from gateway.resources.health import (
    GatewayHealthResource,
    HealthResource,
    MetricsResource,
    OpenAPIResource,
    ReadyResource,
    VersionResource,
)
from gateway.resources.lora import LoraAdapterResource
from gateway.resources.models import ModelsResource
from gateway.resources.responses import ResponsesResource, StoredResponseResource
from gateway.resources.tokenize import DetokenizeResource, TokenizeResource
from gateway.responses_store import open_store
from gateway.served import Served
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.supervisor import ModelSupervisor


def create_app(settings: Settings, registry: ModelRegistry | None = None, drain: Drain | None = None,
               auth: Authenticator | None = None, supervisor: ModelSupervisor | None = None) -> falcon.asgi.App:
    registry = registry or ModelRegistry(settings)
    # the supervisor watches the registry's models and acts on them; the registry never calls it
    supervisor = supervisor or ModelSupervisor(registry, settings)
    drain = drain or Drain()
    # endpoints whose routing entry lists their KV event publishers: requests go where their prompt's blocks are
    prefix_routing = PrefixRouting.from_settings(settings)
    service = GenerationService(settings, registry, supervisor.model_died, drain,
                                prefix_routing if prefix_routing.feeds else None)
    auth = auth or Authenticator(settings)
    # admission after authentication: it reads the key's settings (docs/auth.md, "Per-key limits and priorities")
    middleware: list[Any] = [ObserveRequests(), RequestContextMiddleware(settings, auth), Admission(auth)]
    app = falcon.asgi.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_route("/v1/chat/completions", ChatCompletionsResource(settings, service))
    app.add_route("/v1/completions", CompletionsResource(settings, service))
    store = open_store(settings.responses_store, max_rows=settings.responses_store_max_rows,
                       max_bytes=settings.responses_store_max_bytes, ttl_s=settings.responses_store_ttl_s)
    app.add_route("/v1/responses", ResponsesResource(settings, service, store))
    app.add_route("/v1/responses/{response_id}", StoredResponseResource(store))
    generate = GenerateResource(settings, service)
    app.add_route("/v1/generate/{model}", generate)
    app.add_sink(generate.sink, prefix=r"^/v1/generate(/|$)")  # `/v1/generate/` loses its slash
    app.add_route("/healthz", HealthResource())
    app.add_route("/readyz", ReadyResource(registry, drain))
    app.add_route("/health", GatewayHealthResource(registry))
    app.add_route("/version", VersionResource(settings.server_version))
    app.add_route("/tokenize", TokenizeResource(settings, service))
    app.add_route("/detokenize", DetokenizeResource(settings, service))
    models = ModelsResource(registry)
    app.add_route("/v1/models", models)
    app.add_sink(models.retrieve, prefix=r"^/v1/models/")
    app.add_route("/v1/load_lora_adapter", LoraAdapterResource(settings, registry, "load"))
    app.add_route("/v1/unload_lora_adapter", LoraAdapterResource(settings, registry, "unload"))
    app.add_route("/metrics", MetricsResource(settings.engine_metrics_url, registry))
    openapi = build_openapi()
    app.add_route("/openapi.json", OpenAPIResource(openapi))
    app.add_route("/docs", DocsResource(openapi))
    app.add_route("/docs/redoc.standalone.js", RedocScriptResource())
    app.add_route("/", IndexResource(settings.server_version))
    app.add_error_handler(Exception, unexpected_error)
    app.add_error_handler(falcon.HTTPError, http_error)
    app.add_error_handler(GatewayError, gateway_error)

    async def startup() -> None:
        registry.start()
        supervisor.start()
        prefix_routing.start()

    async def shutdown() -> None:
        await prefix_routing.stop()
        await supervisor.stop()  # its reloads and probes use the registry's clients, which stop() closes
        await registry.stop()
        if store is not None:
            store.close()

    app.add_middleware(Lifespan(startup, shutdown))
    return app


def create_asgi(settings: Settings | None = None) -> Served:
    settings = settings or Settings.from_env()
    drain, registry, auth = Drain(), ModelRegistry(settings), Authenticator(settings)
    http = DisconnectAware(create_app(settings, registry, drain, auth))
    feed = ClusterStatusFeed(registry, auth, server_version=settings.server_version)
    return Served(http, feed, drain, auth)
