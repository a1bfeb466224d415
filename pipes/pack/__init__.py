"""Packing: documents into rows of ``seq_len + 1`` tokens.

``flat``: end to end, rows may start mid-document. ``bestfit``: best-fit from a buffer
(and its ``crop`` mode), placing segments with ``core``'s index (a C extension,
``_packcore.c``, or its pure-Python twin). ``stats``: the counters every packer keeps.
"""

from .bestfit import BestFitPack
from .flat import FlatPack

__all__ = ["BestFitPack", "FlatPack"]
