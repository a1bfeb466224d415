"""The fastokens engine: a Rust BPE that loads a tokenizer.json, used where it gives `tokenizers`' ids.

fastokens (the optional ``fast`` extra) runs the BPE of most tokenizer.json files, byte-level and
byte-fallback alike, several times faster than `tokenizers` and tiktoken, but not every normalizer
or pre-tokenizer. So, like tiktoken (tiktoken_bpe.py), it is used for a tokenizer only after a
check: it must load the file, and encode a sample (`tiktoken_bpe.sample_texts`, plus every added
token's spelling, which data text must never turn into a control token) to exactly the ids of
`tokenizers` with special-token spellings as text. `verdict` says yes or why not; the loader keeps
the verdict per file content (tokenizer_cache.py) and chooses among the engines (tokenizer.py).

`encode_batch` asks fastokens for one flat buffer of ids and the offsets of each text
(``encode_batch_flat``): no Python object per token. fastokens spreads a batch over its own
threads; in a loader worker, where the workers are the parallelism, it is told to use one
(`single_thread`, called with the other tokenizers' switch, tokenizer_threads.py). The tokenizer is
built once per process from the serialized tokenizer.json the worker receives.

Building a 100k-id tokenizer takes fastokens a second or more, longer than a whole first batch. So the
process that encodes builds it in a background thread (`ready` starts it, once the stand-in has had the
first batches to itself; fastokens releases the GIL for most of the build) and, until it is built, the
Encoder encodes with a stand-in engine whose verdict says it gives the same ids (tokenizer.py); nothing
waits for the slowest engine to load. The training process
never builds it for its workers: a worker builds its own, so no fastokens state (its thread pool, its
allocator's threads) is made in the training process on the loader's account before a fork.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import process_hooks
from .engines import first_difference

#: fastokens' own thread count for a batch, and the Rayon pool's it may use.
THREAD_VARIABLES = ("FASTOKENS_BPE_THREADS", "RAYON_NUM_THREADS")
INSTALL_HINT = "pip install 'tokenloom[fast]'"

_lock = threading.Lock()
_built: Dict[int, Tuple[str, Any]] = {}  # by id of the payload's hash key: (payload, tokenizer)
# Builds under way in this process, by the payload's hash: (payload, the thread, [exception] once failed).
_building: Dict[int, Tuple[str, threading.Thread, List[BaseException]]] = {}
_pid = os.getpid()  # a build thread does not survive a fork: a child starts its own
_first_call: Dict[int, float] = {}  # by the payload's hash: when this process first asked for it
#: How long the stand-in encodes alone before fastokens' build starts beside it.
STAND_IN_S = 1.0


def version() -> Optional[str]:
    """fastokens' version, or None where it is not installed."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version as installed

    if importlib.util.find_spec("fastokens") is None:
        return None
    try:
        return installed("fastokens")
    except PackageNotFoundError:  # importable without metadata
        return "?"


def build(payload: str) -> Any:
    """The fastokens tokenizer of a tokenizer.json text, built once per process."""
    key = hash(payload)
    with _lock:
        found = _built.get(key)
        if found is not None and found[0] == payload:
            return found[1]
    import fastokens

    tok = fastokens.Tokenizer.from_json_str(payload)
    with _lock:
        _built[key] = (payload, tok)
    return tok


def ready(payload: str) -> Optional[Any]:
    """The fastokens tokenizer of a tokenizer.json text if it is built in this process, else None, and
    its build is then under way in a background thread, started by the first call `STAND_IN_S` seconds
    or more after the first (the first batches are the stand-in's alone: the build takes CPU and, now
    and then, the GIL). A build that failed raises its error here, once the thread has ended."""
    global _pid
    key = hash(payload)
    with _lock:
        found = _built.get(key)
        if found is not None and found[0] == payload:
            return found[1]
        if _pid != os.getpid():  # forked: the parent's build threads and first calls are not this process's
            _building.clear()
            _first_call.clear()
            _pid = os.getpid()
        going = _building.get(key)
        if going is not None and going[0] == payload:
            if going[2]:
                raise going[2][0]
            return None
        if time.monotonic() - _first_call.setdefault(key, time.monotonic()) < STAND_IN_S:
            return None
        failed: List[BaseException] = []
        thread = threading.Thread(target=_build_into, args=(payload, failed), name="tokenloom-fastokens-build",
                                  daemon=True)
        _building[key] = (payload, thread, failed)
    process_hooks.at_exit("fastokens-build", _finish_builds)
    thread.start()
    return None


#: The longest an exiting process waits for a background build (a build takes a second or two).
EXIT_WAIT_S = 60.0


