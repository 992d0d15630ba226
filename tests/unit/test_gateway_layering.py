"""The gateway is a one-way tree (tests/gateway_layers.py): no module imports one of a higher layer, no import cycle,
no engine or torch. Reads the sources with ast (module-level, function-level and TYPE_CHECKING imports alike);
imports nothing it checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_layers import TORCH, find_cycle, imports, modules
from tests.gateway_layers import FORBIDDEN, LAYERS, ROOT, layer_of

GATEWAY = modules(ROOT)


def _where(module: str, path: Path) -> str:
    return module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")


def _upward(known: dict[str, Path]) -> list[str]:
    """Each import of a higher layer's module, as 'file:line module (layer) imports target (layer)'."""
    found = []
    for module, path in known.items():
        for imp in imports(path, known):
            if imp.target in known and layer_of(imp.target) > layer_of(module):
                found.append(f"{_where(module, path)}:{imp.line} {module} (layer {layer_of(module)}) imports "
                             f"{imp.target} (layer {layer_of(imp.target)})")
    return found


def _graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {module: {i.target for i in imports(path, known) if i.target in known and i.target != module}
            for module, path in known.items()}


def _forbidden(known: dict[str, Path]) -> list[str]:
    return [f"{_where(module, path)}:{imp.line} {imp.target}" for module, path in known.items()
            for imp in imports(path, known) if imp.target.split(".")[0] in FORBIDDEN | TORCH]


def test_every_gateway_module_is_in_a_layer():
    for module in GATEWAY:
        layer_of(module)  # KeyError names the module


def test_every_layer_entry_names_a_module():
    stale = [name for _, names in LAYERS for name in names
             if name not in GATEWAY and not any(m.startswith(name + ".") for m in GATEWAY)]
    assert not stale, f"in tests/gateway_layers.py but not in gateway/: {stale}"


def test_no_gateway_module_imports_a_higher_layer():
    found = _upward(GATEWAY)
    assert not found, "\n".join(found)


def test_no_import_cycle_in_the_gateway():
    cycle = find_cycle(_graph(GATEWAY))
    assert cycle is None, " -> ".join(cycle or [])


def test_the_gateway_imports_no_engine_and_no_torch():
    found = _forbidden(GATEWAY)
    assert not found, found


@pytest.fixture
def planted(tmp_path):
    """Write gateway modules under tmp_path; returns the known modules with them added."""
    def plant(**sources: str) -> dict[str, Path]:
        known = dict(GATEWAY)
        for name, text in sources.items():
            path = tmp_path / (name.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            known[name] = path
        return known
    return plant


def test_a_planted_upward_import_is_caught_in_a_function_and_under_type_checking(planted):
    """The check itself: a module in the registry's layer reaching up to the service (for types only) and to the app
    (inside a function), each reported with its line."""
    known = planted(**{"gateway.registry.planted": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from gateway.service import GenerationService\n\n"
                       "def later():\n    from gateway import app\n    return app\n"})
    found = [f for f in _upward(known) if "planted" in f]
    where = "gateway/registry/planted.py"
    assert found == [f"{where}:3 gateway.registry.planted (layer 3) imports gateway.service (layer 5)",
                     f"{where}:6 gateway.registry.planted (layer 3) imports gateway.app (layer 7)"]


def test_a_module_in_no_layer_is_named():
    with pytest.raises(KeyError, match="gateway.nowhere"):
        layer_of("gateway.nowhere")  # the package's own entry does not take in new modules by default


def test_a_planted_cycle_and_engine_import_are_caught(planted):
    known = planted(**{"gateway.planted_a": "import gateway.planted_b\nimport torch\n",
                       "gateway.planted_b": "def f():\n    from gateway.planted_a import x\n"
                                            "    from engine.errors import E\n"})
    assert find_cycle(_graph(known)) == ["gateway.planted_a", "gateway.planted_b", "gateway.planted_a"]
    assert sorted(f for f in _forbidden(known) if "planted" in f) == ["gateway/planted_a.py:2 torch",
                                                                      "gateway/planted_b.py:3 engine.errors"]


def test_the_table_reads_the_real_tree():
    """Not vacuous: the gateway has many modules, and the known one-way edges are seen."""
    graph = _graph(GATEWAY)
    assert len(GATEWAY) > 50
    assert "gateway.endpoint" in graph["gateway.supervisor"]  # the supervisor sees endpoints, through a Protocol
    assert "gateway.supervisor" not in graph["gateway.registry"]
    assert {"gateway.registry", "gateway.supervisor", "gateway.service"} <= graph["gateway.app"]
