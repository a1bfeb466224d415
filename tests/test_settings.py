"""The settings are written once (issue 36): every setting of `pretrain` and `sft` is one field of
recipes/settings.py, and what reads settings reads the fields: the recipes' keywords, the CLI's
flags and TOML keys, ``inspect --settings`` and the resume check. ``min_fill`` is the setting
added that way (a field, its use in the graph, the recipes' keyword)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.cli import main
from tokenloom.pipes.loader.config_check import TOPOLOGY, TOPOLOGY_HINTS
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.items import TokenDoc
from tokenloom.pipes.sources.memory import FromList
from tokenloom.recipes import pretrain, sft
from tokenloom.recipes.setting import FREE, RECIPES, TOPOLOGY as RESUME_TOPOLOGY, keyword_of
from tokenloom.recipes.settings import PackedSpec

from .conftest import write_corpus
from .resume import torch_roundtrip

RECIPE = {"pretrain": pretrain, "sft": sft}


def settings_of(recipe):
    """``[(keyword, Meta, default)]`` of every setting of a recipe, from the spec's fields."""
    out = []
    for attr, group in PackedSpec.groups(recipe).items():
        for f in dataclasses.fields(group):
            meta = f.metadata["setting"]
            out.append((keyword_of(f.name, meta, recipe), meta, f.default))
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_keywords_are_the_settings_with_their_defaults(recipe):
    params = {p.name: p for p in inspect.signature(RECIPE[recipe]).parameters.values()
              if p.kind is not p.VAR_KEYWORD}
    fields = {k: default for k, _, default in settings_of(recipe)}
    assert set(params) == set(fields), (f"{recipe}(): keywords without a settings field "
                                        f"{sorted(set(params) - set(fields))}, fields without a keyword "
                                        f"{sorted(set(fields) - set(params))}")
    for name, p in params.items():
        default = fields[name]
        want = inspect.Parameter.empty if default is dataclasses.MISSING else default
        assert p.default == want, f"{recipe}({name}=...): the keyword's default {p.default!r}, the field's {want!r}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_setting_has_a_flag_or_says_why_not(recipe):
    from tokenloom.cli_config import BY_KEY, SETTINGS

    kwargs = {s.kwarg: s for s in SETTINGS if recipe in s.recipes}
    for keyword, meta, _ in settings_of(recipe):
        if meta.cli is None:
            assert meta.no_cli, keyword
            continue
        assert keyword in kwargs, f"{recipe}: setting {keyword} has no flag"
        flag = kwargs[keyword]
        assert BY_KEY[flag.key] is flag and meta.doc in flag.help, keyword


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_setting_is_recorded_for_a_resume_with_what_to_tell_the_user(recipe, chat_corpus, text_corpus,
                                                                         tok_path):
    spec = PackedSpec.of(recipe, sources=chat_corpus if recipe == "sft" else text_corpus, tokenizer=tok_path)
    loader = RECIPE[recipe](spec.data.sources, tok_path, seq_len=31, batch_size=2)
    hints = {**loader.settings.hints(), **TOPOLOGY_HINTS}
    absent = loader.settings.absent()
    for attr, name, meta, _ in loader.settings.items():
        key = meta.record or name
        if meta.resume == FREE:
            assert meta.hint, f"{name}: a setting left out of the resume check says why"
            assert key not in loader.config or key in ("chat",), name
            continue
        assert key in loader.config or key in absent, f"{name} is not recorded under {key!r}: {sorted(loader.config)}"
        assert hints.get(key), f"{key}: no hint for a resume that changes it"
        assert (meta.resume == RESUME_TOPOLOGY) == (key in TOPOLOGY), key


def _other(meta, value):
    """Another legal value of a setting whose values the field declares, else None."""
    cli = meta.cli
    if cli is not None and cli.choices:
        return next(c for c in cli.choices if c != value)
    if cli is not None and cli.type is bool:
        return not value
    if cli is not None and cli.type is int:
        return 7 if value is None else value + 3
    return None


