"""The engine that encodes a tokenizer.json (issue 37, pipes/engines.py): the fastest that gives
`tokenizers`' ids, chosen with its reasons, forced by ``engine=`` or ``$TOKENLOOM_ENGINE``, one thread
in a loader worker, and the same batches, states and token cache whichever engine runs."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tokenloom.pipes import fastokens_engine
from tokenloom.pipes.engines import ENV_ENGINE
from tokenloom.pipes.loader.bridge import decode_state
from tokenloom.pipes.tokenizer import load_encoder
from tokenloom.recipes import pretrain

HAVE_FASTOKENS = fastokens_engine.version() is not None
try:
    import tiktoken  # noqa: F401

    HAVE_TIKTOKEN = True
except ImportError:
    HAVE_TIKTOKEN = False
#: The engines this machine has; the suite checks each (make installs all three).
ENGINES = ["tokenizers"] + (["tiktoken"] if HAVE_TIKTOKEN else []) + (["fastokens"] if HAVE_FASTOKENS else [])
needs_fastokens = pytest.mark.skipif(not HAVE_FASTOKENS, reason="fastokens is not installed (the fast extra)")


@pytest.fixture(autouse=True)
def no_tokenizer_cache(monkeypatch):
    """Every load works its verdicts out (a cached verdict would hide what a test changes)."""
    monkeypatch.setenv("TOKENLOOM_CACHE", "off")
    monkeypatch.delenv(ENV_ENGINE, raising=False)
    monkeypatch.delenv("TOKENLOOM_TIKTOKEN", raising=False)


def _texts(n=200):
    files = sorted(glob.glob(os.path.join(os.path.dirname(np.__file__), "**", "*.py"), recursive=True))[:n]
    return [open(f, encoding="utf-8", errors="replace").read()[:20_000] for f in files]


def _trained(path, normalizer=None, byte_fallback=False, vocab=600):
    """A small BPE trained here: byte-level (GPT-style) or Llama-2-style (byte fallback, ▁ for spaces)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if byte_fallback:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=vocab + 259, special_tokens=specials, limit_alphabet=100)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|bos|>", "<|eos|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        if normalizer is not None:
            tok.normalizer = normalizer
    texts = _texts(60)
    if byte_fallback:  # no pre-tokenizer: a whole text would be one word to the trainer; lines train in a quarter of the time
        texts = [line for t in texts for line in t.splitlines(keepends=True)]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    return _trained(tmp_path_factory.mktemp("llama") / "tokenizer.json", byte_fallback=True)


# --- the choice and its reasons ---------------------------------------------------------------

@needs_fastokens
def test_the_fastest_engine_that_gives_tokenizers_ids_is_chosen_and_says_why(tok_path):
    enc = load_encoder(tok_path)
    assert enc.engine == "fastokens" and enc.engine_note.startswith("same ids as tokenizers on a"), enc.engine_note
    assert enc.verdicts["fastokens"][0] and set(enc.verdicts) == {"fastokens", "tiktoken"}


@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken is not installed")
def test_without_fastokens_tiktoken_is_chosen_and_the_summary_says_why(tok_path, monkeypatch):
    monkeypatch.setattr(fastokens_engine, "version", lambda: None)
    enc = load_encoder(tok_path)
    assert enc.engine == "tiktoken", enc.engine_note
    assert enc.engine_note.startswith("same ids as tokenizers on a"), enc.engine_note
    assert enc.engine_note.endswith("(not fastokens: fastokens is not installed (pip install 'tokenloom[fast]' is "
                                    "faster))"), enc.engine_note


