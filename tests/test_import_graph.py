"""The package's import graph, read from the source with `ast`: no cycles (lazy imports included) and
imports point down the layer order below (docs/ARCHITECTURE.md, "Rooms")."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pressroom"

# The rooms (packages or top-level modules right under pressroom; "" is pressroom/__init__.py), top to
# bottom: a room imports only rooms below it. The scheduler and the KV cache manager (core) and the offload
# tiers sit under the model in import terms: they know nothing of executors, workers, models or kernels,
# while those read core's step messages (core.outputs).
LAYERS = ["entrypoints", "training", "benchmarks", "", "llm", "engine", "executor", "spec_decode", "worker",
          "lora", "model", "attention", "kernels", "distributed", "core", "kv_offload", "multimodal", "sandbox",
          "platforms", "logger"]
# Config and the messages that cross rooms (plain dataclasses) sit below every room and import only what
# sits below them.
LEAVES = {"config", "sampling_params", "outputs", "pooling_params", "core.outputs", "lora.request",
          "multimodal.inputs"}
BELOW_LEAVES = {"platforms", "logger"} | LEAVES


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _package(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, name: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    base = _package(name, path).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest_module(target: str, modules: dict[str, Path]) -> str | None:
    """The module an import of `target` runs: itself, or the nearest package above a name defined in it."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every pressroom module the file imports, anywhere in it (module level, functions, conditionals)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, name, path)
            # `from pressroom.a import b`: the submodule a.b where b is one, else a itself.
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        found.update(m for t in targets if t.startswith("pressroom") and (m := _nearest_module(t, modules)))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = find_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first module repeated at the end), or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: dict[str, int] = {}

    def visit(node: str) -> list[str] | None:
        on_stack[node] = len(stack)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return stack[on_stack[nxt]:] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        del on_stack[node]
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


def _room(module: str) -> str:
    """The room a module belongs to: a leaf message module by its own name, else the package (or top-level
    module) right under pressroom."""
    parts = module.split(".")[1:]
    dotted = ".".join(parts)
    return dotted if dotted in LEAVES else (parts[0] if parts else "")


def imports_down(source: str, target: str) -> bool:
    """Whether room `source` may import room `target`."""
    if source == target:
        return True
    if source in LEAVES:
        return target in BELOW_LEAVES
    if target in LEAVES:
        return True
    return LAYERS.index(source) < LAYERS.index(target)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    unknown = {_room(m) for m in graph} - set(LAYERS) - LEAVES
    assert not unknown, f"rooms missing from LAYERS (place each in the order): {sorted(unknown)}"
    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if not imports_down(_room(module), _room(target))]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down():
    bad = layering_violations(import_graph())
    assert not bad, "imports that point up the picture:\n" + "\n".join(bad)


# ---- the checker itself ----

@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    root = tmp_path / "pressroom"
    monkeypatch.setitem(globals(), "ROOT", root)

    def write(files: dict[str, str]) -> dict[str, set[str]]:
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return import_graph()

    return write


def test_graph_sees_lazy_relative_and_package_imports(fake_package):
    graph = fake_package({
        "__init__.py": "",
        "worker/__init__.py": "from .runner import Runner\n",
        "worker/runner.py": "def f():\n    from pressroom.spec_decode import draft\n",
        "spec_decode/__init__.py": "",
        "spec_decode/draft.py": "import pressroom.worker.runner\nfrom ..worker import runner\n",
        "core/x.py": "from pressroom.spec_decode.draft import Draft\nfrom . import y\n",
        "core/y.py": "",
    })
    assert graph["pressroom.worker"] == {"pressroom.worker.runner"}
    assert graph["pressroom.worker.runner"] == {"pressroom.spec_decode.draft"}
    assert graph["pressroom.spec_decode.draft"] == {"pressroom.worker.runner"}
    assert graph["pressroom.core.x"] == {"pressroom.spec_decode.draft", "pressroom.core.y"}
    assert find_cycle(graph) == ["pressroom.spec_decode.draft", "pressroom.worker.runner",
                                 "pressroom.spec_decode.draft"]


def test_layering_names_the_upward_import(fake_package):
    graph = fake_package({
        "__init__.py": "", "config.py": "from pressroom.engine import e\nfrom pressroom.platforms import cpu\n",
        "engine/__init__.py": "", "engine/e.py": "",
        "platforms/__init__.py": "", "platforms/cpu.py": "",
        "core/__init__.py": "", "core/s.py": "def f():\n    import pressroom.model.m\n",
        "model/__init__.py": "", "model/m.py": "from pressroom.core.outputs import StepMessage\n",
        "core/outputs.py": "",
        "worker/__init__.py": "", "worker/w.py": "import pressroom.model.m\nfrom pressroom.spec_decode import d\n",
        "spec_decode/__init__.py": "", "spec_decode/d.py": "",
    })
    # model -> core.outputs (a message module, below every room) and worker -> model (down) are allowed.
    assert layering_violations(graph) == ["pressroom.config -> pressroom.engine.e",
                                          "pressroom.core.s -> pressroom.model.m",
                                          "pressroom.worker.w -> pressroom.spec_decode.d"]
