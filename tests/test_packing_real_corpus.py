"""Packing on a real corpus (the stdlib's code and docstrings with the shipped tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloom.pipes import ReadParquet, ShardUnits, Tokenize, list_parquet_units, load_encoder, resolve_files
from tokenloom.recipes import pretrain
from tokenloom.sample_data import default_tokenizer_path

from .resume import check_loader_resume


def all_document_tokens(files, seq_len):
    """Every document's tokens (BOS first), straight from the reader and tokenizer."""
    units = list_parquet_units(resolve_files(files), "text")
    enc = load_encoder(default_tokenizer_path())
    node = Tokenize(ReadParquet(ShardUnits(units.rows, shard=0, num_shards=1, seed=0, epochs=1), units), enc, bos=0)
    node.reset(None)
    return [d.ids for d in node]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bestfit_finite_epoch_emits_every_token_exactly_once(real_corpus, num_workers):
    files = real_corpus["code"] + real_corpus["prose"]
    seq_len = 1023
    loader = pretrain(files, tokenizer=default_tokenizer_path(), seq_len=seq_len, batch_size=8, epochs=1,
                      buffer_size=200, num_workers=num_workers)
    # Raw labels (row[1:]): this test reads each row's last token back from labels[:, -1], which the
    # document-end rule (predict_bos, tests/test_labels.py) replaces by BOS after a document's end.
    loader.dataset.factory.specials = {**loader.dataset.factory.specials, "end_label": None}
    vocab = 1 << 16
    out = np.zeros(vocab, np.int64)  # token id -> how often it came out (a multiset, compared whole)
    for b in loader:
        # rows are input_ids plus the last label; rebuild each row's seq_len + 1 tokens
        last = b["labels"][:, -1:]
        rows = np.concatenate([b["input_ids"].numpy(), last.numpy()], axis=1)
        seg = b["segment_ids"].numpy()
        for r in range(rows.shape[0]):
            n_real = int((seg[r] > 0).sum()) + int(last[r, 0] != -100)
            out += np.bincount(rows[r, :n_real], minlength=vocab)
    want = np.zeros(vocab, np.int64)
    for ids in all_document_tokens(files, seq_len):
        want += np.bincount(ids, minlength=vocab)
    assert np.array_equal(out, want), "the non-padding tokens must be exactly the documents' tokens"
    stats = loader.stats()
    assert stats["tokens_in"] == stats["tokens_out"] == int(want.sum())
    # pad counted over all rows, including the final partial batch's empty rows
    assert stats["padding"] / (stats["tokens_out"] + stats["padding"]) <= 0.005


def test_crop_discard_is_near_the_floor(real_corpus):
    files = real_corpus["code"] + real_corpus["prose"]
    seq_len = 1023
    lengths = np.array([len(ids) for ids in all_document_tokens(files, seq_len)])
    floor = np.maximum(lengths - (seq_len + 1), 0).sum() / lengths.sum()
    loader = pretrain(files, tokenizer=default_tokenizer_path(), seq_len=seq_len, batch_size=8, epochs=1,
                      buffer_size=200, packing="bestfit-crop")
    batches = list(loader)
    stats = loader.stats()
    discard = stats["discarded"] / stats["tokens_in"]
    assert floor > 0.2  # code files are long: most of what crop loses is the floor
    assert discard - floor < 0.02, f"{discard=:.4f} {floor=:.4f}"
    # Padded only in the last rows, those built once the stream ended (issue 42): then every buffered
    # document (at most buffer_size) gets a row, whole or its first row's worth, and the gaps are padded.
    rows = torch.cat([b["segment_ids"] for b in batches])
    padded = (rows == 0).any(dim=1).nonzero().flatten().tolist()
    assert padded, "the last rows of a finite crop stream are padded"
    assert len(rows) - padded[0] <= 200, f"padding from row {padded[0]} of {len(rows)}: before the stream ended"


@pytest.mark.parametrize("packing", ["bestfit", "bestfit-crop"])
def test_exact_resume_with_a_full_buffer(real_corpus, packing):
    files = real_corpus["prose"]
    build = lambda: pretrain(files, tokenizer=default_tokenizer_path(), seq_len=511, batch_size=4, buffer_size=300,
                             packing=packing, num_workers=2, seed=5)
    check_loader_resume(build, steps=[5, 12], total=16)