def test_a_changed_setting_is_refused_at_resume_naming_it(text_corpus, tok_path):
    """For every setting whose field declares its values: a resume with another one is refused,
    naming the recorded key and the hint (the topology: the loader's own hint)."""
    base = dict(seq_len=31, batch_size=2, epochs=2, packing="bestfit")
    loader = pretrain(text_corpus, tok_path, **base)
    it = iter(loader)
    next(it)
    state = torch_roundtrip(loader.state_dict())
    tried = []
    for attr, name, meta, value in loader.settings.items():
        other = _other(meta, value)
        if other is None or meta.resume == FREE or name in ("rank", "world_size"):
            continue
        if name in ("mix", "weights_unit", "stop", "cycle_exhausted", "burst", "text_mode"):
            continue  # one source: no mixer, nothing of the mix recorded (two sources: test_config_checks.py)
        kw = {**base, name: other}
        if name == "min_fill":
            kw["min_fill"] = 5
        changed = pretrain(text_corpus, tok_path, **kw)
        with pytest.raises(ValueError, match=rf"\b{meta.record or name}: saved with"):
            changed.load_state_dict(state)
        tried.append(name)
    assert {"seq_len", "batch_size", "packing", "buffer_size", "buffer_tokens", "max_wait", "min_fill", "seed",
            "epochs", "num_workers", "predict_bos"} <= set(tried), tried


def test_inspect_prints_every_setting(text_corpus, tok_path, capsys):
    assert main(["inspect", text_corpus, "--tokenizer", tok_path, "--seq-len", "31", "--rows", "1",
                 "--settings", "--min-fill", "3"]) == 0
    out = capsys.readouterr().out
    for keyword, _, _ in settings_of("pretrain"):
        assert f" {keyword}=" in out, f"inspect --settings does not show {keyword}"
    assert " min_fill=3" in out


def test_a_toml_file_takes_every_flag(tmp_path, text_corpus, tok_path, capsys):
    from tokenloom.cli_config import SETTINGS, read_toml

    path = tmp_path / "run.toml"
    path.write_text(f'tokenizer = "{tok_path}"\nmin_fill = 4\npattern = ["a", "b"]\nburst = 2\n'
                    f'cycle_exhausted = false\nbuffer_tokens = 640\n')
    got = read_toml(str(path))
    assert got["min_fill"] == 4 and got["pattern"] == ["a", "b"] and got["cycle_exhausted"] is False
    assert {s.key for s in SETTINGS} >= {"min_fill", "pattern", "burst", "cycle_exhausted", "buffer_tokens",
                                         "max_wait", "manifest", "workers"}


# --- min_fill: the setting added in one place ------------------------------------------------

def _docs(seed, n=60, C=33):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4 * C, size=n)
    return [TokenDoc(np.arange(i * 10_000, i * 10_000 + k, dtype=np.int32), "s") for i, k in enumerate(lengths)]


def _gap_cuts(rows, docs):
    """Lengths of the pieces cut off a longer document to fill a row's end: a segment after
    another in its row, ending at the row's end, whose document goes on in a later row."""
    cuts = []
    for row in rows:
        lens = [int(n) for n in row.seg_lens]
        if len(lens) < 2 or sum(lens) != len(row.tokens):
            continue
        last = int(row.tokens[-1])
        doc, offset = last // 10_000, last % 10_000
        if offset + 1 < len(docs[doc].ids):
            cuts.append(lens[-1])
    return cuts


@pytest.mark.parametrize("min_fill", [1, 6])
def test_min_fill_cuts_no_piece_shorter_than_it_to_fill_a_row(min_fill):
    C = 33
    docs = _docs(0, C=C)
    packer = BestFitPack(FromList(docs), seq_len=C - 1, buffer_size=4, pad_id=-1, min_fill=min_fill)
    packer.reset()
    rows = list(packer)
    delivered = np.concatenate([r.tokens[r.tokens >= 0] for r in rows])
    assert sorted(delivered.tolist()) == sorted(np.concatenate([d.ids for d in docs]).tolist())
    cuts = _gap_cuts(rows, docs)
    assert cuts, "no row was filled by cutting a long document"
    if min_fill == 1:
        assert min(cuts) < 6, "the corpus must have short cuts for min_fill to remove"
    else:
        assert min(cuts) >= min_fill, cuts


def test_min_fill_through_the_recipe_is_checked_and_recorded(text_corpus, tok_path):
    with pytest.raises(ValueError, match=r"min_fill=40 must be <= seq_len=31"):
        pretrain(text_corpus, tok_path, seq_len=31, min_fill=40)
    with pytest.raises(ValueError, match=r"min_fill=0 must be >= 1"):
        pretrain(text_corpus, tok_path, seq_len=31, min_fill=0)
    assert "min_fill" not in pretrain(text_corpus, tok_path, seq_len=31).config  # as states saved before it
    assert pretrain(text_corpus, tok_path, seq_len=31, min_fill=4).config["min_fill"] == 4
    assert "min_fill" not in pretrain(text_corpus, tok_path, seq_len=31, min_fill=4, packing="flat").config
    # it reaches the packer: fewer, longer cuts mean more padding over an epoch
    padding = {}
    for min_fill in (1, 12):
        loader = pretrain(text_corpus, tok_path, seq_len=31, batch_size=4, epochs=1, buffer_size=4, min_fill=min_fill)
        padding[min_fill] = sum(int((b["segment_ids"] == 0).sum()) for b in loader)
    assert padding[12] > padding[1], padding


