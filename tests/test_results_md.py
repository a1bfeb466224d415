"""benchmarks/RESULTS.md names the tokenizer of every figure (issue 45): each ``## `` section opens
with ``Tokenizer: ...``, as `benchmarks/results_md.write_section` writes it, and names one the
benchmarks use. Speed depends on the tokenizer more than on anything else measured there."""

from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
#: Words one of which a section's tokenizer line must hold: the tokenizers the benchmarks measure with (or none, for
#: graph_cost.py's sources of ready token ids).
KNOWN = ("demo tokenizer", "cl100k", "o200k", "trained here", "no tokenizer runs")


def sections(text: str):
    parts = re.split(r"(?m)^## (.*)\n", text)
    return list(zip(parts[1::2], parts[2::2]))


def test_every_results_section_opens_with_its_tokenizer():
    found = sections(open(RESULTS, encoding="utf-8").read())
    assert found, "no sections in RESULTS.md"
    for name, body in found:
        first = body.lstrip("\n").split("\n\n", 1)[0]
        assert first.startswith("Tokenizer: "), f"RESULTS.md section {name!r} does not open with 'Tokenizer: ...'"
        assert any(k in first for k in KNOWN), f"section {name!r} names no tokenizer the benchmarks use: {first!r}"


def test_write_section_puts_the_tokenizer_first_and_replaces_in_place(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from results_md import DEMO, real, write_section
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    path = str(tmp_path / "R.md")
    write_section(path, "a", "body a", tokenizer=DEMO)
    write_section(path, "b", "body b", tokenizer=real("cl100k"))
    write_section(path, "a", "body a2", tokenizer=real("o200k"))
    got = dict(sections(open(path, encoding="utf-8").read()))
    assert list(got) == ["a", "b"]
    assert got["a"].lstrip().startswith("Tokenizer: the real o200k") and "body a2" in got["a"] and "body a\n" not in got["a"]
    assert got["b"].lstrip().startswith("Tokenizer: the real cl100k")
    with pytest.raises(TypeError):
        write_section(path, "c", "no tokenizer named")  # noqa - the keyword is required
