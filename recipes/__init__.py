"""Recipes: plain functions that build node graphs and return a loader."""

from .pretrain import pretrain
from .sft import sft

__all__ = ["pretrain", "sft"]
