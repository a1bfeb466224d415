"""`TokenLoomDataModule` for projects on the ``pytorch_lightning`` package: the same as
`tokenloom.integrations.lightning` (which is for ``lightning.pytorch``), built on this package's
``LightningDataModule``, which ``pytorch_lightning.Trainer`` requires.
"""

from __future__ import annotations

import pytorch_lightning as pl

from .datamodule import DataModuleMixin


class TokenLoomDataModule(DataModuleMixin, pl.LightningDataModule):
    """Feeds ``loader`` to ``pytorch_lightning.Trainer.fit`` and saves its state at the batch last trained on."""
