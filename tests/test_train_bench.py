"""bench/train.py runs end to end on CPU (--tiny), so its GPU run is not the first run of the script,
and a smoke run never replaces the recorded results."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "train.py"
RECORDED = BENCH.parent / "results" / "train.json"


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout)


def test_bench_tiny_trains_ringfa4_records_the_torch_cp_outcome_and_leaves_recorded_rows_alone():
    recorded = RECORDED.read_bytes()
    proc = run_bench("--tiny", "--commit", "test")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert RECORDED.read_bytes() == recorded
    out_dir = Path(re.search(r"rows go to (\S+) \(not recorded", proc.stdout).group(1))
    assert out_dir != RECORDED.parent
    report = json.loads((out_dir / "train.json").read_text())
    assert report["device"] == "cpu" and report["cp"] == 2 and report["commit"] == "test"
    ringfa4 = report["rows"][0]
    assert ringfa4["impl"] == "ringfa4" and ringfa4["backend"] == "torch"
    assert len(ringfa4["losses"]) == report["steps"] and all(math.isfinite(x) for x in ringfa4["losses"])
    assert ringfa4["tokens_per_s"] > 0 and ringfa4["tflops_per_gpu"] > 0
    # PyTorch's context_parallel has no CPU attention kernel to shard: either it ran, or the
    # results and the output say why not.
    if len(report["rows"]) == 1:
        assert report["torch_cp_failed"].startswith("torch_cp could not run on cpu")
        assert "NOT COMPARED: torch_cp could not run on cpu" in proc.stdout
    else:
        assert report["rows"][1]["impl"] == "torch_cp" and report["first_loss_rel_diff"] < 1e-5


def test_smoke_run_cannot_record():
    proc = run_bench("--tiny", "--record", timeout=60)
    assert proc.returncode == 2
    assert "--record writes the recorded rows of a full run: not with --out-dir or a smoke run" in proc.stderr
