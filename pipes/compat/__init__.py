"""Every use of another package's private internals, in one place, each with a check and a fallback.

tokenloom builds on public APIs; where a public one costs too much or does not exist, it reaches
into a package's internals here and nowhere else (tests/test_compat.py checks the rest of the
library names none of them). Each module checks, on first use, that the internals are as it
expects, and otherwise takes a public path that is slower or does less, never wrong; a test forces
each fallback.

- `torchdata` (torchdata 0.11, pinned ``<0.12``): ``StatefulDataLoader._get_iterator`` and
  ``_iterator`` (the hook where workers are forked, and forgetting stopped workers),
  ``_StatefulMultiProcessingDataLoaderIter._update_snapshot``, ``_get_main_state`` and
  ``_shutdown_workers``, and ``incremental_state``'s ``_IncrementalWorkerState`` (worker snapshots
  kept flat, the main state without a protocol check per step). Fallback: batches through the pipe
  instead of shared memory, torchdata's own snapshots and main state, workers left to the garbage
  collector.
- `mp_queue` (CPython 3.9-3.13 ``multiprocessing.queues.Queue``: ``_wlock``, ``_writer``,
  ``_send_bytes``, ``_sem``, ``_closed``, ``_reset``, ``_rlock``, ``_reader``, ``_poll``,
  ``_recv_bytes``): a loader queue that writes small messages without its feeder thread and reads
  a waiting message without polling. Fallback: a plain ``multiprocessing.Queue``.
- `tiktoken` (``Encoding._core_bpe``): ids written into one buffer. Fallback: ``encode_ordinary``.
- `accelerate`: the name Accelerate reads on a prepared DataLoader (``_is_accelerate_prepared``).
"""
