"""Keep a loader worker's memory flat over a long run: glibc malloc settings and Arrow's pool, once per worker.

A worker allocates blocks of every size from several threads: row groups of
text (up to megabytes), token arrays of long documents, batch arrays, and the
Rust tokenizer's buffers on its own thread pool. glibc's malloc keeps freed
memory of such a mix: its mmap threshold rises to the largest block freed so
far (up to glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``), after which big blocks come
from the heap and stay there, and each thread may get its own arena that
fragments on its own. With the defaults a worker's peak RSS keeps rising over a
long run; with the settings below it is flat after warm-up (measured on the stdlib
corpus; see docs/performance.md). Tokenizing alone in a loop shows the same growth,
and ``tracemalloc`` sees only a small, steady amount of Python allocations, so it
is not a leak in tokenloom's own objects.

The settings: a fixed mmap threshold of ``MMAP_THRESHOLD_BYTES`` (128 * 1024 bytes,
glibc's default, minus the dynamic rise), so blocks that big are returned to the
system when freed, and
one arena. Cost: an mmap/munmap pair per big block (a few per batch, noise next
to tokenizing). They apply only inside loader worker processes, which
tokenloom owns; the training process (and ``num_workers=0``) keeps its own.
Without glibc (macOS, musl) nothing is changed.

Arrow's buffers (decoded row groups and their windows, the compressed column chunks read for
them) come from pyarrow's own memory pool, mimalloc by default, which keeps much more freed memory
in a worker than it holds when many sources each reopen row groups (megabytes allocated and freed
at every window); measured in docs/performance.md, "Arrow's memory pool in the workers". So
`settle_worker_arrow_pool` makes `ARROW_POOL` the default pool in a worker, unless the user chose
one (``ARROW_DEFAULT_MEMORY_POOL``) or this pyarrow lacks it. Buffers keep the pool they came from,
so those allocated before the switch are freed where they belong.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

# mallopt parameters from glibc's <malloc.h>.
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024
#: Arrow's memory pool in a loader worker (pyarrow's ``<name>_memory_pool``), see the module docstring.
ARROW_POOL = "jemalloc"


def _glibc() -> Optional[ctypes.CDLL]:
    # The process's own symbols (dlopen(NULL)) hold the C library it runs on; not
    # ctypes.util.find_library("c"), which runs ldconfig in a subprocess: 2-10 ms of every
    # freshly forked worker's start.
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return None
    return libc


def settle_worker_malloc() -> bool:
    """Apply the settings above in this process; True if they were applied."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and libc.mallopt(_M_ARENA_MAX, 1) == 1
    if not ok:
        log.warning("mallopt refused the worker memory settings; worker memory may grow over long runs")
    return ok


def settle_worker_arrow_pool() -> str:
    """Make `ARROW_POOL` pyarrow's default memory pool in this process (module docstring); returns
    the backend now in use."""
    import pyarrow as pa  # imported with the package already (pipes/sources)

    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pa.default_memory_pool().backend_name  # the user's choice
    try:
        pool = getattr(pa, f"{ARROW_POOL}_memory_pool")()
    except (AttributeError, NotImplementedError):  # this pyarrow was built without it
        return pa.default_memory_pool().backend_name
    pa.set_memory_pool(pool)
    return pool.backend_name