# --- corpora ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("settings_text"))
    write_corpus(root, [f"document {i} " + "word " * (3 + i * 7 % 60) for i in range(200)], files=1,
                 row_group_size=50)
    return root


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("settings_chat")
    with open(os.path.join(root, "c.jsonl"), "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                             {"role": "assistant", "content": "a " * (i % 9 + 1)}]}) + "\n")
    return str(root)


def test_multiplex_keywords_are_its_settings_and_each_is_recorded_or_says_why_not():
    from tokenloom.recipes.multiplex import MultiplexSpec, multiplex
    from tokenloom.recipes.setting import settings_fields

    params = {p.name: p.default for p in inspect.signature(multiplex).parameters.values()
              if p.kind is not p.VAR_KEYWORD}
    fields = {name: f.default for name, f in settings_fields(MultiplexSpec)}
    assert params == {k: (inspect.Parameter.empty if v is dataclasses.MISSING else v) for k, v in fields.items()}
    loader = multiplex([("a", [{"x": i} for i in range(8)]), ("b", [{"x": -i} for i in range(4)])], batch_size=2)
    hints = {**loader.config_hints, **TOPOLOGY_HINTS}
    for name, f in settings_fields(MultiplexSpec):
        meta = f.metadata["setting"]
        key = meta.record or name
        if meta.resume == FREE:
            assert meta.hint and key not in loader.config, name
        else:
            assert key in loader.config and hints.get(key), name
    state = torch_roundtrip(loader.state_dict())
    other = multiplex([("a", [{"x": i} for i in range(8)]), ("b", [{"x": -i} for i in range(4)])], batch_size=2,
                      drop_last=True)
    with pytest.raises(ValueError, match=r"drop_last: saved with False, this loader has True \(pass the same drop_last"):
        other.load_state_dict(state)


def test_the_recorded_configuration_is_what_states_saved_before_the_settings_tree_hold(tmp_path):
    """tests/data/configs_before_issue36.json: ``loader.config`` of these calls on the code before
    recipes/settings.py (commit 4c99fd2), the sources' fingerprints left out (they name the files):
    a state saved then loads now, and no setting changed its recorded value."""
    from tokenloom.recipes.multiplex import multiplex

    root = tmp_path
    for name in ("code", "man"):
        os.makedirs(root / name)
        texts = [f"{name} document {i} " + "word " * (5 + i % 40) for i in range(300)]
        pq.write_table(pa.table({"text": texts}), root / name / "a.parquet", row_group_size=50)
    with open(root / "c.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    two = {"code": str(root / "code"), "man": str(root / "man")}
    got = {
        "single": pretrain(str(root / "code"), "demo", seq_len=63).config,
        "two": pretrain(two, "demo", seq_len=63, weights={"code": 0.7, "man": 0.3}, epochs=2,
                        stop="first_exhausted").config,
        "flat": pretrain(two, "demo", seq_len=63, packing="flat", pad=5, predict_bos=False).config,
        "crop": pretrain(two, "demo", seq_len=63, packing="bestfit-crop", buffer_size=40, max_wait=30,
                         mix="alternating", pattern=["code", "man"], burst=2).config,
        "sched": pretrain(two, "demo", seq_len=63, weights=[(0, {"code": 1, "man": 1}), (10, {"code": 1, "man": 3})],
                          text_column={"code": "text", "man": "text"}, buffer_tokens=999).config,
        "sft": sft(str(root / "c.jsonl"), "demo", seq_len=63).config,
        "mux": multiplex([("a", [{"x": i} for i in range(8)]), ("b", [{"x": -i} for i in range(4)])], batch_size=2,
                         epoch_length="steps", steps=3).config,
    }
    got = json.loads(json.dumps({k: {kk: v for kk, v in c.items() if kk != "sources"} for k, c in got.items()}))
    with open(os.path.join(os.path.dirname(__file__), "data", "configs_before_issue36.json")) as f:
        assert got == json.load(f)


@pytest.mark.parametrize("doc", ["settings.md", "recipes.md"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_docs_list_every_setting(recipe, doc):
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", doc)) as f:
        text = f.read()
    missing = [k for k, _, _ in settings_of(recipe) if f"`{k}`" not in text]
    assert not missing, f"docs/{doc} does not list {missing}"
