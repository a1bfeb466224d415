"""Hugging Face Trainer with tokenloom's loader: `TokenLoomTrainer`.

What Trainer does with a training loader, and what this subclass does instead:

- it builds a DataLoader from ``train_dataset`` and passes it through ``accelerator.prepare``:
  here ``get_train_dataloader`` returns tokenloom's loader (``train_loader=``), which already
  shards per rank and batches; its batches become the model's inputs (``input_ids``,
  ``position_ids``, and the labels twice: ``labels``, and ``shift_labels``, because they are
  already shifted and a causal LM would shift ``labels`` once more; Trainer also counts the
  targets of a step from ``shift_labels``);
- on ``train(resume_from_checkpoint=...)`` it skips the batches already trained by reading them
  (``skip_first_batches``), which re-reads the data and lands late or early as soon as anything
  differs: here ``args.ignore_data_skip`` is set, and the loader loads the state it had at the
  checkpoint instead, so the next batch is the uninterrupted run's;
- its checkpoint holds no loader state: here every rank writes ``loader.state_dict()`` into the
  checkpoint folder at each save (``checkpoint-N/tokenloom_loader_rank<r>.json``), when Trainer's
  ``on_save`` callbacks run, right after the step's batches (Trainer reads a step's batches just
  before training on them, so the loader stands exactly at the step).

A resume on another number of ranks or loader workers loads every old rank's file (an elastic
resume); a checkpoint without them is refused, naming the folder. ``model_inputs`` is the
mapping, for a loop of your own.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, Iterator, Optional

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

STATE_FILE = "tokenloom_loader_rank{rank}.json"


def model_inputs(batch: Dict[str, Any]) -> Dict[str, Any]:
    """A tokenloom batch as a Hugging Face causal LM's keyword arguments (labels are already shifted)."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "labels": batch["labels"],
            "shift_labels": batch["labels"]}


class _ModelInputs:
    """The loader's batches as model inputs; iterating it is iterating the loader."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return (model_inputs(batch) for batch in self.loader)


def save_loader_state(loader: Any, folder: str) -> str:
    """Write this rank's ``loader.state_dict()`` into a checkpoint folder; returns the file."""
    path = os.path.join(folder, STATE_FILE.format(rank=int(loader.config.get("rank", 0))))
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(loader.state_dict(), f)
    os.replace(path + ".tmp", path)  # never half a state
    return path


def load_loader_state(loader: Any, folder: str) -> None:
    """Load the loader state saved in a checkpoint folder: this rank's own, or, when the number of
    ranks or workers changed, every old rank's (elastic resume)."""
    files = sorted(glob.glob(os.path.join(folder, STATE_FILE.format(rank="*"))))
    if not files:
        raise ValueError(f"checkpoint {folder!r} holds no tokenloom loader state ({STATE_FILE.format(rank='<r>')}): "
                         "it was saved without TokenLoomTrainer; resume from a checkpoint it saved, or start the "
                         "loader afresh")
    states = []
    for path in files:
        with open(path) as f:
            states.append(json.load(f))
    loader.load_state_dict(states)  # the same topology: each rank its own state, bit for bit


class _SaveLoaderState(TrainerCallback):
    def __init__(self, loader: Any):
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        save_loader_state(self.loader, os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        return control


class TokenLoomTrainer(Trainer):
    """`transformers.Trainer` fed by a tokenloom loader (see the module docstring):
    ``TokenLoomTrainer(model=..., args=TrainingArguments(max_steps=..., save_steps=...),
    train_loader=pretrain(...))``; ``train(resume_from_checkpoint=...)`` resumes exactly."""

    def __init__(self, *args: Any, train_loader: Any, **kwargs: Any):
        if kwargs.get("train_dataset") is not None:
            raise ValueError("TokenLoomTrainer reads batches from train_loader=; pass no train_dataset")
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self.args.ignore_data_skip = True  # the loader resumes from its own state; skipping would drop batches
        self._resume_folder: Optional[str] = None
        self.add_callback(_SaveLoaderState(train_loader))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        folder = resume_from_checkpoint
        if isinstance(folder, bool):
            folder = get_last_checkpoint(self.args.output_dir) if folder else None
        self._resume_folder = folder
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with the loader's figures (``data/wait_ms``, ``data/share/<name>``, ...:
        `TokenLoomLoader.figures`) beside the training loss, for every reporter and the log history."""
        figures = getattr(self.train_loader, "figures", None)
        if figures is not None and "loss" in logs:
            logs = {**logs, **figures()}
        super().log(logs, *args, **kwargs)

    def get_train_dataloader(self) -> Any:
        if self._resume_folder is not None:
            load_loader_state(self.train_loader, self._resume_folder)
            self._resume_folder = None
        return _ModelInputs(self.train_loader)
