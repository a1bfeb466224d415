"""tokenloom: packed, mixed, exactly resumable token batches for LLM training.

Import the recipes from `tokenloom.recipes` and the nodes from `tokenloom.pipes`.
"""

__version__ = "0.1.0"
