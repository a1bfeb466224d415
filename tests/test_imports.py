"""Imports run one way (issue 36): the stages every graph shares (sources, packing, mixing, tokenizing,
sharding, batching, items) never import the loader or the package root, and no module imports itself
back through others. Read from the code (every import, a function's own included; ``TYPE_CHECKING``
blocks aside), not from what happens to be imported at run time."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Where each folder is imported from (pyproject.toml maps pipes/ and recipes/ into the package).
PACKAGES = {"pipes": "tokenloom.pipes", "recipes": "tokenloom.recipes", "tokenloom": "tokenloom"}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package] + parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif target in modules and not (path.parent / alias.name).exists() and not any(
                        p.name.startswith(alias.name + ".") for p in path.parent.iterdir()):
                    found.add(target)  # a name defined in that module (not a compiled submodule)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found - {name}


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


#: What each part of the library may import: the stages every graph shares only other stages; the
#: loader the stages too (never a recipe, the CLI or an integration); the recipes the library's pipes
#: (never the CLI, the package root or an integration). The first matching prefix decides.
RULES = (
    ("tokenloom.pipes.loader", ("tokenloom.pipes.",)),
    ("tokenloom.pipes.", ("tokenloom.pipes.",)),
    ("tokenloom.recipes", ("tokenloom.pipes.", "tokenloom.recipes.")),
)


def _wrong_imports(graph: Dict[str, Set[str]]) -> List[str]:
    wrong = []
    for name, targets in graph.items():
        rule = next((allowed for prefix, allowed in RULES if name.startswith(prefix)), None)
        if rule is None:
            continue
        stage = not name.startswith("tokenloom.pipes.loader") and name.startswith("tokenloom.pipes.")
        for target in sorted(targets):
            if not target.startswith(rule) or (stage and target.startswith("tokenloom.pipes.loader")):
                wrong.append(f"{name} imports {target}")
    return wrong


def test_imports_run_one_way():
    wrong = _wrong_imports(_graph())
    assert not wrong, "\n".join(wrong)


def test_the_rules_refuse_imports_the_wrong_way():
    graph = {"tokenloom.pipes.mix": {"tokenloom.pipes.loader.bridge", "tokenloom.pipes.items"},
             "tokenloom.pipes.loader.bridge": {"tokenloom.recipes.settings", "tokenloom.pipes.compat.torchdata"},
             "tokenloom.recipes.packed": {"tokenloom.cli_config", "tokenloom.pipes.mix"},
             "tokenloom.pipes.sources.files": {"tokenloom", "tokenloom.integrations.accelerate"}}
    assert sorted(_wrong_imports(graph)) == [
        "tokenloom.pipes.loader.bridge imports tokenloom.recipes.settings",
        "tokenloom.pipes.mix imports tokenloom.pipes.loader.bridge",
        "tokenloom.pipes.sources.files imports tokenloom",
        "tokenloom.pipes.sources.files imports tokenloom.integrations.accelerate",
        "tokenloom.recipes.packed imports tokenloom.cli_config"]


#: The storage layer of sources (pipes/sources/__init__.py): bytes from where they live. It never
#: imports the formats above it.
STORAGE = ("files", "from_uri", "http_store", "hf_store", "retry", "host_cache", "listing_at_once",
           "parquet_footer", "readahead", "unit_readahead", "first_fetches")
SOURCES = "tokenloom.pipes.sources."


def _storage_imports_formats(graph: Dict[str, Set[str]]) -> List[str]:
    storage = {SOURCES + m for m in STORAGE}
    return [f"{name} imports {target}" for name in sorted(storage & set(graph)) for target in sorted(graph[name])
            if target.startswith(SOURCES) and target not in storage]


def test_sources_storage_never_imports_a_format():
    graph = _graph()
    assert all(SOURCES + m in graph for m in STORAGE), "a storage module moved: update STORAGE"
    wrong = _storage_imports_formats(graph)
    assert not wrong, "\n".join(wrong)
    assert _storage_imports_formats({SOURCES + "readahead": {SOURCES + "parquet"}}) == [
        f"{SOURCES}readahead imports {SOURCES}parquet"]


def test_no_import_cycle():
    graph = _graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    cycles: List[List[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_check_sees_an_import_into_the_loader():
    """A control: the reader of imports finds the stages' imports of the loader's modules."""
    graph = _graph()
    assert "tokenloom.pipes.loader.elastic" in graph["tokenloom.pipes.loader.node_dataset"]
    assert "tokenloom.pipes.graph" in graph["tokenloom.pipes.pack.savepoint"]


IMPORT_EVERYTHING = r"""
import atexit, importlib, json, os, pkgutil, sys
import numpy, pyarrow, pyarrow.parquet, torch, torchdata.nodes, tokenizers  # their own hooks are theirs
seen = []
real_fork, real_exit = os.register_at_fork, atexit.register
def fork(**hooks):
    seen.extend(f"{h.__module__}.{h.__qualname__} (fork)" for h in hooks.values())
    return real_fork(**hooks)
def exit_(fn, *a, **k):
    seen.append(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)} (exit)")
    return real_exit(fn, *a, **k)
os.register_at_fork, atexit.register = fork, exit_
import tokenloom, tokenloom.pipes, tokenloom.recipes
for package in (tokenloom.pipes, tokenloom.recipes):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not info.name.split(".")[-1].startswith("_packcore"):
            importlib.import_module(info.name)
print(json.dumps([s for s in seen if s.startswith("tokenloom")]))
"""


def test_importing_tokenloom_registers_no_process_hook():
    """Fork and exit hooks are installed by the code that needs them, when it first needs them
    (pipes/process_hooks.py), not by importing the module."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
