"""A training loop that fetches batches ahead of the step: the state it saves is the step's.

PyTorch Lightning's training loop (``lightning.pytorch`` and the ``pytorch_lightning``
package alike) iterates a train loader through a fetcher that holds batches fetched ahead
of the one being trained on (one by default, to know whether the current batch is the
last). When ``ModelCheckpoint`` saves after step k, the loader has already handed out
batch k + 1, and ``loader.state_dict()`` taken then would resume at batch k + 2: one batch
never trained, silently.

`FetchAhead` puts that right for a loader passed as ``train_dataloader``. ``iter(loader)``
looks up the call stack for such a fetcher (the caller that asked for the iterator); when
it finds one, the loader keeps its state after each of the last few batches it handed out,
and ``state_dict()`` answers with the state after the batch the step is on: as many
batches back as the fetcher holds unconsumed (its ``batches`` list, read when the state is
asked for). With no such fetcher, nothing is kept and nothing changes.

Lightning's fetcher class is private to Lightning (``loops.fetchers._PrefetchDataFetcher``),
so it is read here only: from the modules already imported (tokenloom imports no
trainer), by the public attribute names it has had since Lightning 2.0 (``batches``,
``prefetch_batches``). Should a Lightning release rename them, `find` finds nothing and the
loader saves its own position, as before (`tests/test_fetch_ahead.py` forces that path);
`tokenloom.integrations.lightning.TokenLoomDataModule` keeps the step's state by Lightning's
public hooks instead.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections import deque
from typing import Callable, Deque, Optional, Tuple

#: Modules that hold Lightning's fetch-ahead fetcher, and its name there.
FETCHER_MODULES = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")
FETCHER_CLASS = "_PrefetchDataFetcher"
#: Frames looked at above ``iter(loader)`` (Lightning's fetcher is 5-8 up).
DEPTH = 24


def fetcher_classes() -> Tuple[type, ...]:
    """The fetch-ahead fetcher classes of the Lightning packages already imported."""
    found = []
    for name in FETCHER_MODULES:
        cls = getattr(sys.modules.get(name), FETCHER_CLASS, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def fetcher_codes(classes: Tuple[type, ...]) -> frozenset:
    """The code objects of the methods the fetcher classes (and their bases in Lightning's module) define."""
    codes = set()
    for cls in classes:
        for base in cls.__mro__:
            if base.__module__ != cls.__module__:
                continue
            for value in vars(base).values():
                code = getattr(value, "__code__", None)
                if code is not None:
                    codes.add(code)
    return frozenset(codes)


class FetchAhead:
    """The states after the last batches a loader handed to a fetcher that holds some unconsumed.

    ``keep(state)`` after every batch handed out (and once before the first); ``state(now)``
    gives the state after the batch being trained on, ``now()`` when the fetcher holds none."""

    def __init__(self, fetcher: object):
        self._fetcher = weakref.ref(fetcher)
        held = int(getattr(fetcher, "prefetch_batches", 1))
        self.states: Deque[dict] = deque(maxlen=max(held, 1) + 1)

    @classmethod
    def find(cls, depth: int = DEPTH) -> Optional["FetchAhead"]:
        """A `FetchAhead` for the fetcher among the callers (within ``depth`` frames), or None.

        Frames are matched by their code (the fetcher classes' own methods); only a matching frame's
        locals are read. Reading a frame's locals snapshots them into the frame (CPython < 3.13), and
        the snapshot keeps what they held alive while the frame lives, after the function dropped it:
        a loop's frame would keep a dropped loader, and its workers, alive."""
        classes = fetcher_classes()
        if not classes:
            return None
        codes = fetcher_codes(classes)
        frame = inspect.currentframe()
        try:
            for _ in range(depth):
                if frame is None:
                    return None
                if frame.f_code in codes:
                    owner = frame.f_locals.get("self")
                    if isinstance(owner, classes) and isinstance(getattr(owner, "batches", None), list):
                        return cls(owner)
                frame = frame.f_back
            return None
        finally:
            del frame

    def held(self) -> int:
        """Batches the fetcher holds that were not trained on yet (0 once it is gone)."""
        fetcher = self._fetcher()
        return 0 if fetcher is None else len(getattr(fetcher, "batches", ()))

    def keep(self, state: dict) -> None:
        self.states.append(state)

    def state(self, now: Callable[[], dict]) -> dict:
        back = self.held()
        if back == 0 or not self.states:
            return now()
        return self.states[max(len(self.states) - 1 - back, 0)]
