"""A stalled worker is never silent: no batch for ``stall_timeout`` seconds raises an error that names
the workers, the node and the call each is in, with their stacks.

A loader worker can stop making progress for good: a native library's thread pool inherited by a
fork and waited on in the child, a lock held at the instant of the fork, a read that never returns.
torch's DataLoader then waits in ``next()`` for ever (its ``timeout`` is 0 by default), and a
distributed job dies minutes later of a collective's timeout on another rank, with nothing that
points at the data.

`StallWatch` bounds that wait. The loader passes ``timeout=stall_timeout`` to the DataLoader (where
the user set no ``timeout`` of their own), so torch raises once no batch has come for that long. Each
worker, when it starts, registers a `faulthandler` dump of all its threads' Python stacks on
``SIGUSR2`` into a file of the watch's folder and writes its pid beside it. When the wait runs out,
the training process signals every worker, reads the dumps, and raises one `RuntimeError` that says,
per worker, the innermost tokenloom node's ``next`` (the node) and the innermost frame (the call it
is stuck in), followed by the stacks and what to do.

The bound is the time between two batches reaching the training loop, not the time of a read: a
slow object store delivers a batch in seconds and never comes near it; a store that takes minutes
per batch needs a larger bound (``stall_timeout=None`` turns the watch off). With ``num_workers=0``
the training process makes the batches itself and nothing is watched.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import tempfile
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

#: The bound, in seconds, a recipe's loader uses unless told otherwise.
DEFAULT_STALL_TIMEOUT = 300.0
#: What torch's DataLoader raises when its ``timeout`` runs out.
TORCH_TIMEOUT = "DataLoader timed out after"
SIGNAL = getattr(signal, "SIGUSR2", None)
#: How long the training process waits for the workers' dumps.
DUMP_WAIT_S = 3.0

_opened: List[Any] = []  # in a worker: the dump file faulthandler writes to, kept open


def check_stall_timeout(value: Optional[float]) -> Optional[float]:
    """``value`` as the watch's bound: None (off) or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"stall_timeout={value!r} must be a positive number of seconds, or None to wait for "
                         "ever on a worker that stops delivering")
    return float(value)


