"""tiktoken as the engine of byte-level BPE tokenizer.json files: same ids or not used.

Tokenizers are trained here, on the standard library's own source files (nothing is
downloaded): a GPT-2 style one (ByteLevel pre-tokenizer with its built-in regex) and
a Llama-3/cl100k style one (a Split regex, then ByteLevel), ~400 KB of training text
each. Their ids are compared with `tokenizers`' on ~1.5 MB of held-out files, then
through a loader with worker processes, then across a resume. The refusals each
name their reason in the run summary, and the sample check catches a tokenizer
whose structure converts but whose ids would differ.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenloom.pipes import tiktoken_bpe
from tokenloom.pipes.tokenizer import load_encoder
from tokenloom.recipes import pretrain
from tokenloom.sample_data import default_tokenizer_path, stdlib_root

from .conftest import write_corpus

pytest.importorskip("tiktoken")  # the dev extra installs it; without it the loader stays on tokenizers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UNICODE = ("Ünïcödé façade, Straße; Ελληνικά, Русский, 日本語のテキスト, 中文。 🙂👍🏽👨‍👩‍👧 e\u0301 "
           "١٢٣ 10¹⁰\t\t  \n\n\n   x  <|endoftext|> <|bos|> don't WE'LL they’ve 1234567.89\r\n")


@pytest.fixture(autouse=True)
def without_fastokens(monkeypatch):
    """These tests are about tiktoken against tokenizers: fastokens, faster than both where it applies
    (tests/test_engines.py), is left out of the automatic choice here, as on a machine without it."""
    from tokenloom.pipes import fastokens_engine

    monkeypatch.setattr(fastokens_engine, "version", lambda: None)
    monkeypatch.setenv("TOKENLOOM_CACHE", "off")  # a kept verdict may say fastokens
    monkeypatch.delenv("TOKENLOOM_ENGINE", raising=False)


def _stdlib_files():
    return sorted(p for p in stdlib_root().glob("*.py") if p.is_file())


@pytest.fixture(scope="module")
def texts():
    """(training texts ~400 KB, held-out texts ~1.5 MB): alternate stdlib files, plus unicode."""
    train, held, used, kept = [], [UNICODE, UNICODE * 50], 0, 0
    for i, path in enumerate(_stdlib_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        if i % 2 == 0 and used < 400_000:
            train.append(text)
            used += len(text)
        elif i % 2 == 1 and kept < 1_500_000:
            held.append(text)
            kept += len(text)
    assert used > 300_000 and kept > 1_000_000
    return train, held


def train_bpe(train, pattern=None, vocab_size=8192):
    tok = Tokenizer(models.BPE())
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def trained(texts, tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    out = {}
    for style, pattern in (("gpt2", None), ("llama3", LLAMA3_PATTERN)):
        out[style] = str(root / f"{style}.json")
        train_bpe(texts[0], pattern).save(out[style])
    return out


def reference_ids(path_or_json, texts):
    """`tokenizers`' ids with the loader's setting: special-token spellings in data are text."""
    tok = Tokenizer.from_str(path_or_json) if path_or_json.lstrip().startswith("{") else Tokenizer.from_file(path_or_json)
    tok.encode_special_tokens = True
    return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def assert_same_ids(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        g = g.tolist()
        assert g == w, f"text #{i}: first difference at token {next(j for j, (a, b) in enumerate(zip(g + [-1], w + [-1])) if a != b)}"


# --- same ids ------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["gpt2", "llama3", "demo"])
def test_tiktoken_is_chosen_and_gives_the_same_ids_on_held_out_text(trained, texts, style):
    path = default_tokenizer_path() if style == "demo" else trained[style]
    enc = load_encoder(path)
    # The shipped demo tokenizer is a GPT-2 style byte-level BPE: convertible too.
    assert enc.engine == "tiktoken", enc.engine_note
    assert "same ids as tokenizers" in enc.engine_note
    held = texts[1]
    want = reference_ids(path, held)
    assert sum(map(len, want)) > 300_000
    assert_same_ids(enc.encode_batch(held), want)
    fast = tiktoken_bpe.encoding(enc._payload)
    assert_same_ids(tiktoken_bpe.encode_batch(fast, held, threads=1), want)
    assert_same_ids(tiktoken_bpe.encode_batch(fast, held, threads=3), want)


def test_a_worker_rebuilds_the_encoding_from_the_payload(trained, texts):
    enc = load_encoder(trained["llama3"])
    tiktoken_bpe._encodings.clear()  # as in a fresh worker process
    worker = pickle.loads(pickle.dumps(enc))
    assert worker._tok is None and worker.engine == "tiktoken"
    assert_same_ids(worker.encode_batch(texts[1][:40]), reference_ids(trained["llama3"], texts[1][:40]))
    assert tiktoken_bpe.encoding(worker._payload) is tiktoken_bpe.encoding(enc._payload)  # converted once
    assert worker.fingerprint == enc.fingerprint


def test_the_engine_does_not_change_the_fingerprint(trained, monkeypatch):
    fast = load_encoder(trained["gpt2"])
    monkeypatch.setenv(tiktoken_bpe.ENV_SWITCH, "0")
    slow = load_encoder(trained["gpt2"])
    assert (fast.engine, slow.engine) == ("tiktoken", "tokenizers")
    assert fast.fingerprint == slow.fingerprint  # a state saved on one engine resumes on the other
    monkeypatch.delenv(tiktoken_bpe.ENV_SWITCH)
    from_object = load_encoder(Tokenizer.from_file(trained["gpt2"]))
    assert from_object.engine == "tiktoken" and from_object.fingerprint == fast.fingerprint


def test_a_lone_surrogate_is_refused_by_both_engines(trained):
    enc = load_encoder(trained["gpt2"])
    assert enc.engine == "tiktoken"
    with pytest.raises(UnicodeEncodeError):
        enc.encode_batch(["ok", "bad \ud800 text"])
    with pytest.raises(TypeError):
        enc.tok.encode_batch_fast(["bad \ud800 text"], add_special_tokens=False)


# --- refusals ------------------------------------------------------------------------

def _edit(payload: str, how: str) -> str:
    spec = json.loads(payload)
    model = spec["model"]
    if how == "normalizer":
        spec["normalizer"] = {"type": "Lowercase"}
    elif how == "prefix space":
        spec["pre_tokenizer"]["add_prefix_space"] = True
    elif how == "added token":
        spec["added_tokens"].append({"id": len(model["vocab"]), "content": "hello", "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False, "special": False})
        model["vocab"]["hello"] = len(model["vocab"])
    elif how == "ids out of merge order":
        first, second = ("".join(m.split(" ")) if isinstance(m, str) else "".join(m) for m in model["merges"][:2])
        model["vocab"][first], model["vocab"][second] = model["vocab"][second], model["vocab"][first]
    elif how == "missing byte":
        used = {c for m in model["merges"] for part in (m.split(" ") if isinstance(m, str) else m) for c in part}
        byte = next(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in used)
        del model["vocab"][byte]
    elif how == "token made by no merge":
        model["vocab"]["ĠtokenloomĠ"] = len(model["vocab"])
    return json.dumps(spec)


REFUSALS = {
    "normalizer": "normalizer 'Lowercase'",
    "prefix space": "add_prefix_space",
    "added token": "'hello' (id",
    "ids out of merge order": "merge order and ids disagree",
    "missing byte": "of the 256 bytes have no token",
    "token made by no merge": "'ĠtokenloomĠ'",
}


@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_what_tiktoken_cannot_run_stays_on_tokenizers_and_says_why(trained, texts, tmp_path, how):
    path = tmp_path / "tokenizer.json"
    path.write_text(_edit(open(trained["gpt2"], encoding="utf-8").read(), how), encoding="utf-8")
    enc = load_encoder(str(path))
    assert enc.engine == "tokenizers"
    assert "not convertible to tiktoken" in enc.engine_note and REFUSALS[how] in enc.engine_note, enc.engine_note
    assert_same_ids(enc.encode_batch(texts[1][:20]), reference_ids(str(path), texts[1][:20]))


def test_the_sample_check_catches_ids_the_structure_does_not(trained, texts, tmp_path):
    """A Split regex that leaves text between its matches: tokenizers keeps those gaps
    as pieces (behavior=Isolated), tiktoken skips them. The structure converts; the ids differ."""
    spec = json.loads(open(trained["llama3"], encoding="utf-8").read())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+| ?\p{N}+"
    payload = json.dumps(spec)
    assert tiktoken_bpe.convert(payload)  # structurally fine
    fast = tiktoken_bpe.encoding(payload)
    want = reference_ids(payload, texts[1][:20])
    got = tiktoken_bpe.encode_batch(fast, texts[1][:20], threads=1)
    assert any(g.tolist() != w for g, w in zip(got, want))  # the check below is not vacuous
    path = tmp_path / "tokenizer.json"
    path.write_text(payload, encoding="utf-8")
    enc = load_encoder(str(path))
    assert enc.engine == "tokenizers" and "ids differ from tokenizers on sample text" in enc.engine_note
    assert_same_ids(enc.encode_batch(texts[1][:20]), want)


def test_without_tiktoken_or_when_switched_off_the_loader_says_so(trained, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    enc = load_encoder(trained["gpt2"])
    assert enc.engine == "tokenizers" and "tiktoken is not installed" in enc.engine_note
    monkeypatch.delitem(sys.modules, "tiktoken")
    monkeypatch.setenv(tiktoken_bpe.ENV_SWITCH, "0")
    enc = load_encoder(trained["gpt2"])
    assert enc.engine == "tokenizers" and enc.engine_note.endswith(f"tiktoken: switched off by {tiktoken_bpe.ENV_SWITCH}=0")


# --- through the loader --------------------------------------------------------------

@pytest.fixture(scope="module")
def held_corpus(texts, tmp_path_factory):
    root = tmp_path_factory.mktemp("held_corpus")
    docs = [p for t in texts[1] for p in t.split("\n\n\n") if p.strip()]
    write_corpus(str(root), docs, files=2, row_group_size=64)
    return str(root / "*.parquet")


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.mark.slow
def test_loader_with_workers_delivers_the_same_batches_on_both_engines_and_resumes_across(
        trained, held_corpus, monkeypatch):
    def build():
        return pretrain(held_corpus, tokenizer=trained["llama3"], bos="<|bos|>", seq_len=128, batch_size=4,
                        buffer_size=50, num_workers=2, seed=3)

    fast = build()
    assert fast.dataset.factory.encoder.engine == "tiktoken"
    want = _batches(fast, 12)
    mid = build()
    it = iter(mid)
    for _ in range(5):
        next(it)
    state = mid.state_dict()
    del it, mid
    monkeypatch.setenv(tiktoken_bpe.ENV_SWITCH, "0")
    slow = build()
    assert slow.dataset.factory.encoder.engine == "tokenizers"
    assert slow.config == fast.config
    got = _batches(slow, 12)
    resumed = build()
    resumed.load_state_dict(state)  # saved on tiktoken, continued on tokenizers
    got_after = _batches(resumed, 7)
    for i, (g, w) in enumerate(zip(got + got_after, want + want[5:])):
        for k in w:
            assert torch.equal(g[k], w[k]), f"batch {i} differs in {k}"


@pytest.mark.parametrize("edit, engine, why", [
    (None, "tiktoken", "same ids as tokenizers on a"),
    ("normalizer", "tokenizers", "not convertible to tiktoken: normalizer 'Lowercase'"),
])
def test_run_summary_names_the_engine(trained, held_corpus, tmp_path, capsys, edit, engine, why):
    from tokenloom.cli import main

    path = trained["gpt2"]
    if edit:
        path = str(tmp_path / "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_edit(open(trained["gpt2"], encoding="utf-8").read(), edit))
    assert main(["run", held_corpus, "--tokenizer", path, "--bos", "<|bos|>", "--seq-len", "64", "--batch-size", "2",
                 "--steps", "2", "--workers", "0", "--quiet"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("tokenizer "))
    assert f"encoded by {engine} (" in line and why in line, line
