"""Hugging Face Accelerate: ``accelerator.prepare(loader)`` keeps tokenloom's loader as it is.

Accelerate's ``prepare`` re-creates a DataLoader around ``loader.dataset``: with one process and
a device it dispatches batches from rank 0 (``DataLoaderDispatcher``), with several it shards the
stream a second time (``IterableDatasetShard``). Both are wrong for a loader that shards per rank
(and per worker) itself and whose state is a position: a dispatcher reads every rank's batches on
rank 0, a second sharding throws away all but 1/N of each rank's batches, and neither saves the
loader's state. So `TokenLoomLoader` answers Accelerate's "already prepared?" question with yes
(before it would wrap anything) and says it is stateful:

- ``prepare(loader)`` returns the loader itself, registered with the accelerator, whatever
  ``DataLoaderConfiguration`` says: ``dispatch_batches``, ``split_batches`` (the loader's
  ``batch_size`` is per rank) and ``even_batches`` (ranks already end a finite epoch together)
  do not apply to it;
- ``save_state(dir)`` writes ``loader.state_dict()`` (``dir/dl_state_dict.bin``) and
  ``load_state(dir)`` loads it back: the next batch is the one an uninterrupted run would give,
  with or without ``use_stateful_dataloader``. Do not call ``skip_first_batches`` on it: it
  would re-create a loader from the start of the round and skip by reading;
- batches go to the accelerator's device as Accelerate's own loaders put them (nothing moves
  on the CPU); `on_prepare` records the device.

Relies on two names Accelerate 1.x reads on a DataLoader (``_is_accelerate_prepared`` and
``use_stateful_dataloader``, see ``Accelerator.prepare_data_loader`` and
``save_accelerator_state``); without them ``prepare`` fails at the first batch.
"""

from __future__ import annotations

from typing import Any

from tokenloom.pipes.compat.accelerate import accelerator_device


def on_prepare(loader: Any) -> None:
    """Record the device batches go to: that of this process's Accelerate state (CPU: left where
    they are). The loader does this itself when Accelerate asks it (pipes/compat/accelerate.py)."""
    loader.batch_device = accelerator_device()
