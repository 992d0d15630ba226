"""The gateway's modules in layers, bottom to top: read by tests/unit/test_gateway_layering.py.

A module may import gateway modules of its own layer or a lower one, never a higher one; what it imports from outside
the gateway (the standard library, third parties, the shared `contract` package) is not governed here, except that
nothing in the gateway imports the engine or torch. A module belongs to the layer of the longest package or module
name in LAYERS that contains it. Imports inside functions and under `if TYPE_CHECKING:` count: they still say who
knows whom.
"""

from __future__ import annotations

# (why the layer sits where it does, the packages and modules in it), bottom first
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the vocabulary every layer speaks: settings, domain types, the error tree, metrics, model profiles and a few "
     "stores of plain state; none of it knows HTTP, Triton or a request in flight",
     ("gateway", "gateway.settings", "gateway.domain", "gateway.errors", "gateway.metrics", "gateway.logs",
      "gateway.profile", "gateway.timeouts", "gateway.auth_tokens", "gateway.adapter_changes", "gateway.engine_gauges",
      "gateway.responses_store", "gateway.key_settings", "gateway.rate_limits")),
    ("wire formats: request schemas, renderers, SSE framing and body decoding turn client bytes into domain types and "
     "back, with no I/O of their own",
     ("gateway.contracts", "gateway.render", "gateway.body", "gateway.msgpack_body", "gateway.stream_buffer",
      "gateway.streaming", "gateway.openapi_doc")),
    ("the process's outside: the Triton client, DNS discovery, the engines' KV events, API keys, the shutdown drain "
     "and the LoRA control calls, each one way of talking to something beyond the gateway",
     ("gateway.triton", "gateway.discovery", "gateway.kv_blocks", "gateway.auth", "gateway.drain",
      "gateway.disconnect", "gateway.lora_adapters")),
    ("the model registry: the endpoints, what each serves and each one's in-flight count; it knows Triton clients, "
     "not who acts on what it knows",
     ("gateway.endpoint", "gateway.registry")),
    ("acting on the registry: the router picks an endpoint for a request (and prefers where its prompt's blocks are), "
     "the supervisor withdraws and reloads a dead model through a narrow view of the registry",
     ("gateway.router", "gateway.prefix_routing", "gateway.supervisor")),
    ("one generation: route and open a stream, run it under its timeouts and the drain, fan out n>1 choices",
     ("gateway.session", "gateway.service", "gateway.fanout")),
    ("HTTP: resources per route, per-request middleware, the error envelope and the served ASGI entry",
     ("gateway.resources", "gateway.middleware", "gateway.admission", "gateway.error_responses", "gateway.served")),
    ("composition and process: the app factory wires everything below; the ASGI module and the worker start it",
     ("gateway.app", "gateway.asgi", "gateway.worker")),
]

FORBIDDEN = {"engine", "torch", "transformers"}  # top-level packages the gateway never imports (CONVENTIONS.md)
ROOT = "gateway"  # its own layer names only gateway/__init__.py: a new module is placed on purpose, not by default


def layer_of(module: str) -> int:
    """The layer index (0 is the bottom) of a dotted gateway module name."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            contains = module == name or (name != ROOT and module.startswith(name + "."))
            if contains and (best is None or len(name) > best[0]):
                best = (len(name), index)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/gateway_layers.py: add it to LAYERS")
    return best[1]
