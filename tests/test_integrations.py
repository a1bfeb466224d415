"""The trainers people run (issue 25), each for real on CPU with a tiny random Llama and 2 loader
workers: train, checkpoint at step K by the framework's own mechanism, resume in a new process the
framework's own way, and get exactly the batches of steps K+1.. of an uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .trainer_common import build_loader, here, read

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS, K = 8, 4


def _job(script: str, *args: str, timeout: float = 240) -> None:
    env = dict(os.environ, PYTHONPATH=here() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, here(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script} {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def _check(run, resumed, name):
    assert len(run) == STEPS and len(resumed) == STEPS - K, (len(run), len(resumed))
    for j, (a, b) in enumerate(zip(resumed, run[K:])):
        assert a == b, f"{name}: step {K + j + 1} after the resume differs from the uninterrupted run's"


# --- Accelerate ----------------------------------------------------------------------------------

def test_accelerate_prepare_yields_the_loaders_own_batches(corpus, tok_path):
    from accelerate import Accelerator

    want = [b for _, b in zip(range(6), build_loader(corpus[0], tok_path))]
    loader = build_loader(corpus[0], tok_path)
    prepared = Accelerator(cpu=True).prepare(loader)
    assert prepared is loader  # not re-created around .dataset: no dispatcher, no second sharding
    got = [b for _, b in zip(range(6), prepared)]
    assert all(type(b) is dict for b in got)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_accelerate_save_state_load_state_resumes_exactly(corpus, tok_path, tmp_path):
    """Both of Accelerate's ways with a loader: its default, and ``use_stateful_dataloader=True``; they
    share the job's two processes (run, resume), each with an Accelerator of its own."""
    ckpt, runs, resumed = (str(tmp_path / d) for d in ("ckpt", "run", "resumed"))
    os.makedirs(runs)
    os.makedirs(resumed)
    _job("accelerate_job.py", "run", corpus[0], tok_path, ckpt, runs, "0,1", str(STEPS), str(K))
    for stateful in ("0", "1"):
        assert os.path.exists(os.path.join(ckpt, stateful, "dl_state_dict.bin")), os.listdir(os.path.join(ckpt, stateful))
    _job("accelerate_job.py", "resume", corpus[0], tok_path, ckpt, resumed, "0,1", str(STEPS), str(K))
    for stateful, name in (("0", "default"), ("1", "use_stateful_dataloader")):
        _check(read(os.path.join(runs, stateful + ".json")), read(os.path.join(resumed, stateful + ".json")),
               f"accelerate ({name})")


def test_batches_go_to_accelerates_device(corpus, tok_path, monkeypatch):
    """On a GPU Accelerate's own loaders put batches on the device; so does tokenloom's. No GPU
    here: the 'meta' device stands in (tensors move there without data)."""
    import types

    import accelerate.state
    from accelerate import Accelerator

    loader = build_loader(corpus[0], tok_path)
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerate.state, "PartialState", lambda: types.SimpleNamespace(device=torch.device("meta")))
    prepared = accelerator.prepare(loader)
    batch = next(iter(prepared))
    assert all(v.device.type == "meta" for v in batch.values() if isinstance(v, torch.Tensor))


# --- Hugging Face Trainer --------------------------------------------------------------------------

def test_hf_trainer_resumes_from_its_own_checkpoint_exactly(corpus, tok_path, tmp_path):
    out_dir, run, resumed = str(tmp_path / "out"), str(tmp_path / "run.json"), str(tmp_path / "resumed.json")
    _job("hf_job.py", "run", corpus[0], tok_path, out_dir, run, str(STEPS), str(K))
    assert os.path.exists(os.path.join(out_dir, f"checkpoint-{K}", "tokenloom_loader_rank0.json"))
    _job("hf_job.py", "resume", corpus[0], tok_path, out_dir, resumed, str(STEPS), str(K))
    _check(read(run), read(resumed), "Trainer")


def test_hf_trainer_refuses_a_checkpoint_without_the_loader_state(corpus, tok_path, tmp_path):
    from tokenloom.integrations.hf import load_loader_state

    with pytest.raises(ValueError, match="holds no tokenloom loader state"):
        load_loader_state(build_loader(corpus[0], tok_path), str(tmp_path))


# --- PyTorch Lightning ------------------------------------------------------------------------------

# The datamodule is tokenloom's own class, one per package: both packages. The loader as the module's
# train_dataloader() goes through Lightning's loop only, the same code in both packages: one in
# `make test`, the other under `make fuzz` (-m soak). The scenarios of a test share its two processes
# (run, resume): importing torch and Lightning is most of a job's time.
LIGHTNING = [("lightning", "datamodule"), ("pytorch_lightning", "datamodule"), ("lightning", "loader")]


