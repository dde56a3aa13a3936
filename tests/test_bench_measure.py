"""The measurement layer (bench/measure.py) and the FLOP count (ringfa4/flops.py) on CPU."""
import json
import time
from collections import Counter

import pytest
import torch

from bench import measure
from ringfa4 import flops


def test_attention_flops_count_two_products_per_head_halved_under_the_causal_mask():
    # q k^T and p v: 2 * sq * sk * d each, per batch and head.
    assert flops.attention(2, 8, 16, 3, 4, causal=False) == 2 * 3 * (2 * 8 * 16 * 4) * 2
    assert flops.attention(2, 8, 8, 3, 4, causal=True) == flops.attention(2, 8, 8, 3, 4, causal=False) / 2


def test_backward_counts_two_and_a_half_forwards():
    fwd = flops.attention(1, 1024, 2048, 32, 128, False)
    assert flops.attention(1, 1024, 2048, 32, 128, False, "bwd") == 2.5 * fwd
    assert flops.attention(1, 1024, 2048, 32, 128, False, "fwd+bwd") == 3.5 * fwd
    assert flops.tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_packed_documents_hide_the_causal_pairs_across_their_boundaries():
    # Two rows of 8 tokens, end to end: documents of 3 and 5 tokens, then one of 8.
    assert flops.hidden_pairs([0, 3, 8, 16], 8) == 2 * 36 - (6 + 15 + 36)
    assert flops.hidden_pairs([0, 8], 8) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(direction="backward"), "direction must be one of"),
    (dict(seq_q=1.5), "seq_q must be a non-negative int"),
])
def test_bad_flop_arguments_are_named(kwargs, message):
    args = dict(batch=1, seq_q=8, seq_k=8, heads=2, head_dim=4, causal=False) | kwargs
    with pytest.raises(ValueError, match=message):
        flops.attention(**args)


def test_timer_takes_turns_in_alternating_orders_and_makes_the_asked_calls():
    calls = []

    def fn(name, seconds):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run

    timer = measure.Timer("cpu", rounds=3, warmup=1, iters=2, reduce="min")
    short, long = timer(fn("short", 0.001), fn("long", 0.02))
    # warm-up: one call each in turn, then an untimed round of whole turns; then per round two
    # calls of one, then two of the other, the round's first turn moving one place each round
    assert calls == ["short", "long"] + ["short", "short", "long", "long"] + [
        "short", "short", "long", "long"] + ["long", "long", "short", "short"] + ["short", "short", "long", "long"]
    assert 1 <= short < 10 < 20 <= long < 60


@pytest.mark.parametrize("n", range(1, 9))
def test_turn_orders_give_every_fn_each_place_and_each_predecessor_equally_often(n):
    design = measure.turn_orders(n, n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in design)
    places = Counter((fn, place) for order in design for place, fn in enumerate(order))
    pairs = Counter(pair for order in design for pair in zip(order, order[1:]))
    assert len(places) == n * n and len(set(places.values())) == 1
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    assert measure.turn_orders(n, 3 * len(design)) == design * 3


def test_timer_turn_ms_fills_each_turn_by_the_warm_up_estimate():
    counts = {"fast": 0, "slow": 0}

    def fn(name, seconds):
        def run():
            counts[name] += 1
            time.sleep(seconds)
        return run

    timer = measure.Timer("cpu", rounds=2, warmup=1, turn_ms=40, reduce="median")
    timer(fn("fast", 0), fn("slow", 0.05))
    # one call over 40 ms fills a turn: the warm-up call, the settling turn, two timed turns
    assert timer.calls[1] == 1 and counts["slow"] == 1 + 1 + 2
    # A no-op's estimate is microseconds; >= 2 holds even when a busy machine stalls the warm-up call.
    assert timer.calls[0] >= 2 and counts["fast"] == 1 + 3 * timer.calls[0]


def test_timer_refuses_turn_ms_across_ranks_and_bad_counts():
    with pytest.raises(ValueError, match="turn_ms needs"):
        measure.Timer("cpu", turn_ms=10, group=object())
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        measure.Timer("cpu", rounds=0)
    with pytest.raises(ValueError, match="reduce must be one of"):
        measure.Timer("cpu", reduce="mean")


def _args(*argv):
    p = measure.parser("test")
    return p, p.parse_args(argv)


def test_rows_go_to_a_new_temporary_directory_unless_asked(tmp_path):
    _, args = _args()
    out = measure.output_dir(args)
    assert out.is_dir() and out.resolve() != measure.RESULTS.resolve()
    assert measure.output_dir(_args("--out-dir", str(tmp_path / "x"))[1]) == tmp_path / "x"
    assert measure.output_dir(_args("--record")[1]) == measure.RESULTS


def test_record_is_refused_for_a_smoke_run():
    p, args = _args("--record")
    with pytest.raises(SystemExit):
        measure.check_output_args(p, args, smoke=True)
    measure.check_output_args(p, args, smoke=False)


def test_rows_file_holds_every_row_added_so_far(tmp_path):
    rows = measure.Rows(tmp_path / "r.json")
    rows.add({"a": 1})
    rows.add({"a": 2})
    assert json.loads((tmp_path / "r.json").read_text()) == [{"a": 1}, {"a": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_metadata_names_device_commit_and_time():
    meta = measure.metadata("cpu", "abc123", world=2)
    assert meta["device"] == "cpu" and meta["commit"] == "abc123" and meta["world"] == 2
    assert meta["date"].endswith("UTC") and meta["torch"]
    assert measure.metadata("cpu")["commit"] == measure.git_commit() != ""


def test_sdpa_layout_repeats_kv_heads_for_grouped_query_attention():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    qt, kt, vt = measure.sdpa_layout(q, k, v)
    assert qt.shape == kt.shape == vt.shape == (1, 4, 8, 16)
    assert torch.equal(kt[:, 0], kt[:, 1]) and torch.equal(kt[:, 0], k[:, :, 0])
    out = measure.sdpa(qt, kt, vt, causal=True).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                                           enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2))
