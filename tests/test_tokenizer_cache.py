"""The tokenizer cache (pipes/tokenizer_cache.py): a tokenizer.json loaded before loads from
what was worked out then, with the same facts, ids, fingerprint and batches; a bad, stale or
unwritable cache costs the cold load, never a wrong answer; concurrent first loads agree."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil

import pytest

from tokenloom.pipes import tiktoken_bpe, tokenizer_cache
from tokenloom.pipes.tokenizer import BOS_CANDIDATES, load_encoder
from tokenloom.recipes import pretrain
from tokenloom.sample_data import default_tokenizer_path

from .conftest import synthetic_texts, write_corpus
from .resume import items_equal

TEXTS = tiktoken_bpe.sample_texts()[:12] + ["a <|bos|> spelt in text stays text", "ünïcödé 漢字 🙂"]


@pytest.fixture(autouse=True)
def without_fastokens(monkeypatch):
    """The cache keeps the tiktoken conversion these tests look at; fastokens, chosen before tiktoken
    where it applies, is left out of the automatic choice (tests/test_engines.py covers it)."""
    from tokenloom.pipes import fastokens_engine

    monkeypatch.setattr(fastokens_engine, "verdict", lambda *args, **kwargs: (False, "left out by this test"))
    monkeypatch.delenv("TOKENLOOM_ENGINE", raising=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENLOOM_CACHE", str(root))
    return root


@pytest.fixture
def tok_file(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    shutil.copy(default_tokenizer_path(), path)
    return str(path)


def entries(root):
    folder = root / "tokenizers"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def same_encoder(a, b):
    assert (a.fingerprint, a.engine, a.engine_note, a.vocab_size) == (b.fingerprint, b.engine, b.engine_note,
                                                                      b.vocab_size)
    assert a.special_tokens() == b.special_tokens()
    assert a.default_bos() == b.default_bos()
    assert all((x == y).all() for x, y in zip(a.encode_batch(TEXTS), b.encode_batch(TEXTS)))


def test_a_warm_load_reads_the_entry_and_loads_no_tokenizers_object(cache, tok_file, monkeypatch):
    cold = load_encoder(tok_file)
    assert cold.engine == "tiktoken" and len(entries(cache)) == 1
    # warm: nothing converted, nothing checked, tokenizers not loaded for the build's questions
    monkeypatch.setattr(tiktoken_bpe, "verdict", lambda *a, **k: pytest.fail("the verdict was worked out again"))
    warm = load_encoder(tok_file)
    assert warm._entry is not None and warm._tok is None
    for token in BOS_CANDIDATES + ("<|endoftext|>",):
        try:
            assert warm.token_id(token) == cold.token_id(token)
        except ValueError:
            with pytest.raises(ValueError, match="is not in the tokenizer's vocabulary"):
                cold.token_id(token)
    assert warm.vocab_size == cold.vocab_size and warm._tok is None
    tiktoken_bpe._encodings.clear()  # as in a fresh worker: the Encoding comes from ranks.bin, not a conversion
    monkeypatch.setattr(tiktoken_bpe, "convert", lambda payload: pytest.fail("converted instead of read"))
    shipped = pickle.loads(pickle.dumps(warm))  # what a loader worker receives
    same_encoder(shipped, cold)
    assert warm.decode(warm.encode_batch(["hello world"])[0]) == "hello world"  # tokenizers, loaded when asked


def test_batches_and_states_are_the_same_cold_and_warm(cache, tok_file, tmp_path):
    data = os.path.dirname(write_corpus(str(tmp_path / "data"), synthetic_texts(300, seed=3), files=2)[0])
    kw = dict(tokenizer=tok_file, seq_len=64, batch_size=2, num_workers=2)
    cold = pretrain(data, **kw)
    it = iter(cold)
    first = [next(it) for _ in range(4)]
    state = cold.state_dict()
    after = [next(it) for _ in range(3)]
    warm = pretrain(data, **kw)
    assert warm.dataset.factory is not None and entries(cache)
    assert items_equal(first, [b for _, b in zip(range(4), warm)])
    resumed = pretrain(data, **kw)
    resumed.load_state_dict(state)  # a state saved on the cold build loads into a warm one
    assert items_equal(after, [b for _, b in zip(range(3), resumed)])


@pytest.mark.parametrize("damage", ["truncate ranks", "flip a byte", "garbage meta", "meta without a key"])
def test_a_damaged_entry_is_ignored_and_written_again(cache, tok_file, damage):
    cold = load_encoder(tok_file)
    (name,) = entries(cache)
    where = cache / "tokenizers" / name
    if damage == "truncate ranks":
        data = (where / "ranks.bin").read_bytes()
        (where / "ranks.bin").write_bytes(data[:len(data) // 2])
    elif damage == "flip a byte":
        data = bytearray((where / "ranks.bin").read_bytes())
        data[-5] ^= 0x20
        (where / "ranks.bin").write_bytes(bytes(data))
    elif damage == "garbage meta":
        (where / "meta.json").write_text("{not json")
    else:
        meta = json.loads((where / "meta.json").read_text())
        del meta["fingerprint"]
        (where / "meta.json").write_text(json.dumps(meta))
    assert tokenizer_cache.lookup(open(tok_file, "rb").read()) is None
    again = load_encoder(tok_file)
    assert again._tok is not None  # the cold path
    same_encoder(again, cold)
    assert tokenizer_cache.lookup(open(tok_file, "rb").read()) is not None  # and the entry is whole again


def test_a_changed_file_is_another_entry(cache, tok_file):
    before = load_encoder(tok_file)
    spec = json.loads(open(tok_file).read())
    spec["added_tokens"].append({"id": before.vocab_size, "content": "<|new|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    with open(tok_file, "w") as f:
        json.dump(spec, f)
    after = load_encoder(tok_file)
    assert after._tok is not None and len(entries(cache)) == 2
    assert after.fingerprint != before.fingerprint and after.token_id("<|new|>") == before.vocab_size


def test_a_tokenizer_tiktoken_cannot_run_keeps_its_verdict(cache, tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|bos|>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|bos|>"])
    path = str(tmp_path / "wordlevel.json")
    tok.save(path)
    cold = load_encoder(path)
    assert cold.engine == "tokenizers" and "not convertible" in cold.engine_note
    warm = load_encoder(path)
    assert warm._tok is None and warm.engine_note == cold.engine_note
    assert warm.default_bos() == 1 and warm._tok is None
    same_encoder(warm, cold)
    (name,) = entries(cache)
    assert not (cache / "tokenizers" / name / "ranks.bin").exists()


def test_switched_off_the_cache_writes_nothing(tmp_path, tok_file, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", "0")
    assert tokenizer_cache.cache_root() is None
    load_encoder(tok_file)
    assert load_encoder(tok_file)._tok is not None  # cold both times


def test_an_unwritable_cache_costs_the_cold_load_only(tmp_path, tok_file, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TOKENLOOM_CACHE", str(blocker / "cache"))
    a, b = load_encoder(tok_file), load_encoder(tok_file)
    same_encoder(a, b)


def test_the_engine_switch_applies_to_a_warm_load(cache, tok_file, monkeypatch):
    load_encoder(tok_file)
    monkeypatch.setenv(tiktoken_bpe.ENV_SWITCH, "0")
    warm = load_encoder(tok_file)
    assert warm.engine == "tokenizers" and warm.engine_note.endswith("tiktoken: switched off by TOKENLOOM_TIKTOKEN=0")
    assert warm.encode_batch(["hello world"])[0].tolist() == load_encoder(default_tokenizer_path()).encode_batch(
        ["hello world"])[0].tolist()


def _load(args):
    path, root, barrier = args
    os.environ["TOKENLOOM_CACHE"] = root
    barrier.wait()
    enc = load_encoder(path)
    return enc.fingerprint, enc.engine, [a.tolist() for a in enc.encode_batch(TEXTS[:3])]


def test_concurrent_first_loads_agree_and_leave_a_whole_entry(cache, tok_file):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            got = pool.map(_load, [(tok_file, str(cache), barrier)] * 4)
    assert all(g == got[0] for g in got)
    found = tokenizer_cache.lookup(open(tok_file, "rb").read())
    assert found is not None and tokenizer_cache.read_parts(*found) is not None
    assert [p for p in os.listdir(found[0]) if p.startswith(".")] == []  # no temporary file left


def test_forked_workers_inherit_the_encoding_built_at_the_build(cache, tok_file, tmp_path, monkeypatch):
    """A warm build converts nothing and the workers build no encoding of their own: the recipe
    builds it once before forking (the workers' copy is the parent's)."""
    data = os.path.dirname(write_corpus(str(tmp_path / "data"), synthetic_texts(200, seed=5), files=2)[0])
    load_encoder(tok_file)  # fills the cache
    tiktoken_bpe._encodings.clear()
    log = tmp_path / "built.txt"
    real = tiktoken_bpe._build

    def build(parts):  # forked workers inherit this patch: each build is logged with its process
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(parts)

    monkeypatch.setattr(tiktoken_bpe, "_build", build)
    loader = pretrain(data, tokenizer=tok_file, seq_len=64, batch_size=2, num_workers=2,
                      multiprocessing_context="fork")
    assert len(list(zip(range(4), loader))) == 4  # both workers encoded text
    assert log.read_text().split() == [str(os.getpid())]  # built once, here, at the build
