"""Docstrings are reference (issue 36): a module's docstring says what it does, its algorithm and
invariants; measured figures and their history live in docs/performance.md and benchmarks/RESULTS.md.
Every public node class documents its arguments and its state keys."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import tokenloom
from tokenloom.pipes.base import Node

ROOT = pathlib.Path(tokenloom.__file__).resolve().parent.parent
LIBRARY = ("pipes", "recipes", "tokenloom")

#: A measured time, rate, size or ratio: "1.16 s", "26 minutes", "0.93x", "12%", "21 M tokens/s", "4.5 MB".
MEASURED = re.compile(
    r"\d(?:[\d,]*\d)?(?:\.\d+)?\s*(?:x\b|%|(?:s|ms|us|µs|ns|sec|seconds?|minutes?|hours?)\b"
    r"|[KMG]B\b|[KMG]iB\b|(?:[KM] )?tokens?/s\b|M tokens\b)")


def library_modules():
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path


def module_docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


@pytest.mark.parametrize("path", list(library_modules()), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_docstring_quotes_no_measurement(path):
    found = MEASURED.findall(module_docstring(path))
    assert not found, (f"{path.relative_to(ROOT)}: its module docstring quotes measured figures {found}; move them to "
                       "docs/performance.md or benchmarks/RESULTS.md and name the benchmark instead")


def test_no_class_or_function_docstring_quotes_a_measurement():
    found = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                figures = MEASURED.findall(ast.get_docstring(node) or "")
                if figures:
                    found.append(f"{path.relative_to(ROOT)}: {node.name}: {figures}")
    assert not found, "docstrings quoting measured figures (move them to docs/performance.md):\n" + "\n".join(found)


def test_the_pattern_catches_figures():
    for text in ("reached its first batch in 1.16 s", "the replay took 7-26 minutes", "0.93x tiktoken",
                 "pads 0.46% of rows", "21.3 M tokens/s", "4.5 MB a worker", "~1 µs a call"):
        assert MEASURED.search(text), text
    for text in ("O(C/64) per placement", "16 rows' worth", "buffer_size=1000", "issue 14", "seq_len + 1"):
        assert not MEASURED.search(text), text


def public_node_classes():
    seen = {}
    for top in ("tokenloom.pipes", "tokenloom.recipes"):
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            if info.name.rsplit(".", 1)[-1].startswith("_"):
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (inspect.isclass(obj) and issubclass(obj, Node) and obj is not Node and not name.startswith("_")
                        and obj.__module__ == module.__name__):
                    seen[f"{obj.__module__}.{name}"] = obj
    return seen


NODES = public_node_classes()


def test_the_node_classes_are_found():
    names = {k.rsplit(".", 1)[-1] for k in NODES}
    assert {"BestFitPack", "FlatPack", "Mix", "Tokenize", "ShardUnits", "Batch", "ReadParquet"} <= names


@pytest.mark.parametrize("name", sorted(NODES))
def test_public_node_documents_arguments_and_state_keys(name):
    cls = NODES[name]
    doc = cls.__doc__ or ""  # its own docstring, not a base class's
    assert "Args:" in doc, f"{name}: its class docstring has no 'Args:' section"
    assert "State keys:" in doc, f"{name}: its class docstring has no 'State keys:' section"
    for key in cls.STATE_KEYS:
        constant = next((k for k, v in vars(cls).items() if v == key and k.isupper()), None)
        named = [n for n in (constant, key) if n]
        assert any(n in doc for n in named), f"{name}: state key {key!r} is not documented"
