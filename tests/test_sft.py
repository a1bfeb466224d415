"""sft(): chat template, loss mask, bad conversations, long conversations, and exact resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import ShardUnits, load_encoder
from tokenloom.pipes.chat import ChatError, ChatTemplate, RenderChat
from tokenloom.pipes.sources.jsonl import ReadJsonl, list_jsonl_units
from tokenloom.pipes.sources.files import resolve_files
from tokenloom.recipes import sft

from .resume import check_loader_resume, check_node_resume

QUESTION_WORDS = ["why", "where", "which", "whom", "whose"]
ANSWER_WORDS = ["because", "therefore", "indeed", "certainly", "surely"]


def conversation(i, rng, turns=2):
    msgs = [{"role": "system", "content": f"sys{i} be brief"}] if i % 3 == 0 else []
    for t in range(turns):
        q = " ".join(rng.choice(QUESTION_WORDS, rng.integers(2, 8)))
        a = " ".join(rng.choice(ANSWER_WORDS, rng.integers(2, 12)))
        msgs += [{"role": "user", "content": f"Q{i}x{t} {q}"}, {"role": "assistant", "content": f"A{i}x{t} {a}"}]
    return {"messages": msgs}


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("sft")
    records = [conversation(i, rng, turns=1 + i % 3) for i in range(300)]
    return write_jsonl(root / "chats.jsonl", records), records


def supervised_text(batches, enc):
    """Decode, per row, the tokens whose label is trained (the label tokens themselves)."""
    out = []
    for b in batches:
        for lab in b["labels"]:
            ids = lab[lab != -100].tolist()
            out.append(enc.decode(ids))
    return " ".join(out)


def test_labels_hold_every_answer_and_no_question(chats, tok_path):
    path, records = chats
    loader = sft(path, tokenizer=tok_path, seq_len=255, batch_size=4, epochs=1, buffer_size=50)
    batches = list(loader)
    enc = load_encoder(tok_path)
    text = supervised_text(batches, enc)
    answers = [m["content"].split()[0] for r in records for m in r["messages"] if m["role"] == "assistant"]
    questions = [m["content"].split()[0] for r in records for m in r["messages"] if m["role"] != "assistant"]
    missing = [a for a in answers if a not in text]
    assert not missing, f"answers not trained: {missing[:5]}"
    for w in QUESTION_WORDS + ["sys"]:
        assert w not in text, f"a prompt word {w!r} is a training target"
    assert not any(q in text for q in questions)
    # every conversation once, padded not cropped
    stats = loader.stats()
    assert stats["discarded"] == 0 and stats["documents"] == len(records)
    assert stats["conversations"] == {"empty": 0, "untrained": 0, "truncated": 0, "dropped": 0,
                                      "discarded_tokens": 0}
    # the end-of-turn token after each answer is trained: the model learns to stop
    end = enc.token_id("<|end|>")
    trained_ends = sum(int((b["labels"] == end).sum()) for b in batches)
    assert trained_ends == len(answers)


def test_resume_every_step_and_through_the_loader(chats, tok_path):
    path, _ = chats
    enc = load_encoder(tok_path)
    units = list_jsonl_units(resolve_files(path, "jsonl"), field="messages")
    build = lambda: RenderChat(ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=2, epochs=1), units,
                                         field="messages", require_type=list), enc, max_tokens=64, batch_docs=7)
    assert check_node_resume(build, max_steps=400, horizon=3) == 300
    loader = lambda: sft(path, tokenizer=tok_path, seq_len=127, batch_size=2, num_workers=2, buffer_size=40,
                         persistent_workers=True)
    check_loader_resume(loader, steps=[3, 9], total=14)


def test_bad_conversations(tmp_path, tok_path, caplog):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "a.jsonl", [good, {"messages": []}, good,
                                              {"messages": [{"role": "user", "content": "only a question"}]}])
    loader = sft(path, tokenizer=tok_path, seq_len=63, batch_size=2, epochs=1)
    with caplog.at_level(logging.WARNING):
        list(loader)
    assert loader.stats()["conversations"]["empty"] == 1
    assert loader.stats()["conversations"]["untrained"] == 1
    bad_role = write_jsonl(tmp_path / "b.jsonl", [good, {"messages": [{"role": "robot", "content": "beep"}]}])
    with pytest.raises(ChatError, match=r"unknown role 'robot'.*knows \['assistant', 'system', 'user'\]"):
        list(sft(bad_role, tokenizer=tok_path, seq_len=63, batch_size=2, epochs=1))
    malformed = write_jsonl(tmp_path / "c.jsonl", [good, good, '{"messages": [oops'])
    with pytest.raises(ValueError, match=r"c\.jsonl, line 3"):
        list(sft(malformed, tokenizer=tok_path, seq_len=63, batch_size=2, epochs=1))


@pytest.mark.parametrize("policy", ["truncate", "drop", "split"])
def test_conversations_longer_than_a_row(tmp_path, tok_path, policy):
    rng = np.random.default_rng(1)
    records = [conversation(i, rng, turns=1) for i in range(20)]
    records[5] = conversation(5, rng, turns=40)  # far longer than a 64-token row
    path = write_jsonl(tmp_path / "long.jsonl", records)
    loader = sft(path, tokenizer=tok_path, seq_len=63, batch_size=2, epochs=1, long_conversations=policy)
    list(loader)
    conv = loader.stats()["conversations"]
    if policy == "truncate":
        assert conv["truncated"] == 1 and conv["discarded_tokens"] > 0
    elif policy == "drop":
        assert conv["dropped"] == 1 and loader.stats()["documents"] == 19
    else:
        assert conv["truncated"] == conv["dropped"] == 0 and loader.stats()["chunked"] >= 1


def test_parquet_conversations_and_a_custom_template(tmp_path, tok_path):
    rng = np.random.default_rng(2)
    records = [conversation(i, rng) for i in range(40)]
    pq.write_table(pa.table({"messages": [r["messages"] for r in records]}), tmp_path / "c.parquet")

    def template(messages, encoder):
        # train every message, no special tokens: a plain user template
        ids = encoder.encode_batch([m["content"] for m in messages])
        flat = np.concatenate(ids).astype(np.int32)
        return flat, np.ones(len(flat), bool)

    loader = sft(str(tmp_path / "c.parquet"), tokenizer=tok_path, seq_len=127, batch_size=2, epochs=1,
                 template=template)
    batches = list(loader)
    assert loader.stats()["documents"] == 40
    assert all((b["labels"][b["segment_ids"] > 0] != -100).float().mean() > 0.9 for b in batches[:-1])
    # the config describes the template the same way in every process
    assert "test_sft" in loader.config["chat"] and "0x" not in loader.config["chat"]


def test_default_template_needs_the_special_tokens(chats):
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    # issue 17: the default falls back to ChatML (text markers); a template naming a missing token says so
    with pytest.raises(ValueError, match=r"the chat template's bos='<\|bos\|>' is not a token.*template='chatml'"):
        sft(chats[0], tokenizer=bare, seq_len=63, batch_size=2, template=ChatTemplate())
