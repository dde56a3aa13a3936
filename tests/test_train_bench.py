"""bench/train.py runs end to end on CPU (--tiny), so its GPU run is not the first run of the script."""
import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "train.py"


def test_bench_tiny_trains_ringfa4_and_records_the_torch_cp_outcome(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", str(out), "--commit", "test"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
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
