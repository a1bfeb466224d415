"""Hugging Face Accelerate's protocol for a DataLoader that is already prepared.

Accelerate 1.x reads ``_is_accelerate_prepared`` on a DataLoader (``Accelerator.prepare_data_loader``):
True keeps the loader as it is instead of wrapping it in a dispatcher or a second sharding. The
loader answers through `AcceleratePrepared` and takes the accelerator's device from Accelerate's
public ``PartialState`` (tokenloom/integrations/accelerate.py tells users what this gives them).
Without Accelerate installed the question is never asked; asked by something else, the device
stays unset.
"""

from __future__ import annotations

from typing import Any, Optional


def accelerator_device() -> Optional[Any]:
    """The device of this process's Accelerate state; None on the CPU or without Accelerate."""
    try:
        from accelerate.state import PartialState
    except ImportError:
        return None
    device = getattr(PartialState(), "device", None)
    return None if device is None or device.type == "cpu" else device


class AcceleratePrepared:
    """Mixin for a loader: answers Accelerate's "already prepared?" with yes, and records the
    device batches go to (``batch_device``) when it is asked."""

    batch_device: Optional[Any] = None
    pin_memory: bool  # the DataLoader's

    def place_on_device(self, batch: Any) -> Any:
        """The batch's tensors on `batch_device` (Accelerate's), else the batch as it is."""
        if self.batch_device is None or not isinstance(batch, dict):
            return batch
        import torch

        return {k: v.to(self.batch_device, non_blocking=self.pin_memory) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    @property
    def _is_accelerate_prepared(self) -> bool:
        self.batch_device = accelerator_device()
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        pass  # Accelerate marks what it prepared; this loader always counts as prepared
