"""The example scripts in examples/ run, with the real frameworks, and say the resume was exact
(the exactness itself, in new processes and elastically, is tests/test_integrations.py's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(cmd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{cmd[-2]} did not finish in {timeout}s")
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{err[-4000:]}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("script", ["accelerate_loop.py", "lightning_fit.py"])
def test_example_resumes_exactly(script, tmp_path):
    out = _run([sys.executable, os.path.join(EXAMPLES, script), str(tmp_path)])
    assert "equal the uninterrupted run's: True" in out, out
    assert "'data/wait_ms'" in out and "'data/share/default'" in out, "the loader's figures are not logged"


@pytest.mark.slow
def test_hf_trainer_example_resumes_exactly(tmp_path):
    out = _run([sys.executable, os.path.join(EXAMPLES, "hf_trainer.py"), str(tmp_path)])
    m = re.search(r"step 8 loss: uninterrupted ([\d.]+), resumed from step 4 ([\d.]+)", out)
    assert m and m.group(1) == m.group(2), out
    assert re.search(r"logged at step 8: .*'data/wait_ms'.*'data/share/default'", out), out


@pytest.mark.slow
def test_torchtitan_example_resumes_exactly(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                os.path.join(EXAMPLES, "torchtitan_loader.py"), str(tmp_path)])
    assert out.count("equal the uninterrupted run's: True") == 2, out
