"""Sources with different text columns mixed in one loader (issue 25, item 3).

``pretrain({"stories": ..., "web": ...}, text_column={"stories": "story", "web": "text"})``,
the same per source for ``text_mode`` and sft's ``messages_field``, on the command line
(``--text-column stories=story web=text``, a TOML table) and for the token cache
(``build_cache``, ``tokenloom tokenize``). The saved configuration records the columns per
source where they differ, so a resume with one source's column changed is refused naming
that source; one column for every source is recorded as before.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.cli import main
from tokenloom.pipes.check_args import per_source, per_source_changes
from tokenloom.pipes.loader import decode_state
from tokenloom.pipes.sources.cache import build_cache
from tokenloom.recipes import pretrain, sft

from .conftest import synthetic_texts, write_corpus
from .test_sft import conversation, write_jsonl

ARGS = dict(tokenizer="demo", seq_len=48, batch_size=2, buffer_size=32)
COLUMNS = {"stories": "story", "web": "text"}
SMALL = ["--tokenizer", "demo", "--seq-len", "48", "--batch-size", "2", "--buffer-size", "32", "--quiet"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """stories/: a 'story' column only (TinyStories style); web/: 'text' and 'title' columns."""
    root = tmp_path_factory.mktemp("columns")
    write_corpus(str(root / "stories"), synthetic_texts(120, seed=1, tag="s"), files=2, row_group_size=30,
                 column="story")
    os.makedirs(root / "web")
    texts = synthetic_texts(160, seed=2, tag="w")
    pq.write_table(pa.table({"text": texts, "title": [t.split()[0] + " title" for t in texts]}),
                   str(root / "web" / "part-000.parquet"), row_group_size=40)
    return {"stories": str(root / "stories"), "web": str(root / "web")}


def delivered(loader):
    return {name: s["documents"] for name, s in loader.stats()["sources"].items()}


# --- Python -------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_two_parquet_sources_with_different_columns_mix(mixed, workers):
    loader = pretrain(mixed, text_column=COLUMNS, epochs=1, num_workers=workers, **ARGS)
    batches = list(loader)
    docs = delivered(loader)
    assert docs["stories"] >= 120 and docs["web"] >= 160, docs  # every document of both, at least once
    # the stories' own text is in the batches (the 's' tag of its documents), and the web's
    from tokenloom.pipes import load_encoder
    text = " ".join(load_encoder("demo").decode(b["input_ids"][r].tolist()) for b in batches[:40] for r in range(2))
    assert re.search(r"\bs\d{5}\b", text) and re.search(r"\bw\d{5}\b", text), text
    assert loader.config["text"] == {"stories": "column=story mode=file", "web": "column=text mode=file"}


def test_a_per_source_setting_must_name_every_source_and_only_them(mixed):
    with pytest.raises(ValueError) as e:
        pretrain(mixed, text_column={"stories": "story", "wbe": "text"}, **ARGS)
    msg = str(e.value)
    assert "names unknown source(s) ['wbe']" in msg and "leaves out ['web']" in msg, msg
    assert "the sources are ['stories', 'web']" in msg, msg
    with pytest.raises(ValueError, match=r"leaves out \['web'\]; the sources are \['stories', 'web'\]"):
        pretrain(mixed, text_column={"stories": "story"}, **ARGS)
    with pytest.raises(ValueError, match=r"text_mode=\{'stories': 'file'\} leaves out \['web'\]"):
        pretrain(mixed, text_column=COLUMNS, text_mode={"stories": "file"}, **ARGS)
    with pytest.raises(TypeError, match=r"text_column\['web'\]=3 must be a column name \(str\)"):
        pretrain(mixed, text_column={"stories": "story", "web": 3}, **ARGS)
    with pytest.raises(TypeError, match=r"text_column=\['story', 'text'\] must be a column name"):
        pretrain(mixed, text_column=["story", "text"], **ARGS)


def test_one_column_for_every_source_is_recorded_as_before(tmp_path):
    a = os.path.dirname(write_corpus(str(tmp_path / "a"), synthetic_texts(60, seed=1), files=1)[0])
    b = os.path.dirname(write_corpus(str(tmp_path / "b"), synthetic_texts(60, seed=2), files=1)[0])
    single = pretrain({"a": a, "b": b}, **ARGS)
    assert single.config["text"] == "column=text mode=file"  # what states saved before per-source columns hold
    it = iter(single)
    for _ in range(3):
        next(it)
    state = single.state_dict()
    # the same single string loads; so does the same column spelt per source
    pretrain({"a": a, "b": b}, **ARGS).load_state_dict(state)
    pretrain({"a": a, "b": b}, text_column={"a": "text", "b": "text"}, **ARGS).load_state_dict(state)
    with pytest.raises(ValueError) as e:
        pretrain({"a": a, "b": b}, text_mode={"a": "file", "b": "paragraphs"}, **ARGS).load_state_dict(state)
    msg = str(e.value)
    assert "text: source 'b': saved with 'column=text mode=file', this loader has 'column=text mode=paragraphs'" \
        in msg and "source 'a'" not in msg, msg


def test_changing_one_sources_column_is_refused_naming_that_source(mixed):
    loader = pretrain(mixed, text_column=COLUMNS, **ARGS)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    assert decode_state(state)["tokenloom"]["config"]["text"]["stories"] == "column=story mode=file"
    with pytest.raises(ValueError) as e:
        pretrain(mixed, text_column={"stories": "story", "web": "title"}, **ARGS).load_state_dict(state)
    msg = str(e.value)
    assert "text: source 'web': saved with 'column=text mode=file', this loader has 'column=title mode=file'" \
        in msg, msg
    assert "source 'stories'" not in msg and "pass the saved text_column= " in msg, msg
    pretrain(mixed, text_column=COLUMNS, **ARGS).load_state_dict(state)  # the same columns load


def test_per_source_changes_against_a_single_value():
    assert per_source_changes("text", "column=text mode=file", "column=text mode=file", "h") is None
    assert per_source_changes("text", "column=text mode=file", {"a": "column=text mode=file",
                                                               "b": "column=body mode=file"}, "h") == [
        "text: source 'b': saved with 'column=text mode=file', this loader has 'column=body mode=file' (h)"]
    assert per_source_changes("text", {"a": "x", "b": "y"}, {"a": "x"}, "h") == [
        "text: source 'b': saved with 'y', this loader has '<absent>' (h)"]
    assert per_source("text_column", "t", ["a", "b"]) == {"a": "t", "b": "t"}


def test_sft_messages_field_per_source(tmp_path):
    rng = np.random.default_rng(0)
    chat = write_jsonl(tmp_path / "chat.jsonl", [conversation(i, rng) for i in range(40)])
    other = write_jsonl(tmp_path / "other.jsonl", [{"conv": conversation(i, rng)["messages"]} for i in range(40)])
    loader = sft({"chat": chat, "other": other}, messages_field={"chat": "messages", "other": "conv"},
                 tokenizer="demo", seq_len=64, batch_size=2, epochs=1)
    list(loader)
    docs = delivered(loader)
    assert docs["chat"] >= 40 and docs["other"] >= 40, docs
    with pytest.raises(ValueError, match=r"messages_field=\{'chat': 'messages'\} leaves out \['other'\]"):
        sft({"chat": chat, "other": other}, messages_field={"chat": "messages"}, tokenizer="demo")


def test_text_mode_per_source(tmp_path):
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        for i in range(4):
            (tmp_path / name / f"{i}.txt").write_text(f"{name}{i} one\n\n{name}{i} two\n\n{name}{i} three\n")
    loader = pretrain({"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}, text_mode={"a": "paragraphs",
                      "b": "file"}, tokenizer="demo", seq_len=32, batch_size=2, epochs=1, cycle_exhausted=False)
    list(loader)
    assert delivered(loader) == {"a": 12, "b": 4}  # a: three paragraphs a file; b: one document a file


def test_build_cache_with_a_column_per_source(mixed, tmp_path):
    out = str(tmp_path / "cache")
    done = build_cache(mixed, "demo", out, text_column=COLUMNS, processes=1)
    assert done["complete"] and done["sources"]["stories"]["documents"] == 120
    cached = pretrain(mixed, text_column=COLUMNS, cache=out, epochs=1, **ARGS)
    plain = pretrain(mixed, text_column=COLUMNS, epochs=1, **ARGS)
    got, want = list(cached), list(plain)
    assert len(got) == len(want) and all((g["input_ids"] == w["input_ids"]).all() for g, w in zip(got, want))
    assert {n: s["tokenized"] for n, s in cached.stats()["sources"].items()} == {"stories": 0, "web": 0}


# --- the command line ----------------------------------------------------------------------

def test_cli_run_text_column_per_source_and_the_refused_resume(mixed, tmp_path, capsys):
    sources = [f"{n}={p}" for n, p in mixed.items()]
    state = str(tmp_path / "state.pt")
    assert main(["run", *sources, "--text-column", "stories=story", "web=text", *SMALL, "--steps", "6",
                 "--save-state", state]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().startswith(("stories", "web"))}
    assert int(rows["stories"][2].replace(",", "")) > 0 and int(rows["web"][2].replace(",", "")) > 0, out
    # the flag may come first: the words after the name=value pairs are sources again
    assert main(["run", "--text-column", "stories=story", "web=text", *sources, *SMALL, "--steps", "6",
                 "--resume", state]) == 0
    capsys.readouterr()
    assert main(["run", *sources, "--text-column", "stories=story", "web=title", *SMALL, "--resume", state]) == 2
    err = capsys.readouterr().err
    assert "text: source 'web': saved with 'column=text mode=file', this loader has 'column=title mode=file'" \
        in err, err
    assert "pass the saved --text-column (sft: --messages-field) and --text-mode, per source as name=value" in err, err


def test_cli_single_text_column_means_every_source(mixed, tmp_path, capsys):
    # before its source, as people type it: one plain word is the column, the next a source
    assert main(["run", "--text-column", "story", mixed["stories"], *SMALL, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main(["run", mixed["stories"], "--text-column", "story", "text", *SMALL]) == 2
    assert "give one value for every source" not in capsys.readouterr().err  # "text" is read as a source path
    # a name again, or a path, is a source: both sources after the flag
    stories, web = (f"{n}={p}" for n, p in mixed.items())
    assert main(["run", "--text-column", "stories=story", "web=text", stories, web, *SMALL, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main(["run", "--text-column", "story", "text", "--tokenizer", "demo"]) == 2
    assert "give one value for every source" not in capsys.readouterr().err


def test_toml_table_per_source(mixed, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'tokenizer = "demo"\nseq_len = 48\nbatch_size = 2\nsteps = 3\n'
                   f'[sources]\nstories = "{mixed["stories"]}"\nweb = "{mixed["web"]}"\n'
                   '[text_column]\nstories = "story"\nweb = "text"\n')
    assert main(["run", "--config", str(cfg), "--quiet"]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('text_column = 3\n')
    assert main(["run", "--config", str(bad), "--quiet"]) == 2
    assert "text_column = 3 must be a string, or a table of one string per source" in capsys.readouterr().err


def test_cli_tokenize_with_a_column_per_source(mixed, tmp_path, capsys):
    out = str(tmp_path / "cache")
    sources = [f"{n}={p}" for n, p in mixed.items()]
    assert main(["tokenize", *sources, "--text-column", "stories=story", "web=text", "--tokenizer", "demo",
                 "--out", out, "--quiet", "--processes", "1"]) == 0
    assert "(complete)" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cache that matched would not warn
        loader = pretrain(mixed, text_column=COLUMNS, cache=out, **ARGS)
    next(iter(loader))