def test_an_engine_is_forced_by_argument_or_environment_and_refused_where_it_would_differ(tok_path, monkeypatch):
    assert load_encoder(tok_path, engine="tokenizers").engine == "tokenizers"
    monkeypatch.setenv(ENV_ENGINE, "tokenizers")
    enc = load_encoder(tok_path)
    assert enc.engine == "tokenizers" and enc.engine_note == f"forced by {ENV_ENGINE}=tokenizers"
    assert load_encoder(tok_path, engine="auto").engine != "tokenizers" or not (HAVE_FASTOKENS or HAVE_TIKTOKEN)
    monkeypatch.setenv(ENV_ENGINE, "rust")
    with pytest.raises(ValueError, match=rf"{ENV_ENGINE}='rust' is not an engine: pass one of \('auto', "):
        load_encoder(tok_path)
    monkeypatch.delenv(ENV_ENGINE)
    monkeypatch.setattr(fastokens_engine, "version", lambda: None)
    with pytest.raises(ValueError, match=r"engine=fastokens: the fastokens engine cannot encode this tokenizer with "
                                         r"tokenizers' ids: fastokens is not installed"):
        load_encoder(tok_path, engine="fastokens")


@needs_fastokens
def test_a_tokenizer_fastokens_cannot_load_falls_back_and_says_why(tmp_path):
    from tokenizers import normalizers

    path = _trained(tmp_path / "nfkc.json", normalizer=normalizers.NFKC())
    enc = load_encoder(path)
    assert enc.engine != "fastokens"
    assert "fastokens: fastokens cannot load it: " in enc.engine_note, enc.engine_note
    texts = ["ﬁne ＡＢＣ ① ½ x²", "plain"]
    reference = load_encoder(path, engine="tokenizers")
    assert [a.tolist() for a in enc.encode_batch(texts)] == [a.tolist() for a in reference.encode_batch(texts)]


@needs_fastokens
def test_a_mismatch_on_the_sample_falls_back_and_says_where(tok_path, monkeypatch):
    real = fastokens_engine.sample_ids

    def off_by_one(payload, texts):  # a fastokens that encodes the fourth sample text differently
        out = real(payload, texts)
        return [a + 1 if i == 3 and len(a) else a for i, a in enumerate(out)]

    monkeypatch.setattr(fastokens_engine, "sample_ids", off_by_one)
    enc = load_encoder(tok_path)
    assert enc.engine != "fastokens"
    assert "fastokens: fastokens' ids differ from tokenizers on sample text #3 " in enc.engine_note
    assert "at token 0" in enc.engine_note


@needs_fastokens
def test_a_llama2_style_byte_fallback_tokenizer_runs_on_fastokens_with_the_same_ids(llama_like):
    enc = load_encoder(llama_like)
    assert enc.engine == "fastokens", enc.engine_note
    assert not enc.verdicts["tiktoken"][0]  # not a byte-level BPE: tiktoken cannot run it
    reference = load_encoder(llama_like, engine="tokenizers")
    texts = _texts(40) + ["日本語 テキスト 🙂 \x00 \u2028 <s>hi</s> <unk>", "", " ", "a" * 5000]
    assert [a.tolist() for a in enc.encode_batch(texts)] == [a.tolist() for a in reference.encode_batch(texts)]


# --- one thread in a worker -------------------------------------------------------------------

