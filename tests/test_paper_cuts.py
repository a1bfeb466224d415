"""The first hour's paper cuts (issue 14): what a new user met on the command line and in
error messages, each pinned by a test that failed before its fix.

Commands run in-process through `tokenloom.cli.main` on small real corpora; the
closed-pipe test runs ``python -m tokenloom`` in a subprocess, since only a real
pipe can be closed under it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenloom import run_cmd
from tokenloom.cli import EXIT_PIPE_CLOSED, main
from tokenloom.cli_hints import FLAG_OF, NO_FLAG, for_cli
from tokenloom.pipes.check_args import check_int
from tokenloom.progress import Progress
from tokenloom.recipes import multiplex, pretrain, sft
from tokenloom.summary import Trace, summary_lines, take

from .conftest import synthetic_texts, write_corpus
from .test_sft import conversation, write_jsonl

SMALL = ["--seq-len", "32", "--batch-size", "2", "--buffer-size", "40", "--tokenizer", "demo", "--quiet"]


@pytest.fixture(scope="module")
def text_parquet(tmp_path_factory):
    """One parquet source with a 'text' column only."""
    root = tmp_path_factory.mktemp("cuts_text")
    write_corpus(str(root), synthetic_texts(200, seed=3), files=1, row_group_size=50)
    return str(root)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuts_two")
    a = write_corpus(str(root / "a"), synthetic_texts(200, seed=1, tag="a"), files=1, row_group_size=40)
    b = write_corpus(str(root / "b"), synthetic_texts(200, seed=2, tag="b"), files=1, row_group_size=40)
    return [f"a={a[0]}", f"b={b[0]}"]


def error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- 1. advice names flags, or says there is none ---------------------------------------

def test_sft_on_parquet_without_messages_names_the_messages_field_flag(text_parquet, capsys):
    assert main(["run", "--recipe", "sft", text_parquet, *SMALL]) == 2
    line = error_line(capsys)
    assert "column 'messages' not found" in line and "Pass --messages-field with one of them" in line, line
    assert "text_column" not in line and "messages_field=" not in line, line


def test_bad_value_is_said_as_its_flag(text_parquet, capsys):
    assert main(["run", text_parquet, *SMALL, "--epochs", "0"]) == 2
    line = error_line(capsys)
    assert line.startswith("tokenloom: error: --epochs 0 must be") and "epochs=" not in line, line


def test_reader_hint_for_a_keyword_without_a_flag_says_so(tmp_path, capsys):
    rng = np.random.default_rng(0)
    records = [conversation(i, rng) for i in range(30)]
    records[17] = {"msgs": records[17]["messages"]}  # one record, past the listing's first-record check
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    assert main(["run", "--recipe", "sft", path, *SMALL, "--epochs", "1"]) == 2
    line = error_line(capsys)
    assert "no field 'messages'" in line and "Pass --messages-field naming one of the keys" in line, line
    assert "on_error='skip'" in line and "(on_error= is a Python API keyword with no command-line flag)" in line
    assert "text_column" not in line, line


def test_changed_weights_on_resume_point_to_the_flag_that_allows_it(two_sources, tmp_path, capsys):
    state = str(tmp_path / "state.pt")
    base = ["run", *two_sources, *SMALL, "--steps", "3"]
    assert main([*base, "--weights", "a=0.6", "b=0.4", "--save-state", state]) == 0
    capsys.readouterr()
    assert main([*base, "--weights", "a=0.5", "b=0.5", "--resume", state]) == 2
    line = error_line(capsys)
    assert "pass the same --weights, or pass --allow-weight-change to switch mixtures" in line, line
    assert "allow_weight_change" not in line and "load_state_dict" not in line, line
    assert main([*base, "--weights", "a=0.5", "b=0.5", "--resume", state, "--allow-weight-change"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {state}: round 0, 3 batches already taken" in out and "weights a=0.50 b=0.50" in out
    assert main([*base, "--weights", "a=0.5", "b=0.5", "--allow-weight-change"]) == 2
    assert "--allow-weight-change applies to a resumed run" in error_line(capsys)


def test_for_cli_rewrites_keywords_outside_quotes_only():
    saved = "mix: saved with 'interleave unit=tokens stop=never', this loader has 'random unit=tokens stop=never'"
    assert for_cli(saved) == saved
    assert for_cli("stop='first_exhausted' needs epochs=n") == "--stop 'first_exhausted' needs --epochs n"
    assert for_cli("pass the same num_workers to resume") == "pass the same --workers to resume"
    assert for_cli("expected name=weight, e.g. code=0.7") == "expected name=weight, e.g. code=0.7"
    assert for_cli("pass stop='x' with rank_sync=None or on_error='skip'").endswith(
        "(rank_sync=, on_error= are Python API keywords with no command-line flag)")
    assert for_cli("pass stop='x' with cycle_exhausted=False or pattern=[a]") == \
        "pass --stop 'x' with --cycle-exhausted False or --pattern [a]"  # flags since issue 36


def test_every_flag_named_in_advice_exists_and_no_keyword_is_both(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = capsys.readouterr().out
    for keyword, flag in FLAG_OF.items():
        assert flag in help_text, (keyword, flag)
    assert not set(FLAG_OF) & set(NO_FLAG)


# --- 2. --help reads cleanly --------------------------------------------------------------

@pytest.mark.parametrize("command", [[], ["demo"], ["run"], ["inspect"], ["state"], ["index"]])
def test_help_has_no_rst_markup_and_no_empty_default(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "usage: tokenloom" in text
    assert "``" not in text and "inspect._empty" not in text and "<class" not in text, text


# --- 3. flags a command does not use are refused ----------------------------------------------

def test_inspect_refuses_steps_but_a_shared_config_may_hold_them(text_parquet, tmp_path, capsys):
    assert main(["inspect", text_parquet, *SMALL[:-1], "--steps", "5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before anything was built
    assert "--steps is not used by inspect" in err and "--rows" in err, err
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'steps = 5\ntokenizer = "demo"\nseq_len = 32\nbatch_size = 2\n[sources]\ndefault = "{text_parquet}"\n')
    assert main(["inspect", "--config", str(cfg), "--rows", "1"]) == 0
    assert "row 0:" in capsys.readouterr().out


# --- 4. a closed pipe ends quietly ------------------------------------------------------------

def test_output_into_a_closed_pipe_ends_quietly_with_141(text_parquet):
    argv = [sys.executable, "-m", "tokenloom", "run", text_parquet, *SMALL, "--steps", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0` would be
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == EXIT_PIPE_CLOSED == 141
    assert "Broken pipe" not in err and "Exception ignored" not in err and "error" not in err, err


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(monkeypatch, capfd):
    def run(args):
        raise BrokenPipeError(32, "Broken pipe")  # as a dead worker's or a socket's would

    monkeypatch.setattr(run_cmd, "run", run)
    assert main(["run", "x"]) == 2
    assert "tokenloom: error: [Errno 32] Broken pipe" in capfd.readouterr().err


# --- 5. multiplex datasets with different keys ---------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_multiplex_collates_different_keys_as_the_seed_does(workers):
    qa = [{"question": f"q{i}", "answer": i} for i in range(40)]
    texts = [{"text": f"t{i}", "answer": -i} for i in range(40)]
    loader = multiplex([("qa", qa), ("texts", texts)], batch_size=8, sampling_strategy="round_robin",
                       num_workers=workers)
    batches = list(loader)
    assert sum(len(b["dataset_name"]) for b in batches) == 80
    for b in batches:
        assert list(b) == ["question", "answer", "dataset_name", "dataset_idx", "text"]
        for i, name in enumerate(b["dataset_name"]):
            assert (b["question"][i] is None) == (name == "texts")
            assert (b["text"][i] is None) == (name == "qa")
        assert b["answer"].dtype == torch.int64  # a key every example has is collated as before
    single = next(iter(multiplex([("qa", qa)], batch_size=4)))
    assert set(single) == {"question", "answer", "dataset_name", "dataset_idx"}


def test_multiplex_refuses_a_string_batch_size():
    with pytest.raises(TypeError, match=r"batch_size='32' must be an int, not str: pass batch_size=32"):
        multiplex([("a", [{"x": 1}] * 4)], batch_size="32")


# --- 6. the column parameter is named as the recipe calls it -----------------------------

def test_recipes_name_their_own_column_parameter(text_parquet, tmp_path, tok_path):
    with pytest.raises(ValueError) as e:
        sft(text_parquet, tokenizer=tok_path)
    assert "Pass messages_field= with one of them" in str(e.value) and "text_column" not in str(e.value)
    with pytest.raises(ValueError) as e:
        sft(text_parquet, tokenizer=tok_path, messages_field="text")
    assert "not a list (of messages); pass messages_field= naming a list column" in str(e.value)
    path = write_jsonl(tmp_path / "c.jsonl", [{"msgs": []}] * 3)
    with pytest.raises(ValueError) as e:
        sft(path, tokenizer=tok_path)
    assert str(e.value).endswith("no field 'messages'; the line has keys ['msgs']. Pass messages_field= naming "
                                 "one of them"), str(e.value)
    with pytest.raises(ValueError, match=r"Pass text_column= with one of them"):
        pretrain(text_parquet, tokenizer=tok_path, text_column="body")


# --- 7. integer arguments -------------------------------------------------------------------

def test_check_int():
    assert check_int("seq_len", np.int64(2048), 1) == 2048 and type(check_int("n", np.int32(3))) is int
    with pytest.raises(TypeError, match=r"^seq_len='2048' must be an int, not str: pass seq_len=2048$"):
        check_int("seq_len", "2048", 1)
    with pytest.raises(TypeError, match=r"batch_size=True must be an int, not bool"):
        check_int("batch_size", True, 1)
    with pytest.raises(TypeError, match=r"seq_len=2048.0 must be an int, not float: pass seq_len=2048"):
        check_int("seq_len", 2048.0, 1)
    with pytest.raises(ValueError, match=r"^buffer_size=0 must be >= 1$"):
        check_int("buffer_size", 0, 1)
    assert check_int("epochs", None, 1, none_ok=True) is None
    with pytest.raises(ValueError, match=r"epochs=0 must be >= 1 or None \(cycle forever\)"):
        check_int("epochs", 0, 1, none_ok=True, none_means="cycle forever")
    with pytest.raises(TypeError, match=r"epochs='x' must be an int \(or None: cycle forever\), not str$"):
        check_int("epochs", "x", 1, none_ok=True, none_means="cycle forever")


# --- 8. the summary says which document count is which -------------------------------------

def test_summary_tells_documents_read_from_documents_delivered(two_sources, tok_path):
    # rows longer than the documents, so the buffer holds documents no batch has begun yet
    loader = pretrain({s.split("=")[0]: s.split("=")[1] for s in two_sources}, tokenizer=tok_path, seq_len=256,
                      batch_size=2, buffer_size=40, buffer_tokens=1 << 20, weights={"a": 0.5, "b": 0.5})
    trace = Trace()
    # past the buffer's ramp (it fills as rows are emitted)
    take(iter(loader), 20, trace, Progress("pretrain", 20, enabled=False))
    stats = loader.stats()
    begun = sum(s["documents"] for s in stats["sources"].values())
    assert 0 < begun < stats["documents"]  # the buffer holds documents no batch has begun yet
    lines = summary_lines(trace, stats)
    packing = next(line for line in lines if line.startswith("  packing"))
    assert f"{stats['documents']:,} documents" not in packing
    assert f"  documents      {stats['documents']:,} read into the packer, {begun:,} of them begin in these " \
           f"batches (the table below), {stats['documents'] - begun:,} still buffered" in lines


# --- issue 25, item 4: the next new user's paper cuts ----------------------------------------

def test_messages_have_no_doubled_words_and_count_one_in_the_singular(tmp_path):
    from types import SimpleNamespace

    from tokenloom.pipes.schedule import normalize_schedule
    from tokenloom.pipes.sources.fingerprint import describe_source_change
    from tokenloom.pipes.sources.parquet import ReadParquet
    from tokenloom.pipes.sources.readers import plan_source
    from tokenloom.state_cmd import branch_position

    with pytest.raises(ValueError) as e:
        normalize_schedule({"a": 1, "zz": 1}, ["a", "b"])
    assert str(e.value).startswith("weights name unknown sources ['zz']; the sources are ['a', 'b']"), str(e.value)
    with pytest.raises(ValueError, match=r"^weights at step 0 miss sources \['b'\]"):
        normalize_schedule([(0, {"a": 1})], ["a", "b"])

    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "fine"}] * 3)
    with open(path, "a") as f:
        f.write('{"text": "never closed\n')
    with pytest.raises(ValueError) as e:
        list(pretrain(path, tokenizer="demo", seq_len=16, batch_size=1, epochs=1))
    assert "Unterminated string starting at column 10" in str(e.value) and "at at" not in str(e.value), str(e.value)

    where = SimpleNamespace(units=SimpleNamespace(where=lambda u: "x.parquet, row group 0"))
    error = ReadParquet._read_error(where, 0, OSError("Couldn't deserialize thrift: invalid data."))
    assert "invalid data. the row group is corrupt" in str(error) and ".." not in str(error), str(error)

    one = tmp_path / "one"
    write_corpus(str(one), synthetic_texts(20, seed=4), files=1)
    saved = plan_source("web", str(one)).fingerprint
    write_corpus(str(one), synthetic_texts(30, seed=4), files=1)
    problem = describe_source_change("web", saved, plan_source("web", str(one)).fingerprint)
    assert "(1 file then, 1 now)" in problem, problem

    assert branch_position({"epoch": 0, "index": 1, "prefix": 0}) == "epoch 0, 1 work slice started"
    assert branch_position({"epoch": 2, "index": 3, "prefix": 0}) == "epoch 2, 3 work slices started"


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_count_the_epochs_a_finite_run_completed(text_parquet, workers, capsys):
    for epochs in (1, 2):
        loader = pretrain(text_parquet, tokenizer="demo", seq_len=64, batch_size=2, epochs=epochs, num_workers=workers)
        list(loader)
        assert loader.stats()["sources"]["default"]["epochs"] == epochs
    list(loader)  # the next round: two more
    assert loader.stats()["sources"]["default"]["epochs"] == 4
    assert main(["run", text_parquet, *SMALL, "--epochs", "1", "--workers", str(workers)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  default "))
    assert row[3] == "1", row  # source, tokens, documents, epochs


def test_state_shows_the_epochs_loader_stats_shows(tmp_path):
    from tokenloom.pipes.loader.bridge import decode_state
    from tokenloom.state_cmd import shaped_stats

    small = write_corpus(str(tmp_path / "small"), synthetic_texts(12, seed=5, tag="s"), files=1, row_group_size=3)
    large = write_corpus(str(tmp_path / "large"), synthetic_texts(200, seed=6, tag="l"), files=1, row_group_size=40)
    loader = pretrain({"small": small[0], "large": large[0]}, tokenizer="demo", seq_len=64, batch_size=2,
                      num_workers=2)
    for _, _ in zip(range(60), loader):  # 'small' cycles: each worker passes its half several times
        pass
    stats = loader.stats()
    per_worker = [vec[loader.stats_keys.index("source/small/epochs")] for vec in loader.worker_stats().values()]
    assert stats["sources"]["small"]["epochs"] == min(per_worker) >= 1 and sum(per_worker) > min(per_worker)
    shown = shaped_stats(decode_state(loader.state_dict())["tokenloom"])
    assert {n: s["epochs"] for n, s in shown["sources"].items()} == {n: s["epochs"] for n, s in stats["sources"].items()}


def test_a_json_file_that_is_no_tokenizer_is_named_so(text_parquet, tmp_path, tok_path, capsys):
    from tokenloom.pipes.tokenizer import load_encoder

    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError) as e:
        load_encoder(str(other))
    text = str(e.value)
    assert text.startswith(f"tokenizer file {str(other)!r} is JSON but not a tokenizer.json: it holds keys ['a']"), text
    assert '"model" (its "type", "vocab" and merges)' in text and "or the directory holding it" in text, text
    assert "line 1 column" not in text, text

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(open(tok_path).read())
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>"}')
    config = str(folder / "tokenizer_config.json")
    assert main(["run", text_parquet, "--tokenizer", config, "--seq-len", "32", "--quiet"]) == 2
    line = error_line(capsys)
    assert f"tokenizer file {config!r} is JSON but not a tokenizer.json (it looks like a tokenizer_config.json)" in line
    assert f"pass {str(folder / 'tokenizer.json')!r}, or the directory {str(folder)!r}" in line, line
    load_encoder(str(folder))  # what the message offers loads


def _chat(i: int) -> list:
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]


def test_conversations_given_to_pretrain_point_to_the_sft_recipe(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a messages field and no text: refused at listing, pointing to sft
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": _chat(i)} for i in range(20)])
    assert main(["run", chats, *SMALL]) == 2
    line = error_line(capsys)
    assert "first record: no field 'text'; the line has keys ['messages']. Pass --text-column naming one of them; " \
           "or, as its field 'messages' holds a list of messages (a conversation), train on it with the sft recipe, " \
           "--recipe sft" in line, line
    assert "require_type" not in line and "messages_field" not in line and "sft(" not in line, line
    with pytest.raises(ValueError, match=r"train on it with the sft recipe, sft\(\.\.\.\)$"):
        pretrain(chats, tokenizer="demo")

    # conversations under the text field: at listing (the first record), or when read (a later one)
    under_text = write_jsonl(tmp_path / "t.jsonl", [{"text": _chat(i)} for i in range(20)])
    assert main(["run", under_text, *SMALL]) == 2
    line = error_line(capsys)
    assert "first record: field 'text' holds a list, expected str. A list of messages is a conversation: to train " \
           "on conversations use the sft recipe, --recipe sft with --messages-field 'text'; for text, pass " \
           "--text-column naming a text field" in line, line
    records = [{"text": f"document {i}"} for i in range(20)]
    records[13] = {"text": _chat(13)}
    later = write_jsonl(tmp_path / "later.jsonl", records)
    assert main(["run", later, *SMALL, "--epochs", "1"]) == 2
    line = error_line(capsys)
    assert "line 14: field 'text' holds a list, expected str. A list of messages is a conversation: to train on " \
           "conversations use the sft recipe, --recipe sft with --messages-field 'text'; for text, pass " \
           "--text-column naming a text field, or on_error='skip'" in line, line
    assert "require_type" not in line, line
    records[13] = {"text": 12345}  # not a conversation: no sft advice, and no Python-only require_type=
    wrong = write_jsonl(tmp_path / "wrong.jsonl", records)
    assert main(["run", wrong, *SMALL, "--epochs", "1"]) == 2
    line = error_line(capsys)
    assert "field 'text' holds an int, expected str. Pass --text-column naming a field that holds that type" in line
    assert "require_type" not in line and "sft" not in line, line

    # parquet: a list column and no text column, or a list column named as the text column
    pq.write_table(pa.table({"messages": [_chat(i) for i in range(10)], "id": list(range(10))}),
                   tmp_path / "chats.parquet")
    assert main(["run", str(tmp_path / "chats.parquet"), *SMALL]) == 2
    assert error_line(capsys).endswith("Pass --text-column with one of them, or fix or remove this file; or, as its "
                                       "column 'messages' holds lists (conversations?), train on it with the sft "
                                       "recipe, --recipe sft")
    assert main(["run", str(tmp_path / "chats.parquet"), *SMALL, "--text-column", "messages"]) == 2
    assert error_line(capsys).endswith("if it holds conversations (lists of messages), train on them with the sft "
                                       "recipe, --recipe sft")
    assert main(["run", "--recipe", "sft", str(tmp_path / "chats.parquet"), *SMALL, "--steps", "1"]) == 0


def test_inspect_shows_the_trained_label_after_a_rows_last_token(tmp_path, capsys):
    from tokenloom.inspect_cmd import render_row

    # a row that ends where its conversation ends: the end token is trained, but only as the last label
    vocab = {1: "<|user|>", 2: "Q", 3: "<|end|>", 4: "<|assistant|>", 5: "A"}
    decode = lambda xs: "".join(vocab[x] for x in xs)  # noqa: E731
    ids, labels, segments = [1, 2, 3, 4, 5], [-100, -100, -100, 5, 3], [1] * 5
    row = render_row(decode, ids, labels, segments, show_trained=True, chars=100, color=False)
    assert row == "<|user|>Q<|end|><|assistant|>[[A]] → [[<|end|>]]", row
    assert render_row(decode, ids, labels, segments, show_trained=True, chars=3, color=False).endswith(" → [[<|end|>]]")
    assert "→" not in render_row(decode, ids, labels[:-1] + [-100], segments, show_trained=True, chars=100, color=False)
    assert "→" not in render_row(decode, ids, labels, segments, show_trained=False, chars=100, color=False)

    # on the command line: rows shorter than the conversations end inside an answer
    rng = np.random.default_rng(0)
    chats = write_jsonl(tmp_path / "chats.jsonl", [conversation(i, rng) for i in range(40)])
    assert main(["inspect", "--recipe", "sft", chats, "--tokenizer", "demo", "--seq-len", "24", "--batch-size", "4",
                 "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "→ the trained label after a row's last token" in out
    batch = next(iter(sft(chats, tokenizer="demo", seq_len=24, batch_size=4)))
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    ends = [bool(line.rstrip().endswith("]]") and " → [[" in line) for line in rows]
    assert ends == [bool(label != -100) for label in batch["labels"][:, -1].tolist()] and any(ends), rows


def test_resume_takes_every_old_ranks_state_file_for_an_elastic_resume(two_sources, tmp_path, capsys):
    from tokenloom.state_file import save

    base = ["run", *two_sources, *SMALL, "--steps", "3"]
    # a state of one rank and no workers, resumed with 2 workers: the advice names the flags that do it
    one = str(tmp_path / "w0.pt")
    assert main([*base, "--save-state", one]) == 0
    capsys.readouterr()
    assert main([*base, "--workers", "2", "--resume", one]) == 2
    line = error_line(capsys)
    assert "num_workers: saved with 0, this loader has 2 (data is sharded per loader worker; pass the same " \
           "--workers to resume exactly, or pass every old rank's state file to --resume (elastic resume; one " \
           "file: add --elastic) to continue with these workers)" in line, line
    assert "load_state_dict" not in line and "[state" not in line, line
    assert main([*base, "--workers", "2", "--resume", one, "--elastic"]) == 0
    assert f"resumed from {one} (elastic resume; saved by 1 rank(s) with 0 workers): round 0, 3 batches " \
           "already taken" in capsys.readouterr().out

    # the states of a 2-rank run, saved as --save-state saves them, resumed by this 1-rank command
    sources = dict(s.split("=", 1) for s in two_sources)
    ranks = [str(tmp_path / f"r{r}.pt") for r in range(2)]
    for r, path in enumerate(ranks):
        loader = pretrain(sources, tokenizer="demo", seq_len=32, batch_size=2, buffer_size=40, rank=r, world_size=2)
        for _, _ in zip(range(4), loader):
            pass
        save(path, loader.state_dict())
    assert main([*base, "--resume", ranks[0]]) == 2
    line = error_line(capsys)
    assert "world_size: saved with 2, this loader has 1 (positions are per rank; resume with the same number of " \
           "ranks, or pass every old rank's state file to --resume (elastic resume) to continue on this topology)" \
           in line, line
    for resume in (["--resume", *ranks], ["--resume", ranks[0], "--resume", ranks[1]]):
        assert main([*base, *resume]) == 0
        assert f"resumed from {ranks[0]}, {ranks[1]} (elastic resume; saved by 2 rank(s) with 0 workers): round 0, " \
               "4 batches already taken" in capsys.readouterr().out
    # the words after the state files that are sources are sources again
    assert main(["run", *SMALL, "--steps", "3", "--resume", *ranks, *two_sources]) == 0
    assert "elastic resume; saved by 2 rank(s)" in capsys.readouterr().out
    assert main([*base, "--elastic"]) == 2
    assert "--elastic applies to a resumed run: add --resume FILE" in error_line(capsys)


def test_every_elastic_resume_hint_is_said_in_flags():
    from tokenloom.pipes.loader.config_check import TOPOLOGY_HINTS

    for key in ("world_size", "num_workers"):
        said = for_cli(TOPOLOGY_HINTS[key])
        assert "pass every old rank's state file to --resume (elastic resume" in said, said
        assert "load_state_dict" not in said and "[state, ...]" not in said, said
