"""`tokenloom.verify.verify`: a user's loader resumes exactly, or the report names where it does not."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenloom.pipes import (Batch, BestFitPack, ReadParquet, ShardContext, ShardUnits, Tokenize, TokenLoomLoader,
                             list_parquet_units, load_encoder, resolve_files)
from tokenloom.recipes import pretrain
from tokenloom.verify import first_difference, verify

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

    @dataclass
    class Unpacked(Graph):
        def __call__(self, ctx):
            from tokenloom.pipes import FlatPack
            units = list_parquet_units(resolve_files(self.glob), "text")
            node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1)
            node = self.node(Tokenize(ReadParquet(node, units, seed=1), load_encoder(self.tokenizer), bos=0), 0)
            return Batch(FlatPack(node, seq_len=63), batch_size=2, seq_len=63)
    bad = verify(lambda: TokenLoomLoader(Unpacked(glob, tok_path, ForgetfulSampler), config={}), steps=16)
    differs = [c for c in bad.checks if not c.ok and "differs" in c.where]
    assert differs and all("row" in c.where and "position" in c.where for c in differs), str(bad)
