"""bench/hf.py runs end to end on CPU (--smoke), so its GPU run is not the script's first run, and
its rows hold both contenders with the same loss. Needs the hf extra."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "bench" / "hf.py"


def test_bench_smoke_times_ringfa4_and_sdpa_on_the_same_model(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--seq-lens", "64", "--commit", "test",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "hf.json").read_text())
    assert row["device"] == "cpu" and row["commit"] == "test" and row["seq_len"] == 64 and row["backend"] == "torch"
    ours, sdpa = row["ringfa4"], row["sdpa"]
    assert abs(ours["loss"] - sdpa["loss"]) <= 1e-5 * sdpa["loss"]
    assert ours["tokens_per_s"] > 0 and sdpa["tokens_per_s"] > 0
    assert row["speedup"] == pytest.approx(sdpa["step_ms"] / ours["step_ms"], rel=1e-2)
    assert "| 64 |" in proc.stdout
