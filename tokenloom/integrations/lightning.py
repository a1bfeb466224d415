"""PyTorch Lightning with tokenloom's loader: `TokenLoomDataModule`.

``trainer.fit(model, datamodule=TokenLoomDataModule(loader))``: the loader's state goes into
Lightning's own checkpoint (the datamodule's entry) and comes back with ``fit(ckpt_path=...)``.

Or return the loader from your module's ``train_dataloader()``, as Lightning documents for
stateful loaders: exact too. Lightning's training loop fetches one batch ahead (to know whether
the current one is the last), so when ``ModelCheckpoint`` saves after step k the loader has
already handed out batch k+1; the loader sees that fetcher when it is iterated and answers
``state_dict()`` with its state after batch k (pipes/loader/fetch_ahead.py), so the resume does
not skip batch k+1.

The datamodule does the same by Lightning's public hooks, with no look at Lightning's
internals: it keeps the loader's state after every batch it hands out and saves the one of the
batch the training step last consumed (counted in ``on_before_batch_transfer``, which Lightning
calls for the batch it is about to train on, not for the one fetched ahead). Cost: one
``state_dict()`` per batch (a few KB of JSON). Lightning does not wrap it either: the
datamodule hands Lightning an iterable, not a DataLoader, so ``use_distributed_sampler`` does
not re-create anything (tokenloom shards per rank itself). Fabric has no fetch-ahead: save
``loader.state_dict()`` in Fabric's state dict as in a loop of your own.

Projects on the ``pytorch_lightning`` package import the same class from
`tokenloom.integrations.pytorch_lightning`.
"""

from __future__ import annotations

import lightning.pytorch as pl

from .datamodule import DataModuleMixin


class TokenLoomDataModule(DataModuleMixin, pl.LightningDataModule):
    """Feeds ``loader`` to ``trainer.fit`` (``lightning.pytorch``) and saves its state at the batch last
    trained on; `tokenloom.integrations.pytorch_lightning` has the same for the ``pytorch_lightning``
    package."""
