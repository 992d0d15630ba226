"""The engine's import directions, as one table: read by tests/unit/test_engine_layering.py and by .ci/py310.

A module is governed by the longest package or module name in LAYERS that contains it. It may import, from
`engine` or `contract`, only what its rule allows (and anything from the standard library or third parties, except
that a torch-free module imports none of TORCH and only torch-free engine modules). Imports under
`if TYPE_CHECKING:` count for the direction (they still say who knows whom) but not for torch-freeness.

    python -m tests.engine_layers torch-free    the torch-free modules, one a line (.ci/py310 imports them)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = {"torch", "accelerate", "peft", "xgrammar"}  # what a torch-free module never imports at run time
TRITON_STUB = "triton_python_backend_utils"  # only engine.triton may know the Python backend


@dataclass(frozen=True)
class Rule:
    allow: tuple[str, ...]  # the engine/contract packages or modules it may import, besides its own
    torch_free: bool = False


# layer 0: the boundary types and the shared error table (stdlib only), plus the host->device staging helpers
BASE = ("engine.errors", "engine.sampling_params", "engine.request")

LAYERS: dict[str, Rule] = {
    "contract": Rule((), torch_free=True),
    "engine": Rule((), torch_free=True),  # engine/__init__.py: every engine import runs it
    "engine.errors": Rule((), torch_free=True),
    "engine.sampling_params": Rule(("engine.errors",), torch_free=True),
    "engine.request": Rule(("engine.errors", "engine.sampling_params"), torch_free=True),
    "engine.staging": Rule(()),
    # layer 1
    "engine.text": Rule(BASE, torch_free=True),
    "engine.model": Rule((*BASE, "engine.staging")),
    # layer 2; the sampler's row reductions run on our CPU kernel library (built by engine.model.cpu_kernels)
    "engine.sampling": Rule((*BASE, "engine.staging", "engine.model.cpu_kernels")),
    "engine.runner": Rule((*BASE, "engine.staging", "engine.model")),
    "engine.runner.cuda_graphs": Rule(("engine.staging",)),  # captures a callable: knows neither model nor runner
    "engine.inputs": Rule((*BASE, "engine.text", "engine.sampling.grammar")),
    # layer 3: the step loop; of the model it knows only the KV cache (the prefix cache copies into it)
    "engine.core": Rule((*BASE, "engine.staging", "engine.runner", "engine.model.kv_cache", "engine.sampling",
                         "engine.text")),
    # layer 4: the one composition root
    # run-time LoRA: beside the engine, over the model's adapter loaders and the scheduler's view of requests
    "engine.lora_runtime": Rule((*BASE, "engine.model", "engine.core")),
    "engine.llm_engine": Rule((*BASE, "engine.staging", "engine.text", "engine.model", "engine.sampling",
                               "engine.runner", "engine.inputs", "engine.core", "engine.lora_runtime")),
    # layer 5: the Triton glue sees the engine's front door and the boundary types only
    "engine.triton": Rule((*BASE, "engine.llm_engine", "contract")),
    "engine.triton.reply": Rule(BASE, torch_free=True),
}

# Imports that break the table today and the step that removes them; the test fails once one is gone (so this
# list only shrinks) or when a new one appears.
PENDING: set[tuple[str, str]] = set()


def rule_of(module: str) -> tuple[str, Rule]:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in LAYERS:
            return name, LAYERS[name]
    raise KeyError(f"{module} is in no layer of tests/engine_layers.py: add it to LAYERS")


def allowed(module: str, target: str) -> bool:
    own, rule = rule_of(module)  # a package's modules import each other; a module-level rule names its own scope
    scopes = rule.allow if own == "engine" else (*rule.allow, own)
    return any(target == s or target.startswith(s + ".") for s in scopes)


def modules(*roots: str) -> dict[str, Path]:
    """Dotted name -> file for every .py file under the given top-level packages."""
    found = {}
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join(parts)] = path
    return found


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (a submodule when `from pkg import submodule`)
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def imports(path: Path, known: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    type_only_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                type_only_lines.update(n.lineno for n in ast.walk(inner) if hasattr(n, "lineno"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            names = subs if len(subs) == len(node.names) else [node.module, *subs]
        else:
            continue
        found += [Import(n, node.lineno, node.lineno in type_only_lines) for n in names]
    return sorted(found, key=lambda i: i.line)


def torch_free_modules() -> list[str]:
    return [m for m in modules("contract", "engine") if rule_of(m)[1].torch_free]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports) as a path that ends where it starts, or None
    (the engine's and the gateway's layering tests both hold their trees free of cycles)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


if __name__ == "__main__":
    if sys.argv[1:] != ["torch-free"]:
        sys.exit(__doc__)
    print("\n".join(torch_free_modules()))
