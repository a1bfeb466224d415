"""A saved state only loads into a loader with the same configuration, and says what changed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenloom.recipes import pretrain
from tokenloom.pipes.loader.bridge import decode_state

from .conftest import synthetic_texts, write_corpus
from .resume import torch_roundtrip


def _state(glob, tok_path, **kw):
    args = dict(seq_len=63, batch_size=2, buffer_size=40)
    args.update(kw)
    loader = pretrain(glob, tokenizer=tok_path, **args)
    it = iter(loader)
    next(it)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize("change,setting", [
    (dict(num_workers=1), "num_workers"),
    (dict(seq_len=127), "seq_len"),
    (dict(batch_size=3), "batch_size"),
    (dict(packing="flat"), "packing"),
    (dict(seed=5), "seed"),
])
def test_changed_setting_is_named(corpus, tok_path, change, setting):
    glob, _ = corpus
    state = _state(glob, tok_path)
    args = dict(seq_len=63, batch_size=2, buffer_size=40)
    args.update(change)
    other = pretrain(glob, tokenizer=tok_path, **args)
    with pytest.raises(ValueError, match=setting):
        other.load_state_dict(state)


def test_worker_count_change_is_a_value_error_not_an_assertion(corpus, tok_path):
    glob, _ = corpus
    state = _state(glob, tok_path, num_workers=2)
    other = pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40, num_workers=3)
    with pytest.raises(ValueError, match="num_workers: saved with 2, this loader has 3"):
        other.load_state_dict(state)


def test_changed_sources_and_tokenizer_are_named(tmp_path, corpus, tok_path):
    glob, texts = corpus
    state = _state(glob, tok_path)
    other_dir = tmp_path / "other"
    write_corpus(str(other_dir), synthetic_texts(900, seed=1))
    with pytest.raises(ValueError, match="sources"):
        pretrain(str(other_dir), tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40).load_state_dict(state)
    from tokenloom.sample_data import train_tokenizer

    other_tok = tmp_path / "tok.json"
    train_tokenizer(texts[:300], vocab_size=400).save(str(other_tok))
    with pytest.raises(ValueError, match="tokenizer"):
        pretrain(glob, tokenizer=str(other_tok), seq_len=63, batch_size=2, buffer_size=40).load_state_dict(state)


def test_moved_corpus_still_matches(tmp_path, corpus, tok_path):
    """The fingerprint uses names relative to the spec and sizes, so a moved corpus resumes."""
    glob, _ = corpus
    state = _state(glob, tok_path)
    moved = tmp_path / "moved"
    shutil.copytree(os.path.dirname(glob), moved)
    pretrain(str(moved / "*.parquet"), tokenizer=tok_path, seq_len=63, batch_size=2,
             buffer_size=40).load_state_dict(state)


def test_state_is_plain_data_loadable_with_weights_only(corpus, tok_path):
    glob, _ = corpus
    for nw in (0, 2):
        state = _state(glob, tok_path, num_workers=nw)
        assert torch_roundtrip(state) == state


def test_not_a_state_and_wrong_version(corpus, tok_path):
    glob, _ = corpus
    loader = pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2)
    with pytest.raises(ValueError, match="not a tokenloom loader state"):
        loader.load_state_dict({"foo": 1})
    state = decode_state(_state(glob, tok_path))
    state["tokenloom"]["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40).load_state_dict(state)


def test_a_version_7_state_still_loads(corpus, tok_path):
    """Version 8 added best-fit's ``repull`` (documents that came in pieces, re-read from their latest
    piece); a version-7 state is one without it, and resumes as it was saved."""
    glob, _ = corpus
    args = dict(tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40)
    loader = pretrain(glob, **args)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = decode_state(loader.state_dict())
    want = next(it)
    dropped = []

    def drop(tree):
        if isinstance(tree, dict):
            if "repull" in tree:
                dropped.append(tree.pop("repull"))
            for v in tree.values():
                drop(v)
        elif isinstance(tree, list):
            for v in tree:
                drop(v)

    drop(state)
    assert dropped == [[]]  # one packer, no document in pieces (one source)
    state["tokenloom"]["version"] = 7
    other = pretrain(glob, **args)
    other.load_state_dict(state)
    got = next(iter(other))
    assert all(torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor))
    state["tokenloom"]["version"] = 6
    with pytest.raises(ValueError, match="versions 7, 8"):
        pretrain(glob, **args).load_state_dict(state)
