"""The bench scripts' CPU smoke runs: they run end to end, write their rows where they say, and
never touch the recorded rows in bench/results/."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _recorded():
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.glob("*.json"))}


def _checked(argv):
    """stdout of a run that succeeded and left the recorded rows alone."""
    before = _recorded()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _recorded() == before, "a smoke run changed bench/results/*.json"
    return proc.stdout


def _run(argv):
    stdout = _checked(argv)
    written = Path(re.search(r"^wrote (.+)$", stdout, re.M).group(1))
    assert RESULTS.resolve() not in written.resolve().parents
    return stdout, json.loads(written.read_text())


def test_kernels_user_smoke_measures_every_case_outside_the_recorded_results():
    stdout, rows = _run([sys.executable, "bench/kernels.py", "--mode", "user", "--smoke", "--rounds", "1",
                         "--warmup", "1", "--turn-ms", "1", "--commit", "test"])
    shapes = [(r["shape"], r["seq_q"], r["seq_k"], r["heads"], r["kv_heads"], r["causal"]) for r in rows]
    # 3 ring-step shapes, then 2 seqs x 2 head pairs x causal and not
    assert len(shapes) == len(set(shapes)) == 3 + 2 * 2 * 2
    assert {s[0] for s in shapes[:3]} == {"ring-step"} and {s[0] for s in shapes[3:]} == {"grid"}
    for r in rows:
        assert r["commit"] == "test" and r["device"] == "cpu" and r["backend"] == "torch"
        for key in ("fwd_ringfa4", "fwd_sdpa", "fwd_bwd_ringfa4", "fwd_bwd_sdpa", "bwd_ringfa4", "bwd_ringfa4_det"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_tflops"] > 0, key
        assert r["det_vs_default"] > 0 and r["max_abs_diff_vs"]["sdpa"] < 1e-4
        assert "direction" not in r  # the planner reads kernel rows by "direction"; these are not those
        assert r["fa4_error"].startswith("fa4 runs on CUDA tensors only")
    assert "| shape | batch | q x kv |" in stdout and "grid: geometric mean" in stdout


def test_ring_smoke_writes_its_rows_outside_the_recorded_results():
    pytest.importorskip("torch.distributed.run")
    _, rows = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "bench/ring.py", "--smoke"])
    assert len(rows) == 4 and all(r["max_abs_diff_vs_single"] < 1e-4 for r in rows)


@pytest.mark.parametrize("script", ["bench/kernels.py --mode user", "bench/ring.py"])
def test_a_smoke_run_refuses_to_record(script):
    proc = subprocess.run([sys.executable, *script.split(), "--smoke", "--record"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--record writes the recorded rows of a full run" in proc.stderr


def test_documents_smoke_times_attention_and_every_simulated_ring_case(tmp_path):
    _checked([sys.executable, "bench/documents.py", "--smoke", "--commit", "test", "--out-dir", str(tmp_path)])
    attention = json.loads((tmp_path / "documents_attention.json").read_text())
    assert [(r["mix"], r["direction"]) for r in attention] == [
        (mix, d) for mix in ("log-normal", "long") for d in ("fwd", "fwd+bwd")]
    assert all(r["ringfa4_ms"] > 0 and r["backend"] == "torch_ref" for r in attention)
    ring = json.loads((tmp_path / "documents_ring.json").read_text())
    assert [(r["mix"], r["layout"]) for r in ring] == [("dense", "zigzag")] + [
        (mix, layout) for mix in ("log-normal", "long") for layout in ("zigzag", "document_zigzag", "document_balanced")]
    assert all(r["world"] == 2 and len(r["rank_ms"]) == 2 and r["slowest_ms"] > 0 for r in ring)


def test_documents_ring_over_two_processes_checks_and_times_every_case(tmp_path):
    _checked([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "bench/documents.py",
              "--part", "ring", "--smoke", "--commit", "test", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "documents_ring_ranks.json").read_text())
    assert [(r["mix"], r["layout"]) for r in rows] == [("dense", "zigzag"), ("log-normal", "document_balanced"),
                                                       ("long", "document_balanced")]
    for r in rows:
        assert r["part"] == "ring_ranks" and r["world"] == 2 and r["commit"] == "test"
        assert r["slowest_ms"] > 0 and r["calls_per_turn"] >= 1 and r["tflops_per_gpu"] > 0
    assert rows[0]["vs_dense"] == 1.0