@needs_fastokens
def test_a_loader_worker_runs_fastokens_on_one_thread(tmp_path, tok_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    pq.write_table(pa.table({"text": _texts(40)}), corpus / "a.parquet", row_group_size=10)
    seen = tmp_path / "seen"
    seen.mkdir()
    loader = pretrain(str(corpus), tok_path, seq_len=63, batch_size=2, num_workers=2,
                      worker_init_fn=_EnvProbe(str(seen)))  # runs after tokenloom's own worker set-up
    assert loader.dataset.factory.encoder.engine == "fastokens"
    next(iter(loader))
    for w in (0, 1):
        env = json.loads((seen / f"{w}.json").read_text())
        assert env == {"FASTOKENS_BPE_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class _EnvProbe:
    def __init__(self, where):
        self.where = where

    def __call__(self, worker_id):
        keys = ("FASTOKENS_BPE_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")
        with open(os.path.join(self.where, f"{worker_id}.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)


ONE_THREAD = textwrap.dedent("""
    import glob, os, sys, time
    from tokenloom.pipes import fastokens_engine
    from tokenloom.pipes.tokenizer import demo_tokenizer_path
    fastokens_engine.single_thread()
    tok = fastokens_engine.build(open(demo_tokenizer_path(), encoding="utf-8").read())
    texts = [open(f, errors="replace").read() for f in sorted(glob.glob(sys.argv[1] + "/**/*.py", recursive=True))[:400]]
    c0, w0 = time.process_time(), time.perf_counter()
    n = 0
    while time.perf_counter() - w0 < 1.5:
        n += sum(len(a) for a in fastokens_engine.encode_batch(tok, texts))
    print((time.process_time() - c0) / (time.perf_counter() - w0))
""")


@needs_fastokens
def test_fastokens_told_one_thread_uses_one_core():
    """CPU time over wall time while encoding: about 1 on one thread (more with its own pool)."""
    out = subprocess.run([sys.executable, "-c", ONE_THREAD, os.path.dirname(np.__file__)], capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                     if k not in fastokens_engine.THREAD_VARIABLES})
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) < 1.3, out.stdout


# --- the same batches, states and cache whichever engine runs ---------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    texts = _texts(120) + ["Special spellings are text: <|bos|> <|eos|> <s>", "日本語 🙂 ü", ""]
    for name, part in (("code", texts[::2]), ("prose", texts[1::2])):
        (root / name).mkdir()
        pq.write_table(pa.table({"text": part}), root / name / "a.parquet", row_group_size=16)
    return {"code": str(root / "code"), "prose": str(root / "prose")}


def _run(corpus, tok_path, engine, workers):
    loader = pretrain(corpus, tok_path, seq_len=127, batch_size=4, num_workers=workers, epochs=1,
                      weights={"code": 0.6, "prose": 0.4}, engine=engine)
    assert loader.dataset.factory.encoder.engine == engine, loader.dataset.factory.encoder.engine_note
    it = iter(loader)
    batches = [next(it) for _ in range(12)]
    state = decode_state(loader.state_dict())
    state["loader"].get("_snapshot", {}).get("_main_snapshot", {}).pop("_base_seed", None)  # torch's, per iterator
    return batches, state


@pytest.mark.parametrize("workers", [0, 2])
def test_every_engine_gives_the_same_batches_and_states(corpus, tok_path, workers):
    runs = {engine: _run(corpus, tok_path, engine, workers) for engine in ENGINES}
    ref_batches, ref_state = runs["tokenizers"]
    for engine, (batches, state) in runs.items():
        for a, b in zip(batches, ref_batches):
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)), engine
        assert state == ref_state, engine
    # and a state saved on one engine resumes on another
    loader = pretrain(corpus, tok_path, seq_len=127, batch_size=4, num_workers=workers, epochs=1,
                      weights={"code": 0.6, "prose": 0.4}, engine=ENGINES[-1])
    it = iter(loader)
    for _ in range(5):
        next(it)
    resumed = pretrain(corpus, tok_path, seq_len=127, batch_size=4, num_workers=workers, epochs=1,
                       weights={"code": 0.6, "prose": 0.4}, engine="tokenizers")
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))["input_ids"], ref_batches[5]["input_ids"])


def test_the_token_cache_is_bitwise_the_same_whichever_engine_builds_it(corpus, tok_path, tmp_path):
    from tokenloom.pipes.sources.cache_build import build_cache

    built = {}
    for engine in ENGINES:
        out = tmp_path / engine
        build_cache(corpus, load_encoder(tok_path, engine=engine), str(out), processes=1)
        built[engine] = {os.path.relpath(p, out): open(p, "rb").read()
                         for p in sorted(glob.glob(str(out / "**" / "*"), recursive=True)) if os.path.isfile(p)}
    for engine, files in built.items():
        assert files.keys() == built["tokenizers"].keys(), engine
        for name in files:
            assert files[name] == built["tokenizers"][name], (engine, name)


# --- a fast start: nothing waits for fastokens to load (issue 42) -------------------------------

