"""The issue's acceptance run: a real corpus, a state saved after k batches with torch.save in
this process, loaded in a new process into a new loader: the next batches are bitwise identical
to the ones this process went on to produce."""

from __future__ import annotations

import os

import pytest
import torch

from .fresh_process_resume import build
from .resume import items_equal, run_in_fresh_process

SCRIPT = os.path.join(os.path.dirname(__file__), "fresh_process_resume.py")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_a_new_process_on_the_stdlib_corpus(tmp_path, real_corpus, num_workers):
    sources = real_corpus["code"] + real_corpus["prose"]
    k, n = 7, 6
    loader = build(sources, num_workers)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state, tail = str(tmp_path / "state.pt"), str(tmp_path / "tail.pt")
    torch.save(loader.state_dict(), state)  # mid-stream: the uninterrupted run goes on below
    reference = head + [next(it) for _ in range(n)]
    del it, loader
    run_in_fresh_process(SCRIPT, "resume", state, tail, str(num_workers), str(n), *sources)
    got = head + torch.load(tail, weights_only=True)
    for i, (want, have) in enumerate(zip(reference, got)):
        assert items_equal(want, have), f"batch {i} differs ({'after' if i >= k else 'before'} the resume)"
    assert len(got) == k + n
    # a real corpus really went through: mostly real tokens, several documents per row
    b = reference[-1]
    assert (b["labels"] != -100).float().mean() > 0.9


def test_two_sources_mixed_in_pieces_resume_in_a_new_process(tmp_path, real_corpus):
    """Two sources with bestfit: long source files reach the mixer in pieces (pipes/pieces.py), and a
    state saved mid-document resumes in a new interpreter with 2 workers."""
    code, prose = real_corpus["code"][0], real_corpus["prose"][0]
    sources = {"code": code, "prose": prose}
    k, n = 9, 6
    loader = build(sources, 2)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state, tail = str(tmp_path / "state.pt"), str(tmp_path / "tail.pt")
    saved = loader.state_dict()
    torch.save(saved, state)
    reference = head + [next(it) for _ in range(n)]
    del it, loader
    assert '"offset"' in repr(saved), "no Pieces node in the graph"
    run_in_fresh_process(SCRIPT, "resume", state, tail, "2", str(n), f"code={code}", f"prose={prose}")
    got = head + torch.load(tail, weights_only=True)
    for i, (want, have) in enumerate(zip(reference, got)):
        assert items_equal(want, have), f"batch {i} differs ({'after' if i >= k else 'before'} the resume)"


def test_a_buffer_of_two_with_sources_in_pieces_resumes_in_a_new_process(tmp_path, real_corpus):
    """Issue 34's setting (two sources in pieces, buffer_size=2, which never ended before): a state saved
    mid-stream resumes in a new interpreter with 2 workers, bitwise."""
    code, prose = real_corpus["code"][0], real_corpus["prose"][0]
    k, n = 9, 6
    loader = build({"code": code, "prose": prose}, 2, buffer_size=2)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state, tail = str(tmp_path / "state.pt"), str(tmp_path / "tail.pt")
    torch.save(loader.state_dict(), state)
    reference = head + [next(it) for _ in range(n)]
    del it, loader
    run_in_fresh_process(SCRIPT, "resume", state, tail, "2", str(n), "--buffer", "2", f"code={code}",
                         f"prose={prose}")
    got = head + torch.load(tail, weights_only=True)
    for i, (want, have) in enumerate(zip(reference, got)):
        assert items_equal(want, have), f"batch {i} differs ({'after' if i >= k else 'before'} the resume)"
