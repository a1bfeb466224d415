"""Recipes: plain functions that build node graphs and return a loader."""

from .pretrain import pretrain

__all__ = ["pretrain"]