def _lightning(corpus, tok_path, tmp_path, scenarios):
    ckpt, runs, resumed = (str(tmp_path / d) for d in ("ckpt", "run", "resumed"))
    os.makedirs(runs)
    os.makedirs(resumed)
    which = ",".join(f"{package}:{how}" for package, how in scenarios)
    _job("lightning_job.py", "run", corpus[0], tok_path, ckpt, runs, str(STEPS), str(K), which)
    _job("lightning_job.py", "resume", corpus[0], tok_path, ckpt, resumed, str(STEPS), str(K), which)
    for package, how in scenarios:
        name = f"{package}-{how}.json"
        _check(read(os.path.join(runs, name)), read(os.path.join(resumed, name)), f"Lightning ({package}, {how})")


def test_lightning_resumes_from_a_mid_epoch_checkpoint_exactly(corpus, tok_path, tmp_path):
    """Lightning fetches a batch ahead: the loader's own state at a checkpoint resumed one batch
    late (the uninterrupted run's step 6 came first, step 5 was never trained). Exact with
    `TokenLoomDataModule` and, since issue 34, with the loader as the module's train_dataloader();
    on ``lightning.pytorch`` and on the ``pytorch_lightning`` package."""
    _lightning(corpus, tok_path, tmp_path, LIGHTNING)


@pytest.mark.soak
def test_lightning_resumes_the_modules_own_loader_on_pytorch_lightning(corpus, tok_path, tmp_path):
    _lightning(corpus, tok_path, tmp_path, [("pytorch_lightning", "loader")])


# --- torchtitan ---------------------------------------------------------------------------------------

def _titan_batch(inputs, positions, labels):
    """The full batch rebuilt from what torchtitan's loop gets (input, positions, labels): a
    sequence starts where positions restart at 0; a run of pad ids with no target is padding."""
    B, T = inputs.shape
    seg = torch.zeros(B, T, dtype=torch.int32)
    starts = []
    for b in range(B):
        t, n = 0, 0
        while t < T:
            e = t + 1
            while e < T and positions[b, e] != 0:
                e += 1
            pad = bool((inputs[b, t:e] == 0).all() and (labels[b, t:e] == -100).all() and (e - t > 1 or t > 0))
            if not pad:
                n += 1
                seg[b, t:e] = n
            starts.append(b * T + t)
            t = e
    cu = torch.full((B * T + 1,), B * T, dtype=torch.int32)
    cu[:len(starts)] = torch.tensor(starts, dtype=torch.int32)
    lens = [b - a for a, b in zip(starts, starts[1:] + [B * T])]
    return {"input_ids": inputs, "labels": labels, "position_ids": positions, "segment_ids": seg,
            "cu_seqlens": cu, "max_seqlen": torch.tensor(max(lens)), "num_seqs": torch.tensor(len(starts))}


def test_torchtitan_adapter_resumes_through_dcp_and_elastically(tmp_path):
    """2 gloo ranks save through DCP at step 4 as torchtitan's checkpointer does; 2 new ranks load it
    and give steps 5-8 exactly; 3 ranks load every old entry (load_elastic) and, with what the old
    ranks got before the save, deliver every token of the epoch once (the oracle)."""
    import json

    from .oracle import BOS, Oracle, make_corpus
    from .test_torchrun import _torchrun

    corpus = make_corpus(str(tmp_path / "corpus"), {"a": ("parquet", 160)}, row=33, seed=12)
    config = json.dumps({"sources": corpus.sources, "tokenizer": corpus.tokenizer, "bos": "<|bos|>", "seq_len": 32,
                         "batch_size": 2, "epochs": 1, "num_workers": 2, "seed": 0})
    ckpt, job = str(tmp_path / "ckpt"), here("titan_job.py")
    _torchrun("run", config, ckpt, str(tmp_path / "run"), str(STEPS), str(K), job=job, nproc=2, timeout=240)
    _torchrun("resume", config, ckpt, str(tmp_path / "resumed"), str(STEPS), str(K), job=job, nproc=2, timeout=240)
    run = {r: torch.load(tmp_path / f"run_rank{r}.pt", weights_only=True) for r in range(2)}
    for r in range(2):
        resumed = torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=True)
        assert len(resumed) == STEPS - K
        for j, (a, b) in enumerate(zip(resumed, run[r][K:])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {r} step {K + j + 1} differs after the resume"
    # One new world size: 3 ranks load every old entry (load_elastic). 1 rank is the same call, and DCP's
    # 2 -> 1 is test_torchrun's test_dcp_elastic_resume_two_ranks_to_one_and_three (a launch less here).
    for world in (3,):
        _torchrun("elastic", config, ckpt, str(tmp_path / f"elastic{world}"), str(STEPS), str(K), job=job,
                  nproc=world, timeout=240)
        oracle = Oracle(corpus, epochs=1, mode="bestfit", end_label=BOS)
        for k in range(K):
            for r in range(2):
                oracle.feed(_titan_batch(*run[r][k]), f"before the save, rank {r} step {k}", ("old", r), 2)
        after = {r: torch.load(tmp_path / f"elastic{world}_rank{r}.pt", weights_only=True) for r in range(world)}
        for k in range(len(after[0])):
            for r in range(world):
                oracle.feed(_titan_batch(*after[r][k]), f"{world} ranks: rank {r} step {k}", ("new", r, k % 2), 2)
        oracle.finish()
