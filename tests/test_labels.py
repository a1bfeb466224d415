"""Labels: already shifted, and one rule at document ends in every packing mode.

``labels[:, t]`` is the target of ``input_ids[:, t]``. A Hugging Face causal LM
shifts ``labels=`` once more, so the README's loop must not pass them there:
a tiny randomly initialised Llama on a real batch shows the trap and checks the
README's two ways out. The document-end rule (``predict_bos``) is checked on
random document streams through every packer, and on real batches.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tokenloom.pipes import BestFitPack, FlatPack, TokenDoc, collate_rows
from tokenloom.pipes.sources.memory import FromList
from tokenloom.recipes import pretrain, sft

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
BOS = 3  # not a token of the random documents below, so a BOS label can only come from the rule
IGNORE = -100


# --- the rule on random document streams, every packer ----------------------------------------

def make_docs(lengths, masked):
    """Every token a unique integer (from 1000), so a segment names its document and offset."""
    docs, start = [], 1000
    for n in lengths:
        ids = np.arange(start, start + n, dtype=np.int32)
        docs.append(TokenDoc(ids, "src", (ids % 3 != 0) if masked else None))
        start += n
    return docs


def packer_for(mode, docs, seq_len, buffer_size, min_fill=1):
    if mode == "flat":
        return FlatPack(FromList(docs), seq_len=seq_len, pad_id=-1)
    return BestFitPack(FromList(docs), seq_len=seq_len, buffer_size=buffer_size, pad_id=-1,
                       mode="crop" if mode == "crop" else "bestfit", min_fill=min_fill, max_wait=2 * buffer_size)


def doc_ends(rows, docs):
    """Per row: [(input position of a whole document's last token, what follows it)], found from
    the token values alone (not from the packer): follows is "doc", "chunk" (a document's
    later piece) or "padding"."""
    where = {t: (d, o) for d, doc in enumerate(docs) for o, t in enumerate(doc.ids.tolist())}
    out = []
    for row in rows:
        C = len(row.tokens)
        ends, pos = [], 0
        filled = int(row.seg_lens.sum())
        for n in row.seg_lens.tolist():
            d, o = where[int(row.tokens[pos])]
            last = pos + n - 1
            if o + n == len(docs[d].ids) and last < C - 1:  # whole document's end, and an input
                if last + 1 >= filled:
                    follows = "padding"
                else:
                    follows = "doc" if where[int(row.tokens[last + 1])][1] == 0 else "chunk"
                ends.append((last, follows))
            pos += n
        out.append(ends)
    return out


def check_rule(rows, docs, batch_size, seq_len, end_label):
    """Labels equal the raw next-token labels everywhere except after whole documents' ends,
    where they equal ``end_label``. Returns how many ends of each kind were checked."""
    seen = {"doc": 0, "chunk": 0, "padding": 0}
    ends = doc_ends(rows, docs)
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        raw = collate_rows(chunk, batch_size=batch_size, seq_len=seq_len, pad_id=-1)["labels"].numpy()
        got = collate_rows(chunk, batch_size=batch_size, seq_len=seq_len, pad_id=-1,
                           end_label=end_label)["labels"].numpy()
        for r in range(len(chunk)):
            at = np.zeros(seq_len, bool)
            for pos, follows in ends[i + r]:
                at[pos] = True
                seen[follows] += 1
            assert (got[r][at] == end_label).all(), f"label after a document's end is not {end_label}"
            assert (got[r][~at] == raw[r][~at]).all(), "a label away from document ends changed"
            if chunk[r].mask is not None and end_label == IGNORE:
                # conversations (sft): the rule only ever removes targets
                assert set(np.flatnonzero(got[r] != IGNORE)) <= set(np.flatnonzero(raw[r] != IGNORE))
    return seen


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 12), st.integers(13, 80)), min_size=1, max_size=60),
       seq_len=st.integers(3, 40), buffer_size=st.integers(1, 12), batch_size=st.integers(1, 3),
       mode=st.sampled_from(["flat", "bestfit", "crop"]), min_fill=st.sampled_from([1, 3]),
       predict_bos=st.booleans(), masked=st.booleans())
def test_every_packer_labels_document_ends_by_one_rule(lengths, seq_len, buffer_size, batch_size, mode, min_fill,
                                                      predict_bos, masked):
    docs = make_docs(lengths, masked)
    packer = packer_for(mode, docs, seq_len, buffer_size, min_fill)
    packer.reset(None)
    check_rule(list(packer), docs, batch_size, seq_len, BOS if predict_bos else IGNORE)


@pytest.mark.parametrize("predict_bos", [True, False])
def test_bestfit_document_ends_before_padding_and_before_a_chunk(predict_bos):
    """The cases the old labels got wrong, made sure to occur: with bestfit a document's last
    token was followed by padding (label -100) or by a long document's later piece (label: a
    token from the middle of another document); before the next document's BOS it was trained."""
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(600) < 0.1, rng.integers(70, 200, 600), rng.integers(2, 30, 600)).tolist()
    docs = make_docs(lengths, masked=False)
    packer = packer_for("bestfit", docs, 63, 8, min_fill=12)
    packer.reset(None)
    seen = check_rule(list(packer), docs, 4, 63, BOS if predict_bos else IGNORE)
    assert min(seen.values()) > 0, seen