class StallWatch:
    """The folder a loader's workers dump their stacks into, and the report made from the dumps.

    Made in the training process (one per loader; the folder is removed with the watch), pickled
    with the dataset to the workers, where `arm` runs first thing.
    """

    def __init__(self, bound: float):
        self.bound = bound
        self.folder = tempfile.mkdtemp(prefix="tokenloom-stall-")
        self._owner = os.getpid()
        weakref.finalize(self, shutil.rmtree, self.folder, True)

    def __getstate__(self) -> Dict[str, Any]:
        return {"bound": self.bound, "folder": self.folder, "_owner": self._owner}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)  # a worker's copy: the training process removes the folder

    def _path(self, worker: int, kind: str) -> str:
        return os.path.join(self.folder, f"worker-{worker}.{kind}")

    def arm(self, worker: int) -> None:
        """In a worker: dump every thread's stack into this worker's file on `SIGNAL`."""
        if SIGNAL is None or not os.path.isdir(self.folder):
            return
        dump = open(self._path(worker, "stack"), "w")  # noqa: SIM115 - faulthandler writes to it for the worker's life
        _opened.append(dump)
        faulthandler.register(SIGNAL, file=dump, all_threads=True, chain=False)
        part = self._path(worker, "pid") + f".{os.getpid()}"
        with open(part, "w") as f:
            f.write(str(os.getpid()))
        os.replace(part, self._path(worker, "pid"))  # written after the handler: a listed pid can be signalled

    def report(self, num_workers: int, waited: Any) -> str:
        """In the training process, once no batch came for ``waited`` seconds: signal the workers,
        read their dumps, and say where each is."""
        pids: Dict[int, int] = {}
        for worker in range(num_workers):
            try:
                with open(self._path(worker, "pid")) as f:
                    pids[worker] = int(f.read().strip())
                with open(self._path(worker, "stack"), "w"):
                    pass  # only this dump
            except (OSError, ValueError):
                continue
        for worker, pid in list(pids.items()):
            try:
                os.kill(pid, SIGNAL)
            except (OSError, TypeError):
                pids.pop(worker)
        stacks = self._read_dumps(pids)
        lines = [f"no batch came from the loader's {num_workers} worker(s) for {waited} s (stall_timeout): "
                 "a worker stopped making progress."]
        for worker in range(num_workers):
            if worker not in pids:
                lines.append(f"- worker {worker}: not running or not reachable (no pid recorded)")
                continue
            node, call = where(stacks.get(worker, ""))
            lines.append(f"- worker {worker} (pid {pids[worker]}): in node {node}, stuck in {call}")
        lines.append("What to do: a worker waiting in a native library (a tokenizer engine, pyarrow, a "
                     "filesystem client) after the training process used that library's threads before the "
                     "fork can be started clean with multiprocessing_context='forkserver'; a read that hangs "
                     "points at the store or its credentials; a slow store that needs minutes per batch needs "
                     "a larger stall_timeout= (None: no bound). The workers' stacks, most recent call first:")
        for worker in sorted(stacks):
            lines.append(f"--- worker {worker} (pid {pids[worker]}) ---\n{stacks[worker].rstrip()}")
        return "\n".join(lines)

    def _read_dumps(self, pids: Dict[int, int]) -> Dict[int, str]:
        """Each signalled worker's dump, once its file has text (faulthandler writes it in one go from
        the signal handler; a worker that cannot run its handler leaves it empty)."""
        deadline = time.monotonic() + DUMP_WAIT_S
        started: Dict[int, float] = {}
        while time.monotonic() < deadline and len(started) < len(pids):
            for worker in pids:
                try:
                    dumped = os.path.getsize(self._path(worker, "stack")) > 0
                except OSError:  # the folder removed meanwhile: reported as no stack dumped
                    dumped = False
                if worker not in started and dumped:
                    started[worker] = time.monotonic()
            time.sleep(0.05)
        time.sleep(0.1)  # a dump that has begun is whole a moment later
        stacks: Dict[int, str] = {}
        for worker in started:
            try:
                with open(self._path(worker, "stack")) as f:
                    stacks[worker] = f.read()
            except OSError:
                continue
        return stacks


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where(dump: str) -> Tuple[str, str]:
    """(the node, the call) a worker's dump shows for its main thread: the innermost ``next`` of a
    tokenloom node or a node of the user's (a frame of ``next`` outside the interpreter's libraries),
    and the innermost frame. faulthandler lists the innermost frame first."""
    if not dump.strip():
        return "unknown (no stack dumped)", "unknown"
    block = _main_thread(dump)
    frames = [m.groupdict() for m in _FRAME.finditer(block)]
    if not frames:
        return "unknown", "unknown"
    inner = frames[0]
    call = f"{inner['func']} ({_short(inner['file'])}, line {inner['line']})"
    for frame in frames:
        if frame["func"] == "next" and "/torch/" not in frame["file"] and "/torchdata/" not in frame["file"]:
            return f"{_short(frame['file'])}, line {frame['line']}", call
    if any(frame["func"] == "_worker_loop" for frame in frames):
        return "none: idle, waiting for the training process to ask for a batch", call
    return "unknown (no node's next() on the stack)", call


def _main_thread(dump: str) -> str:
    """The block of the thread that runs the graph: faulthandler marks the thread it was signalled
    on (the main thread) as "Current thread"."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    for block in blocks:
        if block.lstrip().startswith("Current thread"):
            return block
    return blocks[0]


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("pipes", "recipes", "tokenloom", "site-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + (1 if anchor == "site-packages" else 0):])
    return "/".join(parts[-2:])
