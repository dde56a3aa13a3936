"""`python -m ringfa4.train` starts its own two gloo workers on a CPU machine and trains."""
import json
import subprocess
import sys

from train_configs import SMALL


def run_entry(tmp_path, *overrides):
    return subprocess.run([sys.executable, "-m", "ringfa4.train", *SMALL, f"hydra.run.dir={tmp_path}", *overrides],
                          capture_output=True, text=True, timeout=300)


def test_entry_trains_a_few_steps_on_two_gloo_workers_with_falling_loss(tmp_path):
    # Without train.warmup_steps, 8 steps take a tenth of them (0) as warmup, and the log says so.
    proc = run_entry(tmp_path, "train.steps=8", "train.lr=1e-2", "train.warmup_steps=null")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rank(s) on cpu, dp_shard=1 x cp=2 (zigzag, backend torch)" in proc.stdout
    assert "warmup scaled to 0 step(s), a tenth of train.steps=8 (set train.warmup_steps to choose)" in proc.stdout
    assert "step 8/8" in proc.stdout and "tok/s" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 for r in records)


def test_entry_names_a_bad_setting_before_starting_workers(tmp_path):
    proc = run_entry(tmp_path, "train.seq_len=66")
    assert proc.returncode != 0
    assert "bad configuration: train.seq_len=66 must be a multiple of 4" in proc.stderr
    assert "rank(s) on" not in proc.stdout


def test_entry_refuses_a_gpu_backend_on_a_cpu_machine_before_starting_workers(tmp_path):
    proc = run_entry(tmp_path, "parallel.backend=cute")
    assert proc.returncode != 0
    assert ("ringfa4-train: bad configuration: parallel.backend=cute cannot run this model on cpu: "
            "cute: cute kernels run on CUDA tensors only") in proc.stderr
    assert "Traceback" not in proc.stderr and "rank(s) on" not in proc.stdout
