"""Hugging Face datasets as a source (pipes/sources/hf_datasets.py): a Dataset, a DatasetDict split
or a save_to_disk folder, read through its Arrow files.

Every dataset is built here with ``Dataset.from_dict`` and ``save_to_disk``; nothing is downloaded.
Documents are short ('d00042 w w ...', at most 30 words) so each fits a row whole and a batch
names its documents by their ids.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read only what the tests write
datasets = pytest.importorskip("datasets")

from tokenloom.pipes.shard import ShardUnits  # noqa: E402
from tokenloom.pipes.sources import hf_datasets  # noqa: E402
from tokenloom.pipes.sources.cache import build_cache  # noqa: E402
from tokenloom.pipes.sources.readers import plan_source  # noqa: E402
from tokenloom.pipes.tokenizer import load_encoder, resolve_special  # noqa: E402
from tokenloom.recipes import pretrain, sft  # noqa: E402

from .conftest import synthetic_texts  # noqa: E402
from .resume import check_loader_resume  # noqa: E402

N = 600
SEQ_LEN, BATCH = 128, 4
ID = re.compile(r"[ds]\d{5}")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A save_to_disk folder of N documents in 3 Arrow files, with a 'text' and a 'story' column
    (ids 'd...' and 's...'), and a DatasetDict folder of two splits."""
    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("hf")
    texts = [" ".join(t.split()[:30]) for t in synthetic_texts(N, seed=3)]
    stories = ["s" + t[1:] for t in texts]
    folder = str(root / "ds")
    datasets.Dataset.from_dict({"text": texts, "story": stories}).save_to_disk(folder, num_shards=3)
    dd = str(root / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:500]}),
                          "test": datasets.Dataset.from_dict({"text": texts[500:]})}).save_to_disk(dd)
    return {"folder": folder, "dict": dd, "texts": texts, "stories": stories}


def _ids(batches, bos: int):
    """The ids of the documents in these batches: one per segment (each document fits a row whole)."""
    out = []
    for b in batches:
        for inp, lab, seg in zip(b["input_ids"], b["labels"], b["segment_ids"]):
            row = torch.cat([inp, lab[-1:]])
            seg = torch.cat([seg, seg[-1:] if int(lab[-1]) != -100 else torch.zeros(1, dtype=seg.dtype)])
            for s in seg.unique().tolist():
                if s:
                    toks = row[seg == s].tolist()
                    assert toks[0] == bos, f"a segment does not start with BOS: {toks[:8]}"
                    out.append(toks[1:12])
    return out


def _decode_ids(batches, tok_path):
    enc = load_encoder(tok_path)
    bos = resolve_special(enc, None, default_bos=True)
    ids = []
    for toks in _ids(batches, bos):
        m = ID.match(enc.decode(toks))
        assert m, f"a document does not start with its id: {enc.decode(toks)!r}"
        ids.append(m.group(0))
    return ids


def _loader(spec, tok_path, **kw):
    kw.setdefault("epochs", 1)
    return pretrain({"hf": spec}, tok_path, seq_len=SEQ_LEN, batch_size=BATCH, packing="bestfit", buffer_size=64, **kw)


# --- resume, coverage, the two spellings ----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("as_object", [False, True], ids=["folder", "object"])
def test_exact_resume(hf, tok_path, num_workers, as_object, monkeypatch):
    """Saved after 3 and 17 batches, restored into a fresh loader: the rest is bitwise the same.
    Units of 64 rows at most, so record batches are cut into row ranges as well."""
    monkeypatch.setattr(hf_datasets, "UNIT_ROWS", 64)
    spec = datasets.load_from_disk(hf["folder"]) if as_object else hf["folder"]
    plan = plan_source("hf", spec)
    assert len(plan.units.rows) == 12 and plan.units.rows.max() <= 64  # 3 files x 200 rows -> 4 pieces each
    ref = check_loader_resume(lambda: _loader(spec, tok_path, num_workers=num_workers), steps=[3, 17])
    assert len(ref) > 30


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_folder_and_object_give_the_same_batches_every_row_once_per_epoch(hf, tok_path, num_workers):
    """Two epochs: each document twice, once per epoch; the folder and load_from_disk(folder) agree."""
    obj = list(_loader(datasets.load_from_disk(hf["folder"]), tok_path, num_workers=num_workers, epochs=2))
    path = list(_loader(hf["folder"], tok_path, num_workers=num_workers, epochs=2))
    assert len(obj) == len(path) and all(torch.equal(a[k], b[k]) for a, b in zip(obj, path) for k in a)
    ids = _decode_ids(path, tok_path)
    want = {f"d{i:05d}" for i in range(N)}
    counts = collections.Counter(ids)
    assert set(counts) == want, f"missing {sorted(want - set(counts))[:5]}, stray {sorted(set(counts) - want)[:5]}"
    wrong = [(k, c) for k, c in counts.items() if c != 2]
    assert not wrong, f"documents not read once per epoch: {wrong[:5]}"
    first = collections.Counter(_decode_ids(list(_loader(hf["folder"], tok_path, num_workers=num_workers)), tok_path))
    assert set(first) == want and set(first.values()) == {1}


