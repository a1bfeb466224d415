"""Settings a resume must match, checked at load: accepted-then-wrong states are refused
with the setting named (issue 14: source order, text column and mode, argument types)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.recipes import pretrain

from .resume import items_equal, torch_roundtrip


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    for name in ("code", "man"):
        os.makedirs(root / name)
        texts = [f"{name} document {i} " + "word " * (5 + i % 40) for i in range(300)]
        pq.write_table(pa.table({"text": texts, "body": texts[::-1]}), root / name / "a.parquet", row_group_size=50)
    return {"code": str(root / "code"), "man": str(root / "man")}


def _after(loader, k):
    it = iter(loader)
    for _ in range(k):
        next(it)
    return torch_roundtrip(loader.state_dict()), next(it)


def test_sources_in_another_order_are_refused_naming_the_order(two_sources, tok_path):
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2, weights={"code": 0.6, "man": 0.4}, seed=2)
    state, _ = _after(pretrain(two_sources, **kw), 5)
    swapped = {"man": two_sources["man"], "code": two_sources["code"]}
    with pytest.raises(ValueError, match=r"source_order: saved with \['code', 'man'\].*\['man', 'code'\]"):
        pretrain(swapped, **kw).load_state_dict(state)
    same = pretrain(dict(two_sources), **kw)  # the same order loads and goes on exactly
    state, want = _after(pretrain(two_sources, **kw), 5)
    same.load_state_dict(state)
    assert items_equal(next(iter(same)), want)


@pytest.mark.parametrize("change", [{"text_column": "body"}, {"text_mode": "paragraphs"}])
def test_text_column_and_text_mode_are_part_of_the_configuration(two_sources, tok_path, change):
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2, seed=2)
    state, _ = _after(pretrain(two_sources["code"], **kw), 3)
    with pytest.raises(ValueError, match=r"text: saved with 'column=text mode=file'.*text_column"):
        pretrain(two_sources["code"], **kw, **change).load_state_dict(state)


@pytest.mark.parametrize("arg,value,error,needle", [
    ("seq_len", "2048", TypeError, "seq_len='2048' must be an int, not str: pass seq_len=2048"),
    ("batch_size", 8.0, TypeError, "batch_size=8.0 must be an int"),
    ("buffer_size", True, TypeError, "buffer_size=True must be an int"),
    ("epochs", "1", TypeError, "epochs='1' must be an int"),
    ("num_workers", -1, ValueError, "num_workers=-1 must be >= 0"),
])
def test_argument_types_are_checked_at_the_call(two_sources, tok_path, arg, value, error, needle):
    with pytest.raises(error) as e:
        pretrain(two_sources["code"], tokenizer=tok_path, **{arg: value})
    assert needle in str(e.value)


@pytest.mark.parametrize("change, first, consequences", [
    (dict(seq_len=95), "seq_len: saved with 63, this loader has 95", ["buffer_tokens"]),
    (dict(packing="flat"), "packing: saved with 'bestfit', this loader has 'flat'", ["buffer_size", "buffer_tokens"]),
])
def test_a_changed_setting_is_named_before_what_the_recipe_derives_from_it(two_sources, tok_path, change, first,
                                                                          consequences):
    """The user changed seq_len (or packing); buffer_tokens (and buffer_size), which they never
    passed, differ because of it: told on the line of the setting they changed, not as lines of
    their own that send them looking for an argument they did not give."""
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2)
    state, _ = _after(pretrain(two_sources, **kw), 3)
    with pytest.raises(ValueError) as e:
        pretrain(two_sources, **{**kw, **change}).load_state_dict(state)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith(first), lines
    for key in consequences:
        assert f"({key} differs as a consequence: saved with " in lines[0], lines


@pytest.mark.parametrize("recipe, kwargs, needle", [
    ("pretrain", dict(num_worker=2), "pretrain() got unexpected keyword argument(s): num_worker=2 (did you mean num_workers=?)"),
    ("pretrain", dict(seqlen=64), "seqlen=64 (did you mean seq_len=?)"),
    ("pretrain", dict(prefetch_factr=4), "prefetch_factr=4 (did you mean prefetch_factor=?)"),
    ("sft", dict(messages_feld="m"), "sft() got unexpected keyword argument(s): messages_feld='m' (did you mean messages_field=?)"),
    ("multiplex", dict(pin_memroy=True), "multiplex() got unexpected keyword argument(s): pin_memroy=True (did you mean pin_memory=?)"),
])
def test_a_misspelt_keyword_names_the_close_match(two_sources, tok_path, recipe, kwargs, needle):
    """Keywords a recipe does not take go to torch's DataLoader, which said only
    "__init__() got an unexpected keyword argument"; the recipe now names its closest argument."""
    from tokenloom import recipes

    with pytest.raises(TypeError) as e:
        if recipe == "multiplex":
            recipes.multiplex({"a": list(range(10))}, batch_size=2, **kwargs)
        else:
            getattr(recipes, recipe)(two_sources, tokenizer=tok_path, **kwargs)
    assert needle in str(e.value), str(e.value)


def test_eos_equal_to_the_bos_is_refused(two_sources, tok_path):
    """Two delimiters between documents (the EOS, then the next BOS) is never what was meant."""
    with pytest.raises(ValueError, match=r"eos='<\|bos\|>' is the BOS \(id \d+\): every document would be followed "
                                         r"by two of them"):
        pretrain(two_sources, tokenizer=tok_path, bos="<|bos|>", eos="<|bos|>")


def test_the_same_files_under_two_source_names_are_warned(two_sources, tok_path):
    with pytest.warns(UserWarning, match=r"sources 'code' and 'again' both read 1 file\(s\), e.g. '.*a.parquet': "
                                         r"their documents come once per source"):
        pretrain({"code": two_sources["code"], "again": two_sources["code"]}, tokenizer=tok_path)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same file read as another column is another source
        pretrain({"code": two_sources["code"], "rev": two_sources["code"]}, tokenizer=tok_path,
                 text_column={"code": "text", "rev": "body"})


def test_a_cache_built_under_other_source_names_is_an_error(two_sources, tok_path, tmp_path):
    """It warned per source, then tokenized everything on the fly: the cache silently unused."""
    from tokenloom.pipes.sources.cache import build_cache

    out = str(tmp_path / "cache")
    build_cache({"c": two_sources["code"], "m": two_sources["man"]}, tok_path, out, processes=1)
    with pytest.raises(ValueError) as e:
        pretrain(two_sources, tokenizer=tok_path, cache=out)
    msg = str(e.value)
    assert "holds no token cache of any source of this loader ['code', 'man'] (it holds ['c', 'm'])" in msg, msg
    assert "build and train with the same names" in msg and "leave cache= out" in msg, msg
    with pytest.warns(UserWarning, match="holds no token cache"):  # one source of two cached: the other tokenized
        pretrain({"c": two_sources["code"], "other": two_sources["man"]}, tokenizer=tok_path, cache=out)


def test_max_wait_is_a_setting_of_the_run(two_sources, tok_path):
    """bestfit-crop's waiting bound, a choice (issue 27): it decides the rows, so it is part of
    the configuration; the default follows buffer_size, and a changed buffer_size says so once."""
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2, packing="bestfit-crop", buffer_size=40)
    loader = pretrain(two_sources, **kw)
    assert loader.config["max_wait"] == 40
    state, _ = _after(loader, 3)
    pretrain(two_sources, max_wait=40, **kw).load_state_dict(state)  # the default, spelt out
    with pytest.raises(ValueError, match=r"max_wait: saved with 40, this loader has 400 \(pass the same max_wait"):
        pretrain(two_sources, max_wait=400, **kw).load_state_dict(state)
    with pytest.raises(ValueError) as e:
        pretrain(two_sources, **{**kw, "buffer_size": 80}).load_state_dict(state)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1 and "max_wait differs as a consequence: saved with 40, this loader has 80" in lines[0], lines
    with pytest.raises(ValueError, match=r"max_wait=0 must be >= 1"):
        pretrain(two_sources, max_wait=0, **kw)
    assert pretrain(two_sources, **{**kw, "packing": "flat"}).config["max_wait"] is None


def test_a_longer_wait_crops_less_on_short_and_long_documents(tmp_path, tok_path):
    """What users buy with it: fewer tokens discarded (on documents between half a row and a
    row, the ones crop loses most), never more."""
    import numpy as np

    rng = np.random.default_rng(0)
    texts = [" ".join(["word"] * int(n)) for n in rng.integers(20, 60, 600)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=100)
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=4, packing="bestfit-crop", buffer_size=8, epochs=1)
    discarded = {}
    for wait in (None, 64):
        loader = pretrain(str(path), max_wait=wait, buffer_tokens=None if wait is None else 64 * 64, **kw)
        list(loader)
        s = loader.stats()
        discarded[wait] = s["discarded"] / s["tokens_in"]
    assert discarded[64] < discarded[None], discarded
