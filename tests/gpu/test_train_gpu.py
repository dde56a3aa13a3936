"""`python -m ringfa4.train` on every GPU of the machine (NCCL, bf16, backend auto) trains, a run
resumed from its DCP checkpoint continues, and one whose newest checkpoint is damaged falls back
to the one before (the integrity check runs its collectives over NCCL).

Run on the device machine (kind nvidia-h200-x2), NOT under torchrun (the entry starts a worker per GPU):
    python -m pytest -m gpu -q tests/gpu/test_train_gpu.py
"""
import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

# head_dim 64 (256 / 4), GQA 2:1, 4096-token sequences: 2048 per GPU, chunks of 1024 in the zigzag.
SMALL = ["model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=704",
         "train.seq_len=4096", "train.global_batch=4", "train.log_interval=1", "train.warmup_steps=5",
         "train.lr=3e-3", "train.checkpoint_interval=10"]


def run_entry(tmp_path, *overrides):
    proc = subprocess.run([sys.executable, "-m", "ringfa4.train", *SMALL, f"hydra.run.dir={tmp_path}",
                           f"train.checkpoint_dir={tmp_path / 'ckpt'}", *overrides],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_entry_trains_on_all_gpus_in_bf16_and_resumes(tmp_path):
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 or more GPUs for a ring, found {gpus}")
    out = run_entry(tmp_path, "train.steps=30")
    assert f"{gpus} rank(s) on cuda, dp_shard=1 x cp={gpus} (zigzag, backend " in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert all(r["mfu"] is not None and r["mfu"] > 0 and r["peak_mem_gib"] > 0 for r in records)

    out = run_entry(tmp_path, "train.steps=32", "train.resume=true")
    assert "resumed at step 30" in out and "step 32/32" in out

    newest = tmp_path / "ckpt" / "step_00000032"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    out = run_entry(tmp_path, "train.steps=34", "train.resume=true")
    assert f"checkpoint {newest} fails its integrity check ({shard} has" in out
    assert "resumed at step 30" in out and "step 34/34" in out
