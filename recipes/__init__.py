"""Recipes: plain functions that build node graphs and return a loader."""

from .multiplex import multiplex, print_dataloader_stats
from .pretrain import pretrain
from .sft import sft

__all__ = ["multiplex", "pretrain", "print_dataloader_stats", "sft"]