# --- the rule through the recipes, on real batches --------------------------------------------

def boundary_labels(batches):
    """Labels of the input positions whose next input is another segment or padding (visible
    in segment_ids), and the labels of padding positions."""
    at_end, at_pad = [], []
    for b in batches:
        seg, lab = b["segment_ids"], b["labels"]
        end = (seg[:, :-1] > 0) & (seg[:, 1:] != seg[:, :-1])
        at_end.append(lab[:, :-1][end])
        at_pad.append(lab[seg == 0])
    return torch.cat(at_end), torch.cat(at_pad)


@pytest.mark.parametrize("packing", ["flat", "bestfit", "bestfit-crop"])
def test_pretrain_predict_bos(corpus, tok_path, packing):
    spec, _ = corpus
    got = {}
    for predict_bos in (True, False):
        loader = pretrain(spec, tokenizer=tok_path, seq_len=128, batch_size=4, packing=packing, epochs=1,
                          predict_bos=predict_bos)
        assert loader.config["predict_bos"] is predict_bos
        got[predict_bos] = list(loader)
        at_end, at_pad = boundary_labels(got[predict_bos])
        assert len(at_end) > 100
        assert (at_end == (0 if predict_bos else IGNORE)).all()  # the demo tokenizer's BOS is 0
        assert (at_pad == IGNORE).all()
    a, b = got[True], got[False]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"])
        differ = x["labels"] != y["labels"]
        assert (x["labels"][differ] == 0).all() and (y["labels"][differ] == IGNORE).all()


def test_pad_is_the_bos_by_default_and_can_be_chosen(corpus, tok_path):
    spec, _ = corpus
    kw = dict(tokenizer=tok_path, seq_len=128, batch_size=4, epochs=1)
    default = list(pretrain(spec, **kw))
    by_name = list(pretrain(spec, pad="<|pad|>", **kw))
    by_id = list(pretrain(spec, pad=2, **kw))
    pads = sum(int((b["segment_ids"] == 0).sum()) for b in default)
    assert pads > 0
    for d, n, i in zip(default, by_name, by_id):
        pad = d["segment_ids"] == 0
        assert (d["input_ids"][pad] == 0).all() and (n["input_ids"][pad] == 2).all()
        assert torch.equal(n["input_ids"], i["input_ids"])
        assert torch.equal(d["input_ids"][~pad], n["input_ids"][~pad])
        assert torch.equal(d["labels"], n["labels"])  # padding is never a target, whatever its id
    with pytest.raises(ValueError, match="<nope>"):
        pretrain(spec, pad="<nope>", **kw)
    with pytest.raises(ValueError, match="predict_bos='no'"):
        pretrain(spec, predict_bos="no", **kw)


def test_sft_trains_nothing_across_conversations(tmp_path, tok_path):
    """sft: the label after a conversation's end is -100; the template decides everything else.
    Long answers split across rows put a conversation's later piece, which starts inside a
    trained answer, right after another conversation's end: its first token must not become
    that conversation's target."""
    import json

    path = tmp_path / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            answer = "so " * (150 + i if i % 5 == 0 else i % 17)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i} " + "why " * (i % 13)},
                                             {"role": "assistant", "content": f"a{i} " + answer}]}) + "\n")
    batches = list(sft(str(path), tokenizer=tok_path, seq_len=96, batch_size=4, epochs=1, long_conversations="split"))
    at_end, _ = boundary_labels(batches)
    assert len(at_end) > 50 and (at_end == IGNORE).all()
    assert all(b["labels"].ne(IGNORE).any() for b in batches[:-1])