def test_text_column_chosen(hf, tok_path):
    ids = _decode_ids(list(_loader(datasets.load_from_disk(hf["folder"]), tok_path, text_column="story")), tok_path)
    assert sorted(ids) == [f"s{i:05d}" for i in range(N)]


def test_conversations_from_a_dataset(tmp_path, tok_path):
    """sft reads a list column (messages) of a dataset like a parquet one."""
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}] for i in range(40)]
    datasets.Dataset.from_dict({"messages": convs}).save_to_disk(str(tmp_path / "chat"))
    batches = list(sft({"chat": str(tmp_path / "chat")}, tok_path, seq_len=64, batch_size=2, epochs=1))
    assert sum(int((b["labels"] != -100).sum()) for b in batches) > 40


# --- what the rows are: transforms datasets records on its memory-mapped tables --------

def _read_all(spec, column="text"):
    """Every document one shard reads in one epoch, through the worker's reader."""
    plan = plan_source("hf", spec, column=column)
    reader = plan.reader(ShardUnits(plan.units.rows, shard=0, num_shards=1, seed=0, epochs=1), seed=0)
    reader.reset(None)
    return [d.text for d in reader]


def test_transforms_read_the_rows_the_dataset_shows(hf):
    ds = datasets.load_from_disk(hf["folder"])
    cases = {
        "select_columns": (ds.select_columns(["story"]), "story"),
        "rename_column": (ds.remove_columns("text").rename_column("story", "text"), "text"),
        "contiguous select": (ds.select(range(150, 420)), "text"),
        "shard": (ds.shard(4, 1, contiguous=True), "text"),
        "concatenate": (datasets.concatenate_datasets([ds.select(range(10, 30)), ds.select(range(590, 600))]), "text"),
    }
    for what, (view, column) in cases.items():
        got = _read_all(view, column)
        assert sorted(got) == sorted(view[column]), f"{what}: the rows read are not the dataset's"


def test_plan_pickles_as_paths(hf):
    plan = plan_source("hf", datasets.load_from_disk(hf["folder"]))
    raw = pickle.dumps(plan)
    assert b"arrow_dataset" not in raw and len(raw) < 4000, f"{len(raw)} bytes"


# --- refusals -------------------------------------------------------------------------

def test_missing_column_named(hf, tok_path):
    for spec in (hf["folder"], datasets.load_from_disk(hf["folder"])):
        with pytest.raises(ValueError, match=r"column 'body' not found.*\['text', 'story'\].*text_column="):
            _loader(spec, tok_path, text_column="body")
    with pytest.raises(ValueError, match=r"column 'convo' not found.*messages_field="):
        sft({"chat": hf["folder"]}, tok_path, seq_len=64, messages_field="convo")


def test_iterable_dataset_refused_pointing_to_parquet(hf, tok_path):
    stream = datasets.load_from_disk(hf["folder"]).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"streaming datasets\.IterableDataset.*refs/convert/parquet"):
        _loader(stream, tok_path)


def test_dataset_dict_without_a_split_names_its_splits(hf, tok_path):
    dd = datasets.load_from_disk(hf["dict"])
    for spec in (dd, hf["dict"]):
        with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):
            _loader(spec, tok_path)
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):  # not two sources named after the splits
        pretrain(dd, tok_path, seq_len=SEQ_LEN, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):  # nor a cache of two such sources
        build_cache(dd, tok_path, os.path.join(hf["dict"] + "-cache"), processes=1)
    assert not os.path.exists(hf["dict"] + "-cache")
    assert plan_source("hf", os.path.join(hf["dict"], "train")).total_rows == 500
    assert plan_source("hf", dd["test"]).total_rows == 100


