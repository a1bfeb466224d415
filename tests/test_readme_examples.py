"""Every README code block marked `<!-- example: NAME -->` runs, with the names it documents."""

from __future__ import annotations

import json
import os
import re

import pytest

from tokenloom.sample_data import default_tokenizer_path

ROOT = os.path.dirname(os.path.dirname(__file__))
#: The README and the doc that holds its "coming from another loader" examples.
PAGES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "migrating.md")]


def examples():
    text = "\n".join(open(page, encoding="utf-8").read() for page in PAGES)
    return dict(re.findall(r"<!-- example: ([\w-]+) -->\s*```python\n(.*?)```", text, re.S))


def test_the_readme_has_the_examples():
    assert {"multiplex", "sft", "text-files"} <= set(examples())


@pytest.mark.parametrize("name", sorted(examples()))
def test_readme_example_runs(name, tmp_path):
    chat_file = tmp_path / "chats.jsonl"
    with open(chat_file, "w") as f:
        for i in range(60):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i} " + "why " * (i % 7)},
                                             {"role": "assistant", "content": f"answer {i} " + "because " * (i % 9)}]})
                    + "\n")
    text_dir = tmp_path / "notes"
    text_dir.mkdir()
    for k in range(3):
        (text_dir / f"n{k}.txt").write_text("\n\n".join(f"note {k}.{p} " + "word " * (p * 7 % 40) for p in range(30)))
    namespace = {"chat_file": str(chat_file), "tokenizer_path": default_tokenizer_path(), "text_dir": str(text_dir)}
    exec(compile(examples()[name], f"README example {name}", "exec"), namespace)
