"""Two loaders started at once from two threads (ranks simulated as threads), under filelock's fork
audit: the audit raises when a thread forks while another thread is inside its own fork.
CPython 3.12+ installs the audit with filelock; on 3.11 it is added here, as there.

usage: fork_race_job.py TIMES [CORPUS_DIR]    prints the errors the threads met (a JSON list)
CORPUS_DIR: where the demo corpus is (or is built; reused when already there); a new folder if not given.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading

from filelock._core import _fork

if sys.version_info < (3, 12):
    sys.addaudithook(_fork._audit_fork_safety)

from tokenloom.recipes import pretrain  # noqa: E402
from tokenloom.sample_data import build_demo_corpus  # noqa: E402


def main() -> None:
    times = int(sys.argv[1])
    sources = build_demo_corpus(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
    errors = []
    together = threading.Barrier(2, timeout=60)  # both start their workers at the same instant

    def rank(r: int) -> None:
        try:
            for _ in range(times):
                loader = pretrain(sources, tokenizer="demo", seq_len=64, batch_size=2, num_workers=2, rank=r,
                                  world_size=2)
                together.wait()
                it = iter(loader)
                next(it)
                del it
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(repr(e))
            together.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
