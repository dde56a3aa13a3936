"""examples/hf_finetune.py under torchrun on two gloo ranks: the first step's loss is the loss of the
same tiny transformers Llama on the same sequences in one process, and a run resumed from a DCP
checkpoint continues with the losses of the uninterrupted run. Needs the hf extra."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_finetune.py"
ARGS = ["--seq-len", "64", "--global-batch", "2", "--steps", "4", "--checkpoint-interval", "2", "--backend", "torch"]


def load_example():
    spec = importlib.util.spec_from_file_location("hf_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(run_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE), *ARGS,
           "--run-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "ckpt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def first_step_loss_in_one_process():
    """What rank 0 builds (seeded tiny Llama) on the first global batch, with transformers' SDPA."""
    example = load_example()
    args = example.parse_args(ARGS)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(example.tiny_config(), attn_implementation="sdpa",
                                                          dtype=torch.float32)
    sampler = example.data.StreamSampler(example.token_stream(args, model.config.vocab_size), args.seq_len, args.seed)
    input_ids = example.data.load_samples(sampler, 0, args.global_batch, model.config.vocab_size)[:, :args.seq_len]
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()


def test_example_matches_one_process_and_resumes_with_the_same_losses(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    stdout, losses = run_example(first)
    assert "2 rank(s) on cpu, dp_shard=1 x cp=2 (zigzag), tiny random Llama" in stdout
    assert sorted(losses) == [1, 2, 3, 4]
    assert abs(losses[1] - first_step_loss_in_one_process()) <= 1e-5 * losses[1]

    # Resume from step 2's checkpoint: steps 3 and 4 must repeat the uninterrupted run's losses.
    second.mkdir()
    shutil.copytree(first / "ckpt" / "step_00000002", second / "ckpt" / "step_00000002")
    stdout, resumed = run_example(second, "--resume")
    assert "resumed at step 2" in stdout
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - losses[step]) <= 1e-6 * losses[step], (step, resumed[step], losses[step])