def test_in_memory_and_indices_mapping_refused(hf, tok_path):
    with pytest.raises(ValueError, match=r"held in memory.*save_to_disk"):
        _loader(datasets.Dataset.from_dict({"text": hf["texts"]}), tok_path)
    with pytest.raises(ValueError, match=r"indices mapping.*flatten_indices"):
        _loader(datasets.load_from_disk(hf["folder"]).shuffle(seed=0), tok_path)


def _arrow(folder):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("data-"))


@pytest.mark.parametrize("as_object", [False, True], ids=["folder", "object"])
def test_changed_dataset_refused_at_resume(hf, tok_path, tmp_path, as_object):
    """A state saved on a dataset is refused by the same folder rewritten: one document more
    (a file resized), or one document a few bytes longer in a file of the very same size
    (the content key: the column's buffer sizes)."""
    folder = str(tmp_path / "ds")
    shutil.copytree(hf["folder"], folder)
    load = (lambda: _loader(datasets.load_from_disk(folder), tok_path)) if as_object else \
        (lambda: _loader(folder, tok_path))
    loader = load()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it, loader
    sizes = [os.path.getsize(p) for p in _arrow(folder)]

    def rewrite(texts):
        shutil.rmtree(folder)
        stories = ["s" + t[1:] for t in texts]
        datasets.Dataset.from_dict({"text": texts, "story": stories}).save_to_disk(folder, num_shards=3)

    # the same size: doc 0 longer or shorter by as many bytes as the 8-byte padding absorbs
    for delta in [*range(1, 8), *range(-1, -8, -1)]:
        texts = list(hf["texts"])
        texts[0] = texts[0] + "x" * delta if delta > 0 else texts[0][:delta]
        rewrite(texts)
        if [os.path.getsize(p) for p in _arrow(folder)] == sizes:
            break
    else:
        pytest.fail(f"no same-size rewrite found (sizes {sizes})")
    with pytest.raises(ValueError, match=r"data-00000-of-00003\.arrow rewritten \(same size"):
        load().load_state_dict(state)

    rewrite(hf["texts"] + ["d99999 one more"])
    with pytest.raises(ValueError, match=r"source .hf. changed since the state was saved: .*arrow resized"):
        load().load_state_dict(state)

    rewrite(hf["texts"])  # the same documents again: the state loads
    resumed = load()
    resumed.load_state_dict(state)
    assert next(iter(resumed))["input_ids"].shape == (BATCH, SEQ_LEN)


@pytest.mark.slow
def test_elastic_resume_reads_every_row_once(hf, tok_path, monkeypatch):
    """One epoch on 2 workers, saved after 5 batches, resumed on 3 workers from the list of states
    (elastic): the batches before and after hold every document once."""
    monkeypatch.setattr(hf_datasets, "UNIT_ROWS", 64)
    loader = _loader(hf["folder"], tok_path, num_workers=2)
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it, loader
    resumed = _loader(datasets.load_from_disk(hf["folder"]), tok_path, num_workers=3)
    resumed.load_state_dict([state])
    counts = collections.Counter(_decode_ids(head + list(resumed), tok_path))
    assert set(counts) == {f"d{i:05d}" for i in range(N)} and set(counts.values()) == {1}, \
        f"{len(counts)} documents, {[(k, c) for k, c in counts.items() if c != 1][:5]} more than once"


def test_a_token_cache_of_a_saved_dataset_gives_the_same_batches(tmp_path, tok_path):

    texts = synthetic_texts(1500, seed=11)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    src = {"hf": str(tmp_path / "hf")}
    done = build_cache(src, tok_path, str(tmp_path / "cache"), processes=2)
    assert done["complete"] and done["sources"]["hf"]["documents"] == len(texts)
    args = dict(tokenizer=tok_path, seq_len=95, batch_size=2, buffer_size=64, epochs=1, num_workers=2)
    fly = list(pretrain(src, **args))
    cached = pretrain(src, cache=str(tmp_path / "cache"), cache_strict=True, **args)
    got = list(cached)
    assert len(got) == len(fly) > 20
    assert all(torch.equal(a[k], b[k]) for a, b in zip(fly, got) for k in a)
    assert cached.stats()["sources"]["hf"]["tokenized"] == 0  # every document came from the cache
