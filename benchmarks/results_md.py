"""Shared by the benchmark scripts: replace one ``## section`` of benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import re


def write_section(path: str, name: str, body: str) -> None:
    """Add or replace the ``## name`` section of RESULTS.md, leaving the others as they are."""
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmark results\n"
    section = f"## {name}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
