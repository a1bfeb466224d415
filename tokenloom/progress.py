"""A one-line progress bar on stderr for the ``tokenloom`` commands.

On a terminal the line is redrawn in place, at most once every ``REDRAW_S`` (10 times
a second; a redraw is cheap either way, but a log file filled with thousands of carriage
returns is not). When stderr is not a terminal (CI, ``2> log``) it writes a plain line
at every tenth of the total (every decile) instead, so logs stay readable.

A finite stream of unknown length (``tokenloom run --epochs 1``) can still have a
bar: ``left`` returns the loader's estimate of the batches left
(``loader.stats()["progress"]["batches_left"]``), asked at most once a redraw (live)
or once a batch (plain lines), and the total shows as ``~N``.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

WIDTH = 30
REDRAW_S = 0.1
CLEAR = "\x1b[K"  # erase what a longer previous line left


class Progress:
    """``update(done, tokens)`` after every batch; ``close()`` (or leaving the ``with``
    block) ends the line.

    ``total=None`` (a finite stream of unknown length) shows counts without a bar, or a bar
    to the estimated total ``done + left()`` while ``left`` returns a number.
    """

    def __init__(self, label: str, total: Optional[int], *, stream: Optional[TextIO] = None,
                 enabled: bool = True, left: Optional[Callable[[], Optional[int]]] = None):
        self.label, self.total, self.enabled, self.left = label, total, enabled, left
        self.stream = stream if stream is not None else sys.stderr
        self.live = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._done = 0
        self._tokens = 0
        self._closed = False
        self._first: Optional[float] = None  # seconds to the first batch

    def _total(self) -> tuple:
        """(total, shown as): the given total, else the estimate ``~N``, else (None, "")."""
        if self.total is not None or self.left is None:
            return self.total, f"{self.total}"
        left = self.left()
        return (None, "") if left is None else (self._done + left, f"~{self._done + left}")

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self._tokens / elapsed if elapsed > 0 else 0.0
        text = f"{self.label} {self._done}"
        total, shown = self._total()
        if total:
            filled = int(WIDTH * min(self._done, total) / total)
            # From the second batch on: the first one carries worker start-up and would inflate the estimate.
            if self._done >= 2 and self._first is not None:
                eta = f"{(total - self._done) * (elapsed - self._first) / (self._done - 1):4.0f}s"
            else:
                eta = "   ?"
            text = (f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self._done}/{shown} batches "
                    f"{rate / 1e3:7.1f}k tok/s  {elapsed:5.1f}s  eta {eta}")
        else:
            text += f" batches {rate / 1e3:7.1f}k tok/s  {elapsed:5.1f}s"
        return text

    def update(self, done: int, tokens: int) -> None:
        self._done, self._tokens = done, tokens
        if self._first is None:
            self._first = time.perf_counter() - self.t0
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.live:
            if now - self._last_draw >= REDRAW_S:
                self.stream.write("\r" + self._line() + CLEAR)
                self.stream.flush()
                self._last_draw = now
            return
        total = self._total()[0]
        decile = 10 * done // total if total else None
        if decile is not None and decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        # Also on an error: end the bar's line so the error message starts on its own.
        self.close()

    def close(self) -> None:
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.live:
            self.stream.write("\r" + self._line() + CLEAR + "\n")
        elif not (total := self._total()[0]) or 10 * self._done // total > self._last_decile:
            self.stream.write(self._line() + "\n")
        self.stream.flush()