# --- the labels trap, with a Hugging Face model ------------------------------------------------

def readme_training_loop():
    text = open(README, encoding="utf-8").read()
    section = text.split("## In a training loop", 1)[1].split("\n## ", 1)[0]
    loop = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    explicit = re.search(r"^ *(loss = F\.cross_entropy\(.*\))$", loop, re.M).group(1)
    hf = re.search(r"<!-- hf-loss[^>]*-->\s*```python\n(.*?)```", section, re.S).group(1)
    return explicit, hf


def test_readme_loss_is_next_token_loss_and_plain_hf_labels_are_not(corpus, tok_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec, _ = corpus
    # predict_bos=False: -100 after every document's end, so ignore_index is exercised too
    loader = pretrain(spec, tokenizer=tok_path, seq_len=64, batch_size=2, predict_bos=False)
    batch = next(b for b in loader if (b["labels"] == IGNORE).any())
    labels = batch["labels"]
    assert (labels == IGNORE).any() and (labels != IGNORE).sum() > 100
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        # the definition: position t predicts labels[:, t], averaged over target tokens
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
        want = per_token / (labels != IGNORE).sum()

        explicit, hf_call = readme_training_loop()
        ns = {"F": F, "torch": torch, "batch": batch, "logits": logits}
        exec(explicit, ns)
        torch.testing.assert_close(ns["loss"], want)

        ns = {"F": F, "torch": torch, "batch": batch, "model": hf}
        exec(hf_call, ns)
        torch.testing.assert_close(ns["loss"], want)

        # Several ranks: the sum over this rank's targets divided by a count summed over ranks.
        ranks_total = 3 * (labels != IGNORE).sum()
        summed = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels,
                    shift_labels=labels, num_items_in_batch=ranks_total).loss
        torch.testing.assert_close(summed, per_token / ranks_total)

        # The trap: labels= alone is shifted once more, so position t learns labels[:, t + 1].
        naive = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels).loss
        assert not torch.isclose(naive, want, rtol=1e-3), (naive, want)
        after_next = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        torch.testing.assert_close(naive, F.cross_entropy(logits.flatten(0, 1).float(), after_next.flatten(),
                                                          ignore_index=IGNORE))


# --- the command line ----------------------------------------------------------------------------

def test_cli_predict_bos_and_pad(corpus, tok_path, tmp_path, capsys):
    from tokenloom.cli import main

    spec, _ = corpus
    args = [spec, "--tokenizer", "demo", "--seq-len", "128", "--batch-size", "4", "--epochs", "1", "--quiet"]
    kw = dict(tokenizer=tok_path, seq_len=128, batch_size=4, epochs=1)
    cases = {"flags": ["--no-predict-bos", "--pad", "<|pad|>"], "default": []}
    toml = tmp_path / "run.toml"
    toml.write_text('predict_bos = false\npad = 2\n')
    cases["toml"] = ["--config", str(toml)]
    got = {}
    for name, extra in cases.items():
        out = tmp_path / f"{name}.pt"
        assert main(["run", *args, *extra, "--dump-batches", str(out)]) == 0
        got[name] = torch.load(out, weights_only=True)
    for name, want in (("flags", pretrain(spec, predict_bos=False, pad=2, **kw)), ("default", pretrain(spec, **kw)),
                       ("toml", pretrain(spec, predict_bos=False, pad=2, **kw))):
        want = list(want)
        assert len(got[name]) == len(want)
        for g, w in zip(got[name], want):
            assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["labels"], w["labels"]), name
    capsys.readouterr()
    assert main(["run", *args, "--recipe", "sft", "--no-predict-bos"]) == 2
    assert "--no-predict-bos applies to recipe pretrain" in capsys.readouterr().err
    toml.write_text('predict_bos = "no"\n')
    assert main(["run", *args, "--config", str(toml)]) == 2
    assert "must be true or false" in capsys.readouterr().err

