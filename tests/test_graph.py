"""The graph's shape is declared (pipes/graph.py): every tokenloom node names its parents and its role,
and nothing in the library recognizes a node by its class name (issue 35)."""

from __future__ import annotations

import pathlib
import re

import pytest

from tokenloom.pipes import graph
from tokenloom.pipes.base import Node

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _node_classes():
    import tokenloom.pipes  # noqa: F401 - imports every node module
    import tokenloom.recipes  # noqa: F401

    seen, todo = set(), [Node]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen and sub.__module__.startswith("tokenloom."):
                seen.add(sub)
                todo.append(sub)
    return sorted(seen, key=lambda c: c.__qualname__)


def test_no_class_name_decides_anything_in_the_library():
    found = []
    for folder in ("pipes", "recipes", "tokenloom"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"__name__\s*(==|!=|in\b)", line) and "__main__" not in line:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "nodes are told apart by their declared ROLE (pipes/graph.py), not their names:\n" + \
        "\n".join(found)


#: Every node class of the library and its role: a new node must be placed here, deciding what the walkers
#: see of it (a multiplex reader of examples is no shard reader: elastic resume is not for multiplex).
ROLES = {"Batch": graph.BATCH, "BatchExamples": graph.OTHER, "BestFitPack": graph.PACKER, "FlatPack": graph.PACKER,
         "FromList": graph.OTHER, "Mix": graph.MIX, "Pieces": graph.PIECES, "ReadArrow": graph.READER,
         "ReadCached": graph.READER, "ReadCachedText": graph.READER, "ReadJsonl": graph.READER,
         "ReadList": graph.OTHER, "ReadParquet": graph.READER, "ReadText": graph.READER, "RenderChat": graph.BRANCH,
         "ShardUnits": graph.SHARD, "Take": graph.OTHER, "Tokenize": graph.BRANCH, "WithStats": graph.PASS}


def test_every_library_node_declares_its_role():
    assert {cls.__qualname__: cls.ROLE for cls in _node_classes()} == ROLES


def test_the_recipes_nodes_declare_their_roles():
    from tokenloom.pipes import BestFitPack, ReadParquet, ShardUnits, Tokenize
    from tokenloom.pipes.batch import Batch
    from tokenloom.pipes.chat import RenderChat
    from tokenloom.pipes.mix import Mix
    from tokenloom.pipes.pack.flat import FlatPack
    from tokenloom.pipes.pieces import Pieces

    roles = {ShardUnits: graph.SHARD, ReadParquet: graph.READER, Tokenize: graph.BRANCH, RenderChat: graph.BRANCH,
             Pieces: graph.PIECES, Mix: graph.MIX, BestFitPack: graph.PACKER, FlatPack: graph.PACKER,
             Batch: graph.BATCH}
    assert {cls: cls.ROLE for cls in roles} == roles
    assert all(isinstance(cls, type) and issubclass(cls, graph.Branch) for cls in (Tokenize, RenderChat))


def test_a_recipes_graph_is_walked_from_the_batch_to_every_sharder(demo_corpus):
    """pretrain's graph of two sources: every reader and sharder is reached through declared parents."""
    from tokenloom.pipes.loader.bridge import ShardContext
    from tokenloom.recipes import pretrain

    sources = {k: demo_corpus[k] for k in ("code", "prose")}
    loader = pretrain(sources, tokenizer="demo", seq_len=64, batch_size=2)
    root = loader.dataset.factory(ShardContext(0, 1, 0, 0))
    roles = [graph.role_of(n) for n in graph.walk(root)]
    assert roles.count(graph.READER) == roles.count(graph.SHARD) == roles.count(graph.BRANCH) == 2
    assert roles.count(graph.PACKER) == roles.count(graph.BATCH) == roles.count(graph.MIX) == 1
