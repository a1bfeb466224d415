"""`Tokenize` hands out each document as [BOS] ids [EOS], every choice of BOS/EOS, text and
pre-tokenized ids mixed, empty documents included; the documents of one encode batch are
slices of one buffer and never overlap."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.pipes import Tokenize, load_encoder
from tokenloom.pipes.items import Doc
from tokenloom.pipes.sources.memory import FromList
from tokenloom.pipes.tokenize import Pretokenized

from .conftest import synthetic_texts


@pytest.mark.parametrize("bos,eos", [(0, None), (None, None), (0, 1), (None, 1)])
def test_each_document_is_its_ids_with_bos_and_eos(tok_path, bos, eos):
    enc = load_encoder(tok_path)
    texts = synthetic_texts(60, seed=4) + ["", "x"]
    ids = enc.encode_batch(texts)
    docs = [Doc(Pretokenized(ids[i].astype(np.uint16), len(t)) if i % 3 == 0 else t, "s", 0, i)
            for i, t in enumerate(texts)]
    node = Tokenize(FromList(docs), enc, bos=bos, eos=eos, batch_docs=7)
    node.reset(None)
    got = [node.next() for _ in docs]
    for g, want in zip(got, ids):
        expect = ([] if bos is None else [bos]) + want.tolist() + ([] if eos is None else [eos])
        assert g.ids.dtype == np.int32 and g.ids.tolist() == expect
    got[0].ids[:] = -7  # a document's slice is its own
    assert all((g.ids != -7).all() for g in got[1:] if len(g.ids))
