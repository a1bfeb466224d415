"""The bridge to torchdata's StatefulDataLoader and what a run needs around it.

``bridge``: `TokenLoomLoader` (graphs per worker, the validated state); ``elastic``: a
resume on another topology; ``checkpoint``: the state in torch.distributed.checkpoint;
``rank_sync``: ranks agreeing on a finite epoch's end; ``wire``: batches across the
process boundary; ``prefetch``: a device prefetcher; ``worker_*``: worker setup (memory,
tokenizer threads, exit with the parent); ``wakeup``: the prefetch thread's scheduling.
"""

from .bridge import KEY_PREFIX, NodeDataset, ShardContext, TokenLoomLoader, decode_state, encode_state

__all__ = ["KEY_PREFIX", "NodeDataset", "ShardContext", "TokenLoomLoader", "decode_state", "encode_state"]
