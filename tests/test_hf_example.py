"""examples/hf_finetune.py under torchrun on two gloo ranks: the first step's loss is the loss of the
same tiny transformers Llama on the same sequences in one process (with --packed-documents: on each
document of them run alone), and a run resumed from a DCP checkpoint continues with the losses of the
uninterrupted run. Needs the hf extra.

Tolerance: the example trains in fp32, where the ring's blockwise softmax and transformers' SDPA
round differently, by 0.4-1.4e-7 relative on this tiny model's first loss (about one fp32 ulp);
1e-6 leaves room for that, and documents seeing each other move the loss by over 100 times more
(8.7e-4 on the packed batch: the randomly initialised model attends almost uniformly), which the
packed test checks, so that a mask that leaked would fail it."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_finetune.py"
ARGS = ["--seq-len", "64", "--global-batch", "2", "--steps", "4", "--checkpoint-interval", "2", "--backend", "torch"]
# Sequences long enough to hold several of the shipped corpus's documents (165-378 bytes each).
PACKED = ["--packed-documents", "--seq-len", "512"]
TOLERANCE = 1e-6


def load_example():
    spec = importlib.util.spec_from_file_location("hf_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(run_dir, *extra):
    run_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE), *ARGS,
           "--run-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "ckpt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def first_batch_in_one_process(*extra):
    """What rank 0 builds (seeded tiny Llama, transformers' SDPA) and the first global batch:
    input_ids and position_ids (None without --packed-documents)."""
    example = load_example()
    args = example.parse_args([*ARGS, *extra])
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(example.tiny_config(), attn_implementation="sdpa",
                                                          dtype=torch.float32)
    stream, ends = example.token_stream(args, model.config.vocab_size)
    sampler = example.data.StreamSampler(stream, args.seq_len, args.seed)
    return model, example.load_batch(sampler, ends, 0, args.global_batch, args.seq_len, model.config.vocab_size)


def first_step_loss_in_one_process():
    model, (input_ids, _) = first_batch_in_one_process()
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()


def loss_sum(model, tokens):
    """Summed next-token loss of one sequence (its last token unscored), and how many tokens it scores."""
    logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    return F.cross_entropy(logits[:-1], tokens[1:], reduction="sum"), len(tokens) - 1


def packed_losses_in_one_process():
    """The first global batch's loss over its documents run one by one, and the loss of the same
    scored tokens with every row run whole (documents seeing the ones before them)."""
    model, (input_ids, position_ids) = first_batch_in_one_process(*PACKED)
    starts = position_ids == 0
    apart, apart_count, across = 0.0, 0, 0.0
    with torch.no_grad():
        for tokens, row_starts in zip(input_ids, starts):
            cuts = row_starts.nonzero().flatten().tolist() + [len(tokens)]
            docs = [tokens[a:b] for a, b in zip(cuts, cuts[1:])]
            assert len(docs) >= 3, "the test needs rows of several documents"
            assert all(bytes(d[-2:].tolist()) == b"\n\n" for d in docs[:-1]), "a document ends at a blank line"
            for doc in docs:
                total, count = loss_sum(model, doc)
                apart, apart_count = apart + total.item(), apart_count + count
            logits = model(input_ids=tokens[None], use_cache=False).logits[0]
            labels = tokens[1:].masked_fill(row_starts[1:], -100)  # a document's last token is not scored
            across += F.cross_entropy(logits[:-1], labels, reduction="sum", ignore_index=-100).item()
    return apart / apart_count, across / apart_count


def test_example_matches_one_process_and_resumes_with_the_same_losses(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    stdout, losses = run_example(first)
    assert "2 rank(s) on cpu, dp_shard=1 x cp=2 (zigzag), tiny random Llama" in stdout
    assert sorted(losses) == [1, 2, 3, 4]
    assert abs(losses[1] - first_step_loss_in_one_process()) <= TOLERANCE * losses[1]

    # Resume from step 2's checkpoint: steps 3 and 4 must repeat the uninterrupted run's losses.
    shutil.copytree(first / "ckpt" / "step_00000002", second / "ckpt" / "step_00000002")
    stdout, resumed = run_example(second, "--resume")
    assert "resumed at step 2" in stdout
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - losses[step]) <= 1e-6 * losses[step], (step, resumed[step], losses[step])


def test_packed_documents_match_each_document_run_alone_and_resume_with_the_same_losses(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    stdout, losses = run_example(first, *PACKED)
    assert "dp_shard=1 x cp=2 (zigzag), tiny random Llama, seq_len=512, global batch 2, packed documents" in stdout
    apart, across = packed_losses_in_one_process()
    assert abs(losses[1] - apart) <= TOLERANCE * apart, (losses[1], apart)
    assert abs(across - apart) > 100 * TOLERANCE * apart, "the batch must tell a leaky mask from a tight one"

    shutil.copytree(first / "ckpt" / "step_00000002", second / "ckpt" / "step_00000002")
    stdout, resumed = run_example(second, *PACKED, "--resume")
    assert "resumed at step 2" in stdout
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - losses[step]) <= 1e-6 * losses[step], (step, resumed[step], losses[step])


@pytest.mark.parametrize("layout, cp, mesh", [("document_zigzag", "2", "dp_shard=1 x cp=2"),
                                              ("zigzag", "1", "dp_shard=2 x cp=1")])
def test_packed_documents_first_loss_matches_each_document_run_alone(tmp_path, layout, cp, mesh):
    stdout, losses = run_example(tmp_path / "run", *PACKED, "--layout", layout, "--cp", cp, "--steps", "1")
    assert f"{mesh} ({layout})" in stdout and "packed documents" in stdout
    apart, _ = packed_losses_in_one_process()
    assert abs(losses[1] - apart) <= TOLERANCE * apart, (losses[1], apart)


def test_document_zigzag_needs_packed_documents(capsys):
    with pytest.raises(SystemExit):
        load_example().parse_args(["--layout", "document_zigzag"])
    assert "--layout document_zigzag follows the documents: it needs --packed-documents" in capsys.readouterr().err


def test_packed_documents_of_a_model_end_every_text_file_with_its_eos_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"[UNK]": 0, "</s>": 1, "the": 2, "owl": 3, "fox": 4, "slept": 5}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the owl slept")
    (tmp_path / "b.txt").write_text("the fox")
    example = load_example()
    given = ["--model", str(tmp_path / "model"), "--text", str(tmp_path / "*.txt")]

    stream, ends = example.token_stream(example.parse_args(given), len(words))
    assert stream.tokens.tolist() == [2, 3, 5, 2, 4] and ends is None
    stream, ends = example.token_stream(example.parse_args([*given, "--packed-documents"]), len(words))
    assert stream.tokens.tolist() == [2, 3, 5, 1, 2, 4, 1]
    assert ends.positions(stream.tokens[None]).tolist() == [[0, 1, 2, 3, 0, 1, 2]]
