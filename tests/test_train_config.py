"""Bad training settings fail before any worker starts, with a message naming the setting."""
import pytest
import torch

from ringfa4.train import config, data
from ringfa4.train.config import ConfigError
from train_configs import composed


def resolve(*overrides, world=2, device="cpu"):
    return config.resolve(composed(*overrides), world, device)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.cp=2", "train.seq_len=250"], 2, r"train.seq_len=250 must be a multiple of 4 \(2 \* parallel.cp\) for layout zigzag"),
    (["parallel.cp=4", "parallel.layout=contiguous", "train.seq_len=250"], 4, r"train.seq_len=250 must be a multiple of 4 \(parallel.cp\)"),
    (["model.n_heads=4", "model.n_kv_heads=3"], 2, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    (["parallel.cp=2", "parallel.dp_shard=2"], 2, r"parallel.cp \* parallel.dp_shard = 2 \* 2 = 4 must equal the world size 2"),
    (["parallel.cp=3", "parallel.dp_shard=-1"], 4, "world size 4 is not a multiple of parallel.cp=3"),
    (["parallel.cp=-1", "parallel.dp_shard=-1"], 2, "at most one of parallel.cp and parallel.dp_shard"),
    (["parallel.cp=1", "parallel.dp_shard=-1", "train.global_batch=3"], 2, "train.global_batch=3 must be a multiple of parallel.dp_shard=2"),
    (["parallel.layout=striped"], 2, "parallel.layout must be one of"),
    (["parallel.backend=magic"], 2, "parallel.backend must be one of"),
    (["train.mixed_precision=fp8"], 2, "train.mixed_precision must be auto, bf16 or fp32"),
    (["train.resume=true"], 2, "train.resume=true needs train.checkpoint_dir"),
])
def test_bad_setting_is_named(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*overrides, world=world)


def test_auto_dimension_takes_the_rest_of_the_world():
    s = resolve("parallel.cp=2", "parallel.dp_shard=-1", "train.global_batch=8", world=8)
    assert (s.cp, s.dp_shard, s.local_batch) == (2, 4, 2)
    s = resolve(world=2)
    assert (s.cp, s.dp_shard, s.param_dtype) == (2, 1, None)


def test_existing_checkpoints_need_resume(tmp_path):
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "COMPLETE").write_text("10\n")
    with pytest.raises(ConfigError, match=r"train.checkpoint_dir=.* already holds checkpoints of steps \[10\]"):
        resolve(f"train.checkpoint_dir={tmp_path}")
    resolve(f"train.checkpoint_dir={tmp_path}", "train.resume=true")


@pytest.mark.parametrize("backend", ["cute", "fa4"])
def test_gpu_backend_on_cpu_is_refused_naming_the_setting(backend):
    settings = resolve(f"parallel.backend={backend}")
    with pytest.raises(ConfigError, match=f"parallel.backend={backend} cannot run this model on cpu: {backend}: "):
        config.check_backend(settings, torch.device("cpu"))


def test_auto_backend_on_cpu_is_torch():
    assert config.check_backend(resolve(), torch.device("cpu")) == "torch"


def test_missing_text_files_are_named(tmp_path):
    cfg = composed(f"data.paths=[{tmp_path}/nothing*.txt]")
    with pytest.raises(FileNotFoundError, match=r"data.paths entry .*nothing\*.txt.* matches no file"):
        data.build_sampler(cfg["data"], 64, 256, 0)


def test_missing_token_file_is_named(tmp_path):
    cfg = composed("data=tokens", f"data.path={tmp_path}/train.bin")
    with pytest.raises(FileNotFoundError, match="data.path .*train.bin.* is not a file"):
        data.build_sampler(cfg["data"], 64, 256, 0)


def test_text_shorter_than_a_sequence_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("short")
    cfg = composed(f"data.paths=[{tmp_path}/a.txt]")
    with pytest.raises(ValueError, match=r"holds 5 tokens, fewer than train.seq_len \+ 1 = 65"):
        data.build_sampler(cfg["data"], 64, 256, 0)


def test_text_vocabulary_must_fit_the_model():
    cfg = composed()
    with pytest.raises(ValueError, match="data.kind=text has 256 token ids but model.vocab_size=100"):
        data.build_sampler(cfg["data"], 64, 100, 0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_the_file_contents(tmp_path, dtype):
    tokens = torch.randperm(60000, generator=torch.Generator().manual_seed(0))[:1000]
    (tmp_path / "train.bin").write_bytes(bytes(tokens.to(data.TOKEN_DTYPES[dtype]).untyped_storage()))
    cfg = composed("data=tokens", f"data.path={tmp_path}/train.bin", f"data.dtype={dtype}")
    sampler = data.build_sampler(cfg["data"], 99, 65536, 0)
    starts = set()
    for i in range(2 * sampler.windows):
        window = sampler[i]
        start = int((tokens == window[0]).nonzero()[0])  # ids are distinct: the first one locates the window
        assert torch.equal(window, tokens[start:start + 100])
        starts.add(start)
    assert starts == {99 * w for w in range(10)}  # each epoch visits every window once
    with pytest.raises(ValueError, match="is not below model.vocab_size=1000"):
        data.load_samples(sampler, 0, 2, 1000)


def test_token_file_size_must_match_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    cfg = composed("data=tokens", f"data.path={tmp_path}/odd.bin", "data.dtype=uint16")
    with pytest.raises(ValueError, match=r"has 7 bytes, not a positive multiple of 2 \(data.dtype=uint16\)"):
        data.build_sampler(cfg["data"], 2, 65536, 0)
