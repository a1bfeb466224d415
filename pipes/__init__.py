"""Stateful nodes on torchdata.nodes, and the bridge to StatefulDataLoader."""

from .base import Node, StateError
from .batch import Batch, collate_rows
from .items import Doc, Row, TokenDoc
from .sources.jsonl import ReadJsonl, list_jsonl_units
from .loader.bridge import NodeDataset, ShardContext, TokenLoomLoader
from .sources.memory import FromList
from .mix import Mix
from .pack.bestfit import BestFitPack
from .pack.flat import FlatPack
from .pieces import Pieces
from .sources.parquet import ReadParquet, UnitTable, list_parquet_units
from .sources.readers import SourcePlan, plan_source
from .schedule import StepClock
from .shard import EpochPlan, ShardUnits, WorkSlice, plan_epoch, plan_shards
from .sources.files import SourceFile, fingerprint_files, resolve_files
from .stats import WithStats, format_stats
from .sources.line_listing import list_text_units
from .sources.text_files import LineUnitTable, ReadText
from .tokenize import Tokenize
from .tokenizer import Encoder, load_encoder

__all__ = [
    "Batch", "BestFitPack", "Doc", "Encoder", "EpochPlan", "FlatPack", "FromList", "LineUnitTable", "Mix", "Node",
    "NodeDataset", "Pieces", "ReadJsonl", "ReadParquet", "ReadText", "Row", "ShardContext", "ShardUnits", "SourceFile",
    "SourcePlan", "StateError", "StepClock", "TokenDoc", "Tokenize", "TokenLoomLoader", "UnitTable", "WithStats",
    "WorkSlice", "collate_rows", "fingerprint_files", "format_stats", "list_jsonl_units", "list_parquet_units",
    "list_text_units", "load_encoder", "plan_epoch", "plan_shards", "plan_source", "resolve_files",
]
