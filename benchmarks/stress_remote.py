"""Stress check (issue 42), not a timed test: run the remote tests (tests/test_cache_remote.py with
tests/test_resume_first_fetches.py) ``--runs`` times while another process keeps a core busy, and print
one JSON line per run (exit status, seconds, tests over ``--stall`` s as pytest's faulthandler reports
them) and a summary. A stall is a test that ran past ``--stall`` s; a failure is a non-zero exit.

    python benchmarks/stress_remote.py --runs 20 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/test_cache_remote.py", "tests/test_resume_first_fetches.py"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist processes (0: none)")
    ap.add_argument("--stall", type=int, default=30, help="seconds a test may take before it counts as a stall")
    ap.add_argument("--logs", default=None, help="folder for each run's pytest output")
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    results = []
    try:
        for i in range(1, args.runs + 1):
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-o", f"faulthandler_timeout={args.stall}", *TESTS]
            if args.workers:
                cmd[4:4] = ["-n", str(args.workers)]
            t = time.monotonic()
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            out = done.stdout + done.stderr
            run = {"run": i, "rc": done.returncode, "seconds": round(time.monotonic() - t, 1),
                   "stalls": out.count("Timeout ("), "last": out.strip().splitlines()[-1] if out.strip() else ""}
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                with open(os.path.join(args.logs, f"run{i}.log"), "w") as f:
                    f.write(out)
            results.append(run)
            print(json.dumps(run), flush=True)
    finally:
        busy.kill()
        busy.wait()
    print(json.dumps({"runs": len(results), "failed": sum(r["rc"] != 0 for r in results),
                      "with_stalls": sum(r["stalls"] > 0 for r in results),
                      "seconds_max": max((r["seconds"] for r in results), default=None)}))


if __name__ == "__main__":
    main()
