"""The `tokenloom` command line: run/resume exactness, demo, inspect, state, errors, TOML configs.

Commands are called in-process through `tokenloom.cli.main` (one subprocess test
checks `python -m tokenloom`); corpora are small and rows short, so each test
takes a few seconds.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from tokenloom.cli import main
from tokenloom.cli_config import SETTINGS
from tokenloom.inspect_cmd import render_row
from tokenloom.pipes.loader.bridge import STATE_VERSION
from tokenloom.recipes import pretrain, sft

from .conftest import synthetic_texts, write_corpus
from .test_sft import conversation, write_jsonl

SMALL = ["--seq-len", "32", "--batch-size", "2", "--buffer-size", "40", "--tokenizer", "demo"]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two named parquet sources of 300 short synthetic documents each."""
    root = tmp_path_factory.mktemp("cli")
    a = write_corpus(str(root / "a"), synthetic_texts(300, seed=1, tag="a"), files=2, row_group_size=32)
    b = write_corpus(str(root / "b"), synthetic_texts(300, seed=2, tag="b"), files=2, row_group_size=32)
    return [f"a={os.path.dirname(a[0])}", f"b={os.path.dirname(b[0])}", "--weights", "a=0.6", "b=0.4"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    import numpy as np

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("cli_sft") / "chats.jsonl"
    return write_jsonl(path, [conversation(i, rng) for i in range(80)])


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"batch {i}"
        for k in w:
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), f"batch {i} differs in {k}"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    return lines[0]


# --- verify -------------------------------------------------------------------------

