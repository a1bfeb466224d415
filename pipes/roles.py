"""The roles a node declares as ``ROLE`` (see graph.py for what each offers)."""

SHARD, READER, BRANCH, PIECES, MIX, PACKER, BATCH, OTHER = (
    "shard", "reader", "branch", "pieces", "mix", "packer", "batch", "other")
ROLES = (SHARD, READER, BRANCH, PIECES, MIX, PACKER, BATCH, OTHER)
