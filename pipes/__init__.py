"""Stateful nodes on torchdata.nodes, and the bridge to StatefulDataLoader."""

from .base import Node, StateError
from .batch import Batch, collate_rows
from .items import Doc, Row, TokenDoc
from .loader import NodeDataset, ShardContext, TokenLoomLoader
from .pack_bestfit import BestFitPack
from .pack_flat import FlatPack
from .parquet import ReadParquet, UnitTable, list_parquet_units
from .shard import ShardUnits, WorkSlice, plan_epoch
from .sources import SourceFile, fingerprint_files, resolve_files
from .stats import WithStats
from .tokenize import Tokenize
from .tokenizer import Encoder, load_encoder

__all__ = [
    "Batch", "BestFitPack", "Doc", "Encoder", "FlatPack", "Node", "NodeDataset", "ReadParquet", "Row",
    "ShardContext", "ShardUnits", "SourceFile", "StateError", "TokenDoc", "Tokenize", "TokenLoomLoader",
    "UnitTable", "WithStats", "WorkSlice", "collate_rows", "fingerprint_files", "list_parquet_units",
    "load_encoder", "plan_epoch", "resolve_files",
]
