"""`tokenloom.verify.verify`: a user's loader resumes exactly, or the report names where it does not."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenloom.pipes import (Batch, BestFitPack, ReadParquet, ShardContext, ShardUnits, Tokenize, TokenLoomLoader,
                             list_parquet_units, load_encoder, resolve_files)
from tokenloom.recipes import pretrain
from tokenloom.verify import first_difference, verify

from .conftest import synthetic_texts, write_corpus
from .test_custom_node import ForgetfulSampler, LengthFilter


@pytest.mark.parametrize("workers", [0, 2])
def test_a_recipe_passes_every_check(corpus, tok_path, workers):
    glob, _ = corpus
    lines = []
    report = verify(lambda: pretrain(glob, tokenizer=tok_path, seq_len=64, batch_size=2, num_workers=workers),
                    steps=24, progress=lines.append)
    assert report.ok, str(report)
    assert report.batches == 24 and len(report.checks) >= 5
    assert any("resume at step 0" in c.name for c in report.checks)
    assert any("right after a load" in c.name for c in report.checks)
    assert lines[0].startswith("reference") and "every resume gives" in str(report)


@dataclass
class Graph:
    glob: str
    tokenizer: str
    node: type

    def __call__(self, ctx: ShardContext):
        units = list_parquet_units(resolve_files(self.glob), "text")
        node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1)
        node = Tokenize(ReadParquet(node, units, seed=1), load_encoder(self.tokenizer), bos=0)
        node = self.node(node, 0)
        return Batch(BestFitPack(node, seq_len=63, buffer_size=8), batch_size=2, seq_len=63)


@dataclass
class Unpacked(Graph):
    """`Graph` packed flat: a forgetful node's resume gives other batches rather than a packer's error."""

    def __call__(self, ctx: ShardContext):
        from tokenloom.pipes import FlatPack
        units = list_parquet_units(resolve_files(self.glob), "text")
        node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1)
        node = self.node(Tokenize(ReadParquet(node, units, seed=1), load_encoder(self.tokenizer), bos=0), 0)
        return Batch(FlatPack(node, seq_len=63), batch_size=2, seq_len=63)


def test_a_node_that_forgets_a_counter_fails_naming_the_step_and_the_row(corpus, tok_path):
    glob, _ = corpus
    good = verify(lambda: TokenLoomLoader(Graph(glob, tok_path, LengthFilter), config={}), steps=16)
    assert good.ok, str(good)
    bad = verify(lambda: TokenLoomLoader(Graph(glob, tok_path, ForgetfulSampler), config={}), steps=16)
    assert not bad.ok
    failed = [c for c in bad.checks if not c.ok]
    # a batch that differs names its step, key, row and position; a restore that makes the packer fail
    # (what the forgetful node does to best-fit's replay) names the step and the error
    assert failed and all(" at step " in c.where for c in failed), str(bad)
    assert "usual causes" in str(bad) and "FAIL resume at step" in str(bad)
    # the packer says what a restore it cannot rebuild means (beside its internal error)
    assert all("upstream does not give the documents" in c.where for c in failed if "raised" in c.where), str(bad)


def test_first_difference_names_key_row_and_position():
    import torch
    a = {"input_ids": torch.zeros(2, 5, dtype=torch.int64)}
    b = {"input_ids": a["input_ids"].clone()}
    b["input_ids"][1, 3] = 7
    assert first_difference(a, b) == "'input_ids': row 1, position 3: 7 instead of 0"
    with pytest.raises(ValueError, match="steps=1"):
        verify(lambda: None, steps=1)


def test_a_difference_without_an_error_names_the_row(corpus, tok_path):
    glob, _ = corpus

    bad = verify(lambda: TokenLoomLoader(Unpacked(glob, tok_path, ForgetfulSampler), config={}), steps=16)
    differs = [c for c in bad.checks if not c.ok and "differs" in c.where]
    assert differs and all("row" in c.where and "position" in c.where for c in differs), str(bad)


# --- another topology: the elastic check ----------------------------------------------------------

@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_sources")
    globs = {}
    for name, n, seed in (("web", 300, 11), ("code", 200, 12)):
        write_corpus(str(root / name), synthetic_texts(n, seed=seed, tag=name[0]), files=2, row_group_size=16)
        globs[name] = str(root / name / "*.parquet")
    return globs


def _finite(globs, tok_path, **kw):
    def build(**topology):
        return pretrain(globs, tokenizer=tok_path, seq_len=64, batch_size=4, epochs=1, cycle_exhausted=False,
                        **{**kw, **topology})
    return build


@pytest.mark.parametrize("packing,predict_bos", [("bestfit", True), ("flat", False)])
def test_the_elastic_check_counts_every_token_once(two_sources, tok_path, packing, predict_bos):
    report = verify(_finite(two_sources, tok_path, packing=packing, predict_bos=predict_bos), steps=10**9,
                    points=0, chain=False, elastic=[((2, 0), (1, 1)), ((1, 0), (3, 0))])
    elastic = [c for c in report.checks if c.name.startswith("elastic")]
    assert report.ok and len(elastic) == 2, str(report)
    assert all("tokens exactly once" in c.where and "give or take" not in c.where for c in elastic), str(report)


class DropsAfterAnElasticLoad:
    """A loader that loses the first batch after it loads a list of states: the resume bug the
    elastic check is for (a rank's share of the checkpoint skipped)."""

    def __init__(self, loader):
        self.loader, self.elastic = loader, False

    def load_state_dict(self, state):
        self.elastic = isinstance(state, list)
        self.loader.load_state_dict(state)

    def __iter__(self):
        it = iter(self.loader)
        if self.elastic:
            next(it, None)
        return it

    def __getattr__(self, name):
        return getattr(self.loader, name)


def test_the_elastic_check_fails_naming_the_missing_tokens_and_the_source(two_sources, tok_path):
    inner = _finite(two_sources, tok_path)
    report = verify(lambda **t: DropsAfterAnElasticLoad(inner(**t)), steps=10**9, points=0, chain=False,
                    elastic=[((2, 0), (1, 0))], decode=load_encoder(tok_path).decode)
    assert not report.ok
    (failed,) = [c for c in report.checks if not c.ok]
    assert failed.name.startswith("elastic: saved on 2 rank(s) x 0 worker(s), resumed on 1 x 0"), str(report)
    assert "tokens missing and 0 delivered more often" in failed.where, failed.where
    # the loader handed the lost batch over (the wrapper dropped it), so its own counts agree, and it says so
    assert "every source's tokens in stats() agree" in failed.where, failed.where
    # every other check held: the same-topology resumes never load a list
    assert all(c.ok for c in report.checks if c is not failed), str(report)


def test_the_tally_counts_row_ends_by_the_label_rule():
    import torch
    from tokenloom.verify_elastic import Tally
    # two rows of T=4: row 0 holds a whole document [5, 6] (end label 0 after it) then a chunk [7, 8, 9 | 10]
    # whose last token 10 is only the row's last label; row 1 is a chunk whose row-end label is -100
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [11, 12, 13, 14]]),
             "labels": torch.tensor([[6, 0, 8, 10], [12, 13, 14, -100]]),
             "segment_ids": torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]], dtype=torch.int32)}
    t = Tally()
    t.add(batch)
    assert t.end_labels == {0} and not t.masked
    counts, unknown = t.counts(t.end_labels, t.masked)
    assert unknown == 0 and sorted(int(i) for i in counts.nonzero()[0]) == [5, 6, 7, 8, 10, 11, 12, 13, 14]
    # masked labels inside a segment (sft): a row-end -100 may hide a token
    batch["labels"][1, 0] = -100
    m = Tally()
    m.add(batch)
    assert m.masked and m.counts(m.end_labels, m.masked)[1] == 1