def test_verify_checks_the_resumes_of_your_settings(two_sources, tmp_path, capsys):
    assert main(["verify", *two_sources, *SMALL, "--workers", "2", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "every resume gives the uninterrupted run's batches" in out
    assert out.count("ok   resume at step") >= 3 and "right after a load" in out
    assert "ok   resume at step" in out and "in a fresh process" in out  # tokenloom run --resume, same flags
    # an endless stream: other topologies cannot be counted, and the report says what would allow it
    assert "other topologies (ranks, workers): not checked: needs a finite stream: add --epochs 1" in out


def test_verify_resumes_a_finite_epoch_on_other_topologies(tmp_path, capsys):
    a = write_corpus(str(tmp_path / "a"), synthetic_texts(60, seed=1, tag="a"), files=2, row_group_size=16)
    b = write_corpus(str(tmp_path / "b"), synthetic_texts(60, seed=2, tag="b"), files=2, row_group_size=16)
    sources = [f"a={os.path.dirname(a[0])}", f"b={os.path.dirname(b[0])}"]
    assert main(["verify", *sources, *SMALL, "--workers", "0", "--epochs", "1", "--no-cycle-exhausted", "--quick",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    # the whole epoch is the reference; one rank without workers saved, resumed on 2 ranks x 1 worker
    assert "ok   elastic: saved on 1 rank(s) x 0 worker(s), resumed on 2 x 1: saved at step" in out, out
    assert "tokens exactly once" in out and "not checked" not in out


def test_verify_says_which_flag_lets_it_check_other_topologies():
    from tokenloom.verify_cmd import why_not_elastic
    assert why_not_elastic({"epochs": 1, "cycle_exhausted": False}, 2) == ""
    assert why_not_elastic({"epochs": 1}, 1) == ""  # one source: its passes are whole
    assert "--epochs 1" in why_not_elastic({}, 1)
    assert "--no-cycle-exhausted" in why_not_elastic({"epochs": 1}, 2)
    assert "bestfit-crop" in why_not_elastic({"epochs": 1, "packing": "bestfit-crop"}, 1)


# --- run ----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_run_save_then_resume_gives_the_uninterrupted_batches(two_sources, tmp_path, capsys, workers):
    base = ["run", *two_sources, *SMALL, "--workers", str(workers)]
    full, first, rest, state = (str(tmp_path / n) for n in ("full.pt", "first.pt", "rest.pt", "state.pt"))
    assert main([*base, "--steps", "8", "--dump-batches", full]) == 0
    assert main([*base, "--steps", "3", "--dump-batches", first, "--save-state", state]) == 0
    assert main([*base, "--steps", "5", "--dump-batches", rest, "--resume", state]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" in out and "summary" in out and "target tokens/s" in out
    assert "batches" in err and "tok/s" in err  # the progress bar
    resumed = torch.load(first, weights_only=True) + torch.load(rest, weights_only=True)
    assert_same_batches(resumed, torch.load(full, weights_only=True))


def test_run_summary_has_shares_waste_and_state_size(two_sources, tmp_path, capsys):
    png = tmp_path / "run.png"
    assert main(["run", *two_sources, *SMALL, "--steps", "6", "--quiet", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # --quiet
    for text in ("padding", "discarded", "loader state", "KiB", "target", "share"):
        assert text in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith(("a ", "b "))}
    assert "60.00%" in rows["a"] and "40.00%" in rows["b"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_to_the_end_of_an_epoch(two_sources, tok_path, tmp_path):
    corpus = two_sources[0].split("=", 1)[1]
    dump = str(tmp_path / "all.pt")
    assert main(["run", corpus, "--tokenizer", "demo", "--seq-len", "256", "--batch-size", "8", "--epochs", "1", "--quiet",
                 "--dump-batches", dump]) == 0
    batches = torch.load(dump, weights_only=True)
    want = list(pretrain(corpus, tokenizer=tok_path, seq_len=256, batch_size=8, epochs=1))
    assert_same_batches(batches, want)


# --- demo ---------------------------------------------------------------------------

def test_demo_runs_to_its_summary_and_writes_the_png(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    rc = main(["demo", "--steps", "6", "--max-docs", "150", "--seq-len", "64", "--batch-size", "2",
               "--workers", "0", "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "EXACT" in out and "summary" in out and "target tokens/s" in out and "loader state" in out
    assert "code" in out and "prose" in out and "70.00%" in out and "30.00%" in out
    assert "resume check" in err
    assert (out_dir / "summary.png").read_bytes()[:4] == b"\x89PNG"


# --- inspect ------------------------------------------------------------------------

def test_inspect_shows_segments_and_padding(tmp_path, capsys):
    texts = [f"doc{i} " + "word " * (3 + i) for i in range(6)]
    path = write_corpus(str(tmp_path / "tiny"), texts, files=1)[0]
    assert main(["inspect", path, "--tokenizer", "demo", "--seq-len", "128", "--batch-size", "2", "--epochs", "1", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[-1]
    assert row.count(" ‖ ") == 5, row  # six documents in one row
    assert "<pad x" in row and row.rstrip().endswith(">")
    assert all(f"doc{i}" in row for i in range(6))
    assert "6 segments" in out


def test_inspect_sft_shows_the_trained_span(chats, capsys):
    assert main(["inspect", "--recipe", "sft", chats, "--tokenizer", "demo", "--seq-len", "128", "--batch-size", "2", "--rows", "2",
                 "--chars", "2000", "--color", "never"]) == 0
    out = capsys.readouterr().out
    rows = "\n".join(line for line in out.splitlines() if line.startswith("  "))
    spans = [part.split("]]")[0] for part in rows.split("[[")[1:]]
    assert len(spans) >= 4
    for span in spans:  # answers "A{i}x{t} ..." and their end-of-turn token, nothing else
        assert span.startswith("A") and span.endswith("<|end|>") and "<|user|>" not in span, span
    assert "<|user|>Q" in rows  # questions are shown, outside the spans


def test_render_row_cuts_long_rows_but_keeps_trailing_padding():
    ids, segs = list(range(20)), [1] * 8 + [2] * 8 + [0] * 4
    text = render_row(lambda xs: "x" * len(xs), ids, [0] * 20, segs, show_trained=False, chars=5, color=False)
    assert text == "xxxxx… (+8 tokens in 1 more segments) <pad x4>"


# --- state --------------------------------------------------------------------------

def test_state_prints_configuration_and_worker_positions(two_sources, tmp_path, capsys):
    path = str(tmp_path / "state.pt")
    assert main(["run", *two_sources, *SMALL, "--workers", "2", "--steps", "5", "--quiet", "--save-state", path]) == 0
    capsys.readouterr()
    assert main(["state", path]) == 0
    out = capsys.readouterr().out
    for text in (f"tokenloom.loader version {STATE_VERSION}", "world size 1, rank 0", "2 workers, seq_len 32, batch size 2",
                 "packing bestfit (buffer 40)", "tokenizer", "from step 0: a 0.600, b 0.400",
                 "round 0, 5 batches handed to the training loop", "the next batch comes from worker 1",
                 "worker 0: round 0, 3 batches built", "worker 1: round 0, 2 batches built", "packer bestfit"):
        assert text in out, text
    assert sum(1 for line in out.splitlines() if "epoch 0, " in line) == 4  # 2 workers x 2 sources
    assert "parquet:" in out and "share" in out
    # the configuration's labels in one column, never run into their values (buffer_tokens8208)
    lines = out.splitlines()
    config = lines[lines.index("configuration (a resume must match it)") + 1:lines.index("progress")]
    labelled = [line for line in config if not line.startswith("   ")]
    labels = {line.split()[0] for line in labelled}
    assert {"buffer_tokens", "source_order", "weights", "sources"} <= labels, config
    # where each value starts: after the label and at least two spaces, the same column on every line
    starts = {len(line) - len(line[2 + len(line.split()[0]):].lstrip()) for line in labelled}
    assert len(starts) == 1 and all("  " in line[2:] for line in labelled), config
    assert any(line.startswith("  source_order") and line.endswith("  ['a', 'b']") for line in config), config

    assert main(["state", path, "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["tokenloom"]["config"]["num_workers"] == 2


def test_state_reads_a_trainer_checkpoint_holding_the_loader_state(two_sources, tok_path, tmp_path, capsys):
    loader = pretrain(two_sources[0].split("=", 1)[1], tokenizer=tok_path, seq_len=32, batch_size=2)
    next(iter(loader))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "step": 1, "loader": loader.state_dict()}, path)
    assert main(["state", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 batches handed" in out and "worker 0" in out and "default" in out


# --- errors -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["run", "--seq-len", "abc", "x"], "invalid int value: 'abc'"),
    (["run", "/nonexistent/dir/x.parquet", "--tokenizer", "demo"], "/nonexistent/dir/x.parquet"),
    (["run", "{corpus}", "--tokenizer", "demo", "--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["run", "{corpus}", "--tokenizer", "demo", "--resume", "/nonexistent/state.pt"], "/nonexistent/state.pt"),
    (["run", "{corpus}"], "no tokenizer: pass --tokenizer PATH"),
    (["state", "/nonexistent/state.pt"], "no such file"),
    (["run", "a={corpus}", "b={corpus}", "--tokenizer", "demo", "--weights", "a=1", "c=1"], "'c'"),
    (["run", "{corpus}", "--tokenizer", "demo", "--messages-field", "m"], "--recipe sft"),
    (["run", "{corpus}", "--config", "/nonexistent/run.toml"], "run.toml"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_errors_are_one_line_with_exit_code_2(corpus, capsys, argv, needle):
    argv = [a.replace("{corpus}", corpus[0]) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    line = one_error_line(err)
    assert needle in line and line.startswith("tokenloom")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_lets_the_exception_through(corpus, where):
    argv = ["run", corpus[0], "--tokenizer", "demo", "--seq-len", "0"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(ValueError, match="seq_len=0"):
        main(argv)


def test_python_dash_m_reports_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tokenloom", "state", str(tmp_path / "missing.pt")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no such file" in one_error_line(proc.stderr)


# --- configuration ------------------------------------------------------------------

def test_toml_config_is_read_and_flags_override_it(two_sources, tmp_path, capsys):
    a, b = (s.split("=", 1)[1] for s in two_sources[:2])
    cfg = tmp_path / "conf" / "run.toml"
    cfg.parent.mkdir()
    cfg.write_text(f'seq-len = 32\nbatch_size = 3\nsteps = 2\nbuffer_size = 40\ntokenizer = "demo"\n'
                   f'[sources]\na = "{os.path.relpath(a, cfg.parent)}"\nb = ["{b}"]\n'
                   f'[weights]\na = 0.5\nb = 0.5\n')
    dump = str(tmp_path / "b.pt")
    assert main(["run", "--config", str(cfg), "--batch-size", "2", "--quiet", "--dump-batches", dump]) == 0
    out = capsys.readouterr().out
    assert "weights a=0.50 b=0.50" in out and "seq_len=32 batch_size=2" in out
    batches = torch.load(dump, weights_only=True)
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (2, 32)

    cfg.write_text('seq_len = "long"\n')
    assert main(["run", "--config", str(cfg)]) == 2
    assert "must be an integer" in one_error_line(capsys.readouterr().err)
    cfg.write_text('seq_length = 3\n')
    assert main(["run", "--config", str(cfg)]) == 2
    assert "unknown setting 'seq_length'" in one_error_line(capsys.readouterr().err)


def test_every_setting_is_a_recipe_parameter():
    recipes = {"pretrain": pretrain, "sft": sft}
    for s in SETTINGS:
        for r in s.recipes if s.kwarg else ():
            assert s.kwarg in inspect.signature(recipes[r]).parameters, (s.key, r)
