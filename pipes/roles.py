"""The roles a node declares as ``ROLE`` (see graph.py for what each offers)."""

SHARD, READER, BRANCH, PIECES, MIX, PACKER, BATCH, PASS, OTHER = (
    "shard", "reader", "branch", "pieces", "mix", "packer", "batch", "pass", "other")
ROLES = (SHARD, READER, BRANCH, PIECES, MIX, PACKER, BATCH, PASS, OTHER)
