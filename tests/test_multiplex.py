"""multiplex(): the create_multiplex_dataloader parameters, shares, strategies, epochs, resume."""

from __future__ import annotations

import collections

import pytest
import torch

from tokenloom.pipes import ShardUnits
from tokenloom.pipes.sources.examples import BatchExamples, ReadList, Take
from tokenloom.pipes.mix import Mix
from tokenloom.recipes import multiplex, print_dataloader_stats

from .resume import check_loader_resume, check_node_resume, items_equal

A = [{"text": f"a{i}", "label": i % 2} for i in range(1000)]
B = [{"text": f"b{i}", "label": i % 3} for i in range(500)]


def shares(loader):
    names = collections.Counter(n for b in loader for n in b["dataset_name"])
    total = sum(names.values())
    return {k: v / total for k, v in names.items()}, total


@pytest.mark.parametrize("strategy,kw,want_a", [
    ("proportional", {}, 2 / 3),
    ("uniform", {}, 0.5),
    ("weighted", {"sampling_weights": [0.7, 0.3]}, 0.7),
])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shares(strategy, kw, want_a, shuffle):
    loader = multiplex([("a", A), ("b", B)], batch_size=32, sampling_strategy=strategy, shuffle=shuffle, **kw)
    got, total = shares(loader)
    assert abs(got["a"] - want_a) < 0.03, got
    assert total == 1500  # epoch_length="sum"
    stats = loader.stats()["datasets"]
    assert abs(stats["a"]["share"] - got["a"]) < 1e-9 and stats["a"]["target"] == pytest.approx(want_a)


def test_proportional_sees_every_example_once_per_epoch_and_reshuffles():
    loader = multiplex([("a", A), ("b", B)], batch_size=64)
    e1 = [t for b in loader for t in b["text"]]
    e2 = [t for b in loader for t in b["text"]]
    assert sorted(e1) == sorted(e2) == sorted(x["text"] for x in A + B)
    assert e1 != e2, "each epoch is shuffled anew"


def test_round_robin_alternates_and_collates():
    batch = next(iter(multiplex([("a", A), ("b", B)], batch_size=6, sampling_strategy="round_robin")))
    assert batch["dataset_name"] == ["a", "b"] * 3
    assert isinstance(batch["text"], list) and batch["label"].dtype == torch.int64
    assert batch["dataset_idx"].tolist() == [0, 1] * 3


def test_alternating_pattern_with_bursts():
    loader = multiplex([("a", A), ("b", B)], batch_size=9, sampling_strategy="alternating", pattern=["a", "a", "b"],
                       burst=2, shuffle=False)
    assert next(iter(loader))["dataset_name"] == ["a", "a", "a", "a", "b", "b", "a", "a", "a"]


@pytest.mark.parametrize("policy,kw,total", [
    ("max", {"sampling_strategy": "round_robin"}, 2000),  # until a (1000) is done, b cycles
    ("min", {"sampling_strategy": "round_robin"}, 1000),  # until b (500) is done
    ("steps", {"steps": 7}, 7 * 32),
    ("sum", {"sampling_strategy": "sequential"}, 1500),
])
def test_epoch_length_policies(policy, kw, total):
    loader = multiplex([("a", A), ("b", B)], batch_size=32, epoch_length=policy, **kw)
    got, n = shares(loader)
    assert abs(n - total) <= 1, (n, total)


def test_sequential_runs_each_dataset_to_its_end():
    names = [n for b in multiplex([("a", A), ("b", B)], batch_size=100, sampling_strategy="sequential")
             for n in b["dataset_name"]]
    assert names == ["a"] * 1000 + ["b"] * 500


@pytest.mark.parametrize("persistent", [False, True])
def test_exact_resume_with_two_workers(persistent):
    build = lambda: multiplex([("a", A), ("b", B)], batch_size=16, num_workers=2, persistent_workers=persistent,
                              sampling_strategy="weighted", sampling_weights=[0.6, 0.4], pin_memory=False)
    ref = check_loader_resume(build, steps=[3, 20, 47], total=None)
    assert len(ref) == 94  # 1500 examples, 2 workers' shares, batches of 16


def test_nodes_resume_every_step():
    def build():
        branches = {n: ReadList(ShardUnits([len(d)], shard=1, num_shards=2, seed=3, shuffle=False), d, source=n,
                                index=i, seed=3) for i, (n, d) in enumerate([("a", A[:60]), ("b", B[:40])])}
        mix = Mix(branches, weights={"a": 1, "b": 1}, strategy="random", unit="documents", seed=3)
        return BatchExamples(Take(mix, 90), batch_size=7, sources=["a", "b"], drop_last=True)

    # 90 examples: 12 full batches of 7, then the marker that reports the 6 dropped to the loader
    assert check_node_resume(build, max_steps=50) == 13


def test_drop_last_is_counted(capsys):
    loader = multiplex([("a", A[:10]), ("b", B[:5])], batch_size=4, drop_last=True)
    assert sum(len(b["text"]) for b in loader) == 12
    assert loader.stats()["dropped_examples"] == 3
    print_dataloader_stats(loader)
    assert "Observed %" in capsys.readouterr().out


@pytest.mark.parametrize("kw,match", [
    (dict(datasets=[("a", A), ("b", [])]), "dataset 'b' is empty"),
    (dict(datasets=[("a", A), ("b", B)], sampling_strategy="weighted", sampling_weights=[1.0]), "one weight per"),
    (dict(datasets=[("a", A), ("b", B)], sampling_strategy="weighted", sampling_weights=[1, -1]), "'b' is -1"),
    (dict(datasets=[("a", A), ("b", B)], sampling_strategy="zigzag"), "zigzag"),
    (dict(datasets=[("a", A), ("b", B)], sampling_strategy="alternating", pattern=["a", "c"]), r"unknown sources \['c'\]"),
    (dict(datasets=[("a", A), ("a", B)]), "unique"),
    (dict(datasets=[("a", A), ("b", B)], sampling_weights=[1, 2]), "needs sampling_strategy='weighted'"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        multiplex(**kw)
