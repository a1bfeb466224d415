"""Retrying a remote call: what is transient, how long to wait, when to give up.

A remote store answers some requests with an error that a later attempt does not get: 429 (too many
requests; its ``Retry-After`` says how long to wait), 500, 502, 503 and 504, a connection reset or
dropped mid-answer, a timeout. `RetryPolicy.call` runs a call until it succeeds, retrying those with
exponential backoff and full jitter (so that the ranks and workers a 429 hit at once do not come back
at once), bounded in attempts and in total time; then it raises `RemoteError` naming the URI, what was
read (a listing, a footer, a range), the attempts and the last error. Anything else (404, 403, a bad
request) is raised at once: waiting does not fix it.

A retried read is whole or nothing: a range read returns exactly the bytes asked for, or raises
(http_store.py checks the length of every answer), so a retry never hands out part of a unit twice
and never skips one.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

#: HTTP statuses worth another attempt.
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class TransientError(OSError):
    """A failure another attempt may not get: ``status`` (0: no answer), ``retry_after`` (seconds the
    store asked to wait, or None)."""

    def __init__(self, message: str, status: int = 0, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class RemoteError(OSError):
    """A remote call that failed for good: transient failures past the policy's bounds."""


def retry_after_seconds(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """A ``Retry-After`` header as seconds to wait: a number of seconds, or an HTTP date (None: absent
    or unreadable)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


@dataclass(frozen=True)
class RetryPolicy:
    """How remote calls are retried (module docstring). The defaults ride out a store's brief
    overload (a few answers of 429 or 503, a dropped connection) and give up within about a minute.

    Args:
        attempts: attempts per call, the first included (>= 1).
        max_time_s: give up once this many seconds have passed since the first attempt, counting the
            wait before the next one (> 0).
        backoff_s: the first wait; each next one doubles, up to ``max_backoff_s``; every wait is drawn
            uniformly below its bound (full jitter). A 429's or 503's ``Retry-After`` is waited instead
            when it says longer, within ``max_time_s``.
        max_backoff_s: the longest wait between two attempts.
        timeout_s: seconds a connection may stay silent (connecting or reading) before the attempt
            counts as failed.
    """

    attempts: int = 8
    max_time_s: float = 60.0
    backoff_s: float = 0.25
    max_backoff_s: float = 10.0
    timeout_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy(attempts={self.attempts!r}): give a whole number >= 1")
        for name in ("max_time_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RetryPolicy({name}={getattr(self, name)!r}): give a number of seconds > 0")
        for name in ("backoff_s", "max_backoff_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RetryPolicy({name}={getattr(self, name)!r}): give a number of seconds >= 0")

    def wait(self, attempt: int, retry_after: Optional[float], rng: random.Random) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based)."""
        bound = min(self.max_backoff_s, self.backoff_s * (2 ** (attempt - 1)))
        drawn = rng.uniform(0, bound)
        return max(drawn, retry_after) if retry_after is not None else drawn

    def call(self, fn: Callable[[], T], what: str, *, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
        """``fn()``, retried on `TransientError` (and on what a dropped connection raises:
        ConnectionError, TimeoutError) within the bounds; ``what`` names the URI and what is read
        for the final error."""
        start, rng = clock(), random.Random()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except (TransientError, ConnectionError, TimeoutError) as e:
                last = e
            retry_after = getattr(last, "retry_after", None)
            pause = self.wait(attempt, retry_after, rng)
            spent = clock() - start
            if attempt >= self.attempts or spent + pause > self.max_time_s:
                why = (f"{self.attempts} attempts" if attempt >= self.attempts
                       else f"the next wait ({pause:.1f} s) would pass max_time_s={self.max_time_s:g}")
                raise RemoteError(f"{what}: failed {attempt} times in {spent:.1f} s, giving up after {why}; last "
                                  f"error: {type(last).__name__}: {last}. The store is overloaded or unreachable: "
                                  "check the URL and the network, or try again later") from last
            sleep(pause)