@needs_fastokens
@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken stands in while fastokens builds")
def test_tiktoken_stands_in_while_fastokens_is_built_then_fastokens_encodes(tok_path, monkeypatch):
    """The first batches do not wait for fastokens' build: it runs in the background and tiktoken,
    whose verdict gives the same ids, encodes meanwhile; once built, fastokens encodes."""
    import threading

    enc = load_encoder(tok_path, engine="fastokens")
    texts = _texts(20)
    want = [e.ids for e in enc.tok.encode_batch_fast(texts, add_special_tokens=False)]
    release, real_build = threading.Event(), fastokens_engine.build
    monkeypatch.setattr(fastokens_engine, "_built", {})
    monkeypatch.setattr(fastokens_engine, "_building", {})
    monkeypatch.setattr(fastokens_engine, "_first_call", {})
    monkeypatch.setattr(fastokens_engine, "STAND_IN_S", 0.2)

    def slow_build(payload):
        assert release.wait(60)
        return real_build(payload)

    used = []
    real_encode = fastokens_engine.encode_batch
    monkeypatch.setattr(fastokens_engine, "build", slow_build)
    monkeypatch.setattr(fastokens_engine, "encode_batch", lambda tok, t: used.append("fastokens") or real_encode(tok, t))
    for _ in range(3):  # the stand-in's first batches, then fastokens still building: the same ids, from tiktoken
        assert [a.tolist() for a in enc.encode_batch(texts)] == want
        __import__("time").sleep(0.15)
    assert used == []
    release.set()
    deadline = __import__("time").monotonic() + 60
    while fastokens_engine.ready(enc._payload) is None:
        assert __import__("time").monotonic() < deadline, "fastokens was never built"
        __import__("time").sleep(0.05)
    assert [a.tolist() for a in enc.encode_batch(texts)] == want
    assert used == ["fastokens"]


@needs_fastokens
def test_a_build_that_fails_in_the_background_is_raised_where_encoding_asks(tok_path, monkeypatch):
    enc = load_encoder(tok_path, engine="fastokens")
    monkeypatch.setattr(fastokens_engine, "_built", {})
    monkeypatch.setattr(fastokens_engine, "_building", {})
    monkeypatch.setattr(fastokens_engine, "_first_call", {})
    monkeypatch.setattr(fastokens_engine, "STAND_IN_S", 0.0)

    def broken(payload):
        raise RuntimeError("cannot build it")

    monkeypatch.setattr(fastokens_engine, "build", broken)
    with pytest.raises(RuntimeError, match="cannot build it"):
        for _ in range(200):
            enc.encode_batch(["some text"])
            __import__("time").sleep(0.02)


FIRST_BATCH_IN_PARENT = textwrap.dedent("""
    import sys, time
    from tokenloom.recipes import pretrain
    loader = pretrain(sys.argv[1], tokenizer=sys.argv[2], seq_len=63, batch_size=2, num_workers=2)
    assert loader.dataset.factory.encoder.engine == "fastokens", loader.dataset.factory.encoder.engine_note
    next(iter(loader))
    print("fastokens" in sys.modules)
""")


@needs_fastokens
@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken stands in while fastokens builds")
def test_the_training_process_does_not_build_fastokens_for_its_workers(corpus, tok_path, tmp_path):
    """With the verdicts cached, a loader with workers and its first batch never load fastokens in the
    training process: each worker builds its own (no second of build in the training process, and no
    fastokens thread pool made there on the loader's account before the fork)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_ENGINE, "TOKENLOOM_TIKTOKEN")}
    env["TOKENLOOM_CACHE"] = str(tmp_path / "cache")
    load = [sys.executable, "-c", "import sys; from tokenloom.pipes.tokenizer import load_encoder; "
            "print(load_encoder(sys.argv[1]).engine)", tok_path]
    assert subprocess.run(load, env=env, capture_output=True, text=True, timeout=120).stdout.strip() == "fastokens"
    out = subprocess.run([sys.executable, "-c", FIRST_BATCH_IN_PARENT, corpus["code"], tok_path], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
