"""Recipes: plain functions that build node graphs and return a loader."""

from tokenloom.pipes.chat import ChatTemplate
from tokenloom.pipes.chat_template import JinjaTemplate
from tokenloom.pipes.sources.retry import RetryPolicy

from .multiplex import multiplex, print_dataloader_stats
from .pretrain import pretrain
from .sft import sft

__all__ = ["ChatTemplate", "JinjaTemplate", "RetryPolicy", "multiplex", "pretrain", "print_dataloader_stats", "sft"]