def _finish_builds() -> None:
    """At exit, wait for the build threads: a daemon thread still inside fastokens' native code when the
    interpreter finalizes is unwound there, and the process aborts ("FATAL: exception not rethrown")."""
    with _lock:
        threads = [t for _, t, _ in _building.values()] if _pid == os.getpid() else []
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))


def _build_into(payload: str, failed: List[BaseException]) -> None:
    # Not at a lower CPU priority: the build takes the GIL now and then, and a thread that holds it
    # while the scheduler leaves it waiting stalls the thread that encodes (priority inversion).
    try:
        build(payload)
    except BaseException as e:  # noqa: BLE001 - handed to the encoding thread by `ready`
        failed.append(e)


def encode_batch(tok: Any, texts: Sequence[str]) -> List[np.ndarray]:
    """int32 id arrays (read-only views of one buffer), special-token spellings encoded as text."""
    ids, offsets = tok.encode_batch_flat(list(texts), add_special_tokens=False, split_special_tokens=True)
    flat = np.frombuffer(ids, dtype=np.int32)  # ids are < 2**31: the uint32 buffer read as int32, no copy
    ends = np.frombuffer(offsets, dtype=np.uint64).tolist()
    return [flat[a:b] for a, b in zip(ends[:-1], ends[1:])]


def single_thread() -> None:
    """Make fastokens encode a batch on one thread in this process (a loader worker)."""
    for name in THREAD_VARIABLES:
        os.environ[name] = "1"


def verdict(payload: str, reference: Any, sample: Optional[Sequence[str]] = None) -> Tuple[bool, str]:
    """(whether fastokens gives `reference`'s ids for this tokenizer.json text, why). ``reference``
    is the `tokenizers.Tokenizer` the loader would use otherwise (special-token spellings as text).
    fastokens runs in a child process (`sample_ids`): the check leaves no fastokens thread pool in
    the training process for loader workers to be forked from (loader/fork_guard.py)."""
    if version() is None:
        return False, f"fastokens is not installed ({INSTALL_HINT} is faster)"
    texts = list(sample) if sample is not None else sample_texts(reference)
    ours = sample_ids(payload, texts)
    if isinstance(ours, str):
        return False, ours
    differs = first_difference(ours, reference, texts)
    if differs:
        return False, f"fastokens' {differs}"
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return True, f"same ids as tokenizers on a {size / 1024:.0f} KB sample"


_SAMPLE_CHILD = """
import json, sys
job = json.loads(sys.stdin.read())
try:
    import fastokens
    tok = fastokens.Tokenizer.from_json_str(job["payload"])
except Exception as e:
    print(json.dumps({"error": "fastokens cannot load it: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])}))
    sys.exit(0)
try:
    ids, offsets = tok.encode_batch_flat(job["texts"], add_special_tokens=False, split_special_tokens=True)
except Exception as e:
    print(json.dumps({"error": "fastokens failed on the sample: %s: %s" % (type(e).__name__, e)}))
    sys.exit(0)
print(json.dumps({"ids": bytes(ids).hex(), "offsets": bytes(offsets).hex()}))
"""


def sample_ids(payload: str, texts: Sequence[str]) -> Any:
    """fastokens' ids for ``texts`` (int32 arrays, as `encode_batch` gives them), worked out in a
    child interpreter; or why it cannot give them (a str)."""
    import json
    import subprocess
    import sys

    job = json.dumps({"payload": payload, "texts": list(texts)}, ensure_ascii=False)
    try:
        out = subprocess.run([sys.executable, "-c", _SAMPLE_CHILD], input=job, capture_output=True, text=True,
                             encoding="utf-8", errors="surrogatepass", timeout=300)
    except subprocess.TimeoutExpired:
        return "fastokens did not encode the sample within 300 s"
    if out.returncode != 0 or not out.stdout.strip():
        return f"fastokens failed on the sample (exit {out.returncode}): {out.stderr.strip()[-300:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in got:
        return got["error"]
    flat = np.frombuffer(bytes.fromhex(got["ids"]), dtype=np.int32)
    ends = np.frombuffer(bytes.fromhex(got["offsets"]), dtype=np.uint64).tolist()
    return [flat[a:b] for a, b in zip(ends[:-1], ends[1:])]


def sample_texts(reference: Any) -> List[str]:
    """The engines' shared sample, plus the tokenizer's own added tokens spelt in text."""
    from .tiktoken_bpe import sample_texts as shared

    added = [t.content for t in reference.get_added_tokens_decoder().values()]
    return shared() + ([" ".join(added) + "\n" + "".join(added)] if added else [])
