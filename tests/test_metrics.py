"""Run metrics reach the sinks train.metrics names: console, metrics.jsonl, TensorBoard, wandb."""
import importlib.util
import json

import pytest

from ringfa4.train import metrics

RECORDS = [
    {"step": 1, "loss": 5.25, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 1000.0, "tflops_per_device": 0.5,
     "mfu": None, "peak_mem_gib": 0.25},
    {"step": 2, "loss": 4.75, "lr": 2e-3, "grad_norm": 1.5, "tokens_per_s": 1200.0, "tflops_per_device": 0.6,
     "mfu": None, "peak_mem_gib": 0.25},
]


def tensorboard_scalars(log_dir):
    """{tag: [(step, value)]} of the event files in ``log_dir``, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_records_go_to_console_and_jsonl(tmp_path, capsys):
    writer = metrics.Writer(["console", "jsonl"], total_steps=2, run_dir=tmp_path)
    for record in RECORDS:
        writer.write(record)
    writer.close()
    out = capsys.readouterr().out
    assert "step 2/2" in out and "loss 4.7500" in out and "1,200 tok/s" in out
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS


def test_records_go_to_tensorboard_as_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    writer = metrics.Writer(["tensorboard"], total_steps=2, run_dir=tmp_path)
    for record in RECORDS:
        writer.write(record)
    writer.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 5.25), (2, 4.75)]
    assert scalars["train/tokens_per_s"] == [(1, 1000.0), (2, 1200.0)]
    assert "train/mfu" not in scalars  # None (no known peak on CPU) is left out, not logged as 0
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_offline_run_is_written_without_a_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    writer = metrics.Writer(["wandb"], total_steps=2, run_dir=tmp_path, config={"seq_len": 64})
    for record in RECORDS:
        writer.write(record)
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").rglob("*"))
    assert b"train/tokens_per_s" in runs[0].read_bytes()


def test_unknown_sinks_missing_packages_and_missing_run_dir_are_refused(tmp_path, monkeypatch):
    assert metrics.sink_problem(["console", "jsonl"]) is None
    assert "'csv' is not one of" in metrics.sink_problem(["console", "csv"])
    assert "must be a list of names" in metrics.sink_problem("console")
    assert "names a sink twice" in metrics.sink_problem(["jsonl", "jsonl"])
    monkeypatch.setitem(metrics._OPTIONAL, "wandb", ("ringfa4_no_such_package", "ringfa4[wandb]"))
    assert metrics.sink_problem(["wandb"]) == ('wandb needs the ringfa4_no_such_package package: '
                                               'pip install "ringfa4[wandb]"')
    with pytest.raises(ValueError, match="write into the run directory, but none was given"):
        metrics.Writer(["console", "jsonl"], total_steps=2, run_dir=None)


def test_training_run_writes_jsonl_and_tensorboard_events(tmp_path):
    """`ringfa4-train train.metrics=[console,jsonl,tensorboard]` on two gloo workers (CPU)."""
    import subprocess
    import sys

    from train_configs import SMALL

    sinks = "[console,jsonl,tensorboard]" if importlib.util.find_spec("tensorboard") else "[console,jsonl]"
    proc = subprocess.run([sys.executable, "-m", "ringfa4.train", *SMALL, "train.steps=3", f"train.metrics={sinks}",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    if "tensorboard" in sinks:
        scalars = tensorboard_scalars(tmp_path / "tensorboard")
        assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records]
        assert [step for step, _ in scalars["train/grad_norm"]] == [1, 2, 3]


def test_a_sink_that_cannot_run_stops_the_run_before_it_starts(tmp_path):
    from train_configs import composed
    from ringfa4.train.config import ConfigError

    with pytest.raises(ConfigError, match="train.metrics 'csv' is not one of"):
        composed("train.metrics=[console,csv]")
