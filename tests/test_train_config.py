"""Bad training settings fail before any worker starts, with a message naming the setting."""
import pytest
import torch
from hydra.errors import ConfigCompositionException

from ringfa4.train import config, data
from ringfa4.train.config import ConfigError
from train_configs import composed


def resolve(*overrides, world=2, device="cpu"):
    return config.resolve(composed(*overrides), world, device)


def sampler(*overrides, seq_len=64, vocab_size=256):
    job = composed(*overrides)
    return data.build_sampler(job.data, seq_len, vocab_size, 0)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.cp=2", "train.seq_len=250"], 2, r"train.seq_len=250 must be a multiple of 4 \(2 \* parallel.cp\) for layout zigzag"),
    (["parallel.cp=4", "parallel.layout=contiguous", "train.seq_len=250"], 4, r"train.seq_len=250 must be a multiple of 4 \(parallel.cp\)"),
    (["model.n_heads=4", "model.n_kv_heads=3"], 2, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    (["parallel.cp=2", "parallel.dp_shard=2"], 2, r"parallel.cp \* parallel.dp_shard = 2 \* 2 = 4 must equal the world size 2"),
    (["parallel.cp=3", "parallel.dp_shard=-1"], 4, "world size 4 is not a multiple of parallel.cp=3"),
    (["parallel.cp=-1", "parallel.dp_shard=-1"], 2, "at most one of parallel.cp and parallel.dp_shard"),
    (["parallel.cp=1", "parallel.dp_shard=-1", "train.global_batch=3"], 2, "train.global_batch=3 must be a multiple of parallel.dp_shard=2"),
    (["parallel.layout=striped"], 2, "parallel.layout must be one of zigzag, contiguous, document_zigzag, document_balanced; got 'striped'"),
    (["parallel.backend=magic"], 2, "parallel.backend must be one of auto, "),
    (["train.mixed_precision=fp8"], 2, "train.mixed_precision must be one of auto, bf16, fp32; got 'fp8'"),
    (["train.resume=true"], 2, "train.resume=true needs train.checkpoint_dir"),
    (["train.grad_clip=-1"], 2, r"train.grad_clip must be > 0 \(or null: no clipping\), got -1.0"),
    (["train.grad_clip=0"], 2, r"train.grad_clip must be > 0"),
    (["train.weight_decay=-1"], 2, "train.weight_decay must be >= 0, got -1.0"),
    (["train.betas=[1.5,0.95]"], 2, r"train.betas must be two values in \[0, 1\), got \[1.5, 0.95\]"),
    (["train.betas=[0.9,1.0]"], 2, r"train.betas must be two values in \[0, 1\)"),
    (["train.betas=[0.9]"], 2, r"train.betas must be two values in \[0, 1\)"),
    (["train.lr=0"], 2, r"need train.lr > 0"),
    (["train.warmup_steps=20", "train.steps=10"], 2, r"train.warmup_steps must be in \[0, train.steps=10\]"),
    (["train.checkpoint_keep=-1"], 2, "train.checkpoint_keep must be >= 0"),
    (["train.device=tpu"], 2, "train.device must be one of auto, cuda, cpu"),
    (["train.activation_checkpointing=true"], 2, "train.activation_checkpointing must be one of none, pointwise, selective, full"),
    (["data.kind=parquet"], 2, "data.kind must be one of synthetic, text, tokens"),
])
def test_bad_setting_is_named(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*overrides, world=world)


def test_auto_dimension_takes_the_rest_of_the_world():
    s = resolve("parallel.cp=2", "parallel.dp_shard=-1", "train.global_batch=8", world=8)
    assert (s.cp, s.dp_shard, s.local_batch) == (2, 4, 2)
    s = resolve(world=2)
    assert (s.cp, s.dp_shard, s.param_dtype) == (2, 1, None)


def test_a_value_of_the_wrong_type_is_refused_while_composing():
    with pytest.raises(ConfigCompositionException, match="train.steps=many"):
        composed("train.steps=many")


def test_short_run_scales_the_default_warmup_and_keeps_an_explicit_one():
    assert composed().train.warmup == 15  # the default run: a tenth of its 150 steps
    assert composed("train.steps=8").train.warmup == 0
    assert composed("train.steps=40").train.warmup == 4
    assert composed("train.steps=8", "train.warmup_steps=3").train.warmup == 3


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
    with pytest.raises(FileNotFoundError, match=r"data.paths entry .*nothing\*.txt.* matches no file"):
        sampler(f"data.paths=[{tmp_path}/nothing*.txt]")


def test_one_path_without_brackets_is_one_path(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 100)
    assert composed(f"data.paths={tmp_path}/a.txt").data.paths == [f"{tmp_path}/a.txt"]
    assert len(sampler(f"data.paths={tmp_path}/a.txt", seq_len=9).stream) == 100


def test_empty_text_file_is_named(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match=r"data.paths .*empty.txt.*: the 1 file\(s\) it names are empty"):
        sampler(f"data.paths={tmp_path}/empty.txt")


def test_directory_as_text_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data.paths entry .* matches the directory .*: name files, or a glob"):
        sampler(f"data.paths={tmp_path}")


@pytest.mark.parametrize("name", ["train.bin", "folder"])
def test_missing_token_file_or_directory_is_named(tmp_path, name):
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match=f"data.path .*{name}.* is not a file"):
        sampler("data=tokens", f"data.path={tmp_path}/{name}")


def test_empty_token_file_is_named(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data.path .*empty.bin.* has 0 bytes, not a positive multiple of 2"):
        sampler("data=tokens", f"data.path={tmp_path}/empty.bin")


def test_token_kind_needs_a_path():
    with pytest.raises(ConfigError, match=r"data=tokens needs data.path \(the token file\)"):
        composed("data=tokens")


def test_text_shorter_than_a_sequence_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(ValueError, match=r"holds 5 tokens, fewer than train.seq_len \+ 1 = 65"):
        sampler(f"data.paths=[{tmp_path}/a.txt]")


def test_text_vocabulary_must_fit_the_model():
    with pytest.raises(ValueError, match="data.kind=text has 256 token ids but model.vocab_size=100"):
        sampler(vocab_size=100)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_the_file_contents(tmp_path, dtype):
    tokens = torch.randperm(60000, generator=torch.Generator().manual_seed(0))[:1000]
    (tmp_path / "train.bin").write_bytes(bytes(tokens.to(data.TOKEN_DTYPES[dtype]).untyped_storage()))
    windows = sampler("data=tokens", f"data.path={tmp_path}/train.bin", f"data.dtype={dtype}", seq_len=99,
                      vocab_size=65536)
    starts = set()
    for i in range(2 * windows.windows):
        window = windows[i]
        start = int((tokens == window[0]).nonzero()[0])  # ids are distinct: the first one locates the window
        assert torch.equal(window, tokens[start:start + 100])
        starts.add(start)
    assert starts == {99 * w for w in range(10)}  # each epoch visits every window once
    with pytest.raises(ValueError, match="is not below model.vocab_size=1000"):
        data.load_samples(windows, 0, 2, 1000)


def test_token_file_size_must_match_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"has 7 bytes, not a positive multiple of 2 \(data.dtype=uint16\)"):
        sampler("data=tokens", f"data.path={tmp_path}/odd.bin", "data.dtype=uint16", seq_len=2, vocab_size=65536)