def test_a_difference_names_the_segment_and_its_text(corpus, tok_path):
    glob, _ = corpus
    enc = load_encoder(tok_path)

    bad = verify(lambda: TokenLoomLoader(Unpacked(glob, tok_path, ForgetfulSampler), config={}), steps=16,
                 decode=enc.decode)
    differs = [c for c in bad.checks if not c.ok and "differs" in c.where]
    assert differs, str(bad)
    # the step, the row, and the document: its segment and the text it begins with (ids 'd00042 ...')
    assert all(" at step " in c.where and "row" in c.where and "segment" in c.where and "beginning '" in c.where
               for c in differs), str(bad)


def test_the_elastic_check_holds_for_sft_with_its_masked_labels(tmp_path, tok_path):
    """sft trains on the assistant's tokens only: a row-end label of -100 may hide a token, which the
    tally counts as unknown; the check still holds, and says how many there were."""
    import numpy as np

    from tokenloom.recipes import sft

    from .test_sft import conversation, write_jsonl
    rng = np.random.default_rng(3)
    path = write_jsonl(tmp_path / "chats.jsonl", [conversation(i, rng, turns=1 + i % 4) for i in range(160)])

    def build(**topology):
        return sft(path, tokenizer=tok_path, seq_len=48, batch_size=4, epochs=1, **topology)
    report = verify(build, steps=10**9, points=0, chain=False, elastic=[((2, 0), (1, 1))])
    (elastic,) = [c for c in report.checks if c.name.startswith("elastic")]
    assert report.ok, str(report)
    assert "tokens exactly once" in elastic.where, elastic.where


def test_the_progress_ticks_each_batch_of_a_check(corpus, tok_path):
    glob, _ = corpus
    ticks = []
    verify(lambda: pretrain(glob, tokenizer=tok_path, seq_len=64, batch_size=2), steps=6, points=0, chain=False,
           tick=lambda done, tokens, total: ticks.append((done, tokens, total)))
    # the reference (6 of 6), the second run, then the resumes at 0, 1 and 5 to the reference's end
    assert ticks[:6] == [(i + 1, ticks[i][1], 6) for i in range(6)] and ticks[5][1] > ticks[0][1] > 0
    assert [t[2] for t in ticks[12:]] == [6] * 6 + [5] * 5 + [1], ticks
