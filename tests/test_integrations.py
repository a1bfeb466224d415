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


@pytest.mark.parametrize("stateful", ["0", "1"], ids=["default", "use_stateful_dataloader"])
def test_accelerate_save_state_load_state_resumes_exactly(corpus, tok_path, tmp_path, stateful):
    ckpt, run, resumed = str(tmp_path / "ckpt"), str(tmp_path / "run.json"), str(tmp_path / "resumed.json")
    _job("accelerate_job.py", "run", corpus[0], tok_path, ckpt, run, stateful, str(STEPS), str(K))
    assert os.path.exists(os.path.join(ckpt, "dl_state_dict.bin")), os.listdir(ckpt)
    _job("accelerate_job.py", "resume", corpus[0], tok_path, ckpt, resumed, stateful, str(STEPS), str(K))
    _check(read(run), read(resumed), "accelerate")


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

def test_lightning_resumes_from_a_mid_epoch_checkpoint_exactly(corpus, tok_path, tmp_path):
    """Lightning fetches a batch ahead: the loader's own state at a checkpoint resumed one batch
    late (the uninterrupted run's step 6 came first, step 5 was never trained)."""
    ckpt, run, resumed = str(tmp_path / "ckpt"), str(tmp_path / "run.json"), str(tmp_path / "resumed.json")
    _job("lightning_job.py", "run", corpus[0], tok_path, ckpt, run, str(STEPS), str(K))
    _job("lightning_job.py", "resume", corpus[0], tok_path, ckpt, resumed, str(STEPS), str(K))
    _check(read(run), read(resumed), "Lightning")
