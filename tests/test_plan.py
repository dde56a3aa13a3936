"""The ring performance model (python -m ringfa4.plan): its arithmetic, calibration and command line."""
import json
import math
from dataclasses import replace

import pytest

from ringfa4 import plan


def _shape(seq=32768, heads=32, kv_heads=8, causal=True):
    return plan.Shape(heads, kv_heads, 128, seq, causal, 2)


def test_link_fit_recovers_latency_and_bandwidth():
    latency_ms, gbps = 0.05, 300.0
    points = [(b, latency_ms + b / (gbps * 1e9) * 1e3) for b in (1 << 24, 1 << 26, 1 << 28)]
    link = plan.fit_link("test", points, "synthetic")
    assert link.gbps == pytest.approx(gbps, rel=1e-9) and link.latency_ms == pytest.approx(latency_ms, rel=1e-9)
    assert link.ms(1 << 27) == pytest.approx(latency_ms + (1 << 27) / (gbps * 1e9) * 1e3)


def test_nvlink_default_reproduces_the_measured_exchange_rates_within_10_percent():
    link = plan.presets()["h200-x2"].nvlink
    for nbytes, gbps in plan.NVLINK4_EXCHANGE:
        assert nbytes / (link.ms(nbytes) * 1e-3) / 1e9 == pytest.approx(gbps, rel=0.1)


def test_kernel_tflops_interpolate_in_log_length_and_clamp_outside_the_table():
    gpu = plan.presets()["h200-x2"].gpu
    (s0, t0), (s1, t1) = plan.FA4_H200[("fwd", True)][1:3]
    assert gpu.kernel_tflops("fwd", True, math.sqrt(s0 * s1)) == pytest.approx((t0 + t1) / 2)
    assert gpu.kernel_tflops("fwd", True, 10) == plan.FA4_H200[("fwd", True)][0][1]
    assert gpu.kernel_tflops("fwd", True, 1 << 30) == plan.FA4_H200[("fwd", True)][-1][1]


def test_single_gpu_time_is_flops_over_the_tables_tflops():
    topo, shape = plan.presets()["h200-x2"], _shape(seq=16384, heads=32)
    flops = 4 * 16384**2 * 32 * 128 / 2
    expected = flops / 603e12 * 1e3 + 2.5 * flops / 590e12 * 1e3  # H200 FA4 causal fwd / bwd at 16k
    assert plan.single_ms(topo, shape) == pytest.approx(expected)


def test_a_slow_link_makes_the_ring_as_slow_as_its_transfers():
    topo = plan.presets()["ib-400g"]
    slow = replace(topo, network=replace(topo.network, gbps=0.01))  # 10 MB/s: transfers dominate
    p = plan.predict(slow, _shape(seq=8192), 4)
    # forward: kv during steps 0-2, step 3 computes alone; backward (remote blocks first, local last):
    # kv during steps 0-1, the previous step's dK/dV during steps 1-3.
    transfers = 3 * p.kv_ms + p.kv_ms + (p.kv_ms + p.dkv_ms) + 2 * p.dkv_ms
    assert p.ring_ms == pytest.approx(transfers + p.fwd_compute[-1] + p.extra_ms)
    assert p.efficiency < 0.01


def test_longer_sequences_hide_more_and_approach_kernel_efficiency():
    topo = plan.presets()["gb200-nvl72"]
    effs = [plan.predict(topo, _shape(seq=s), 8).efficiency for s in (1 << 14, 1 << 16, 1 << 18, 1 << 20)]
    assert effs == sorted(effs) and effs[0] < 0.8 < effs[-1]


def test_hiding_chunk_is_the_smallest_length_whose_compute_covers_every_transfer():
    topo, shape = plan.presets()["ib-400g"], _shape()
    chunk = plan.hiding_chunk(topo, shape, 2)

    def hidden(local):
        p = plan.predict(topo, replace(shape, seq=2 * local), 2)  # W=2: fwd step 0 kv, bwd step 1 dK/dV
        return p.fwd_compute[0] >= p.kv_ms and p.bwd_compute[1] >= p.dkv_ms

    assert chunk % 256 == 0 and hidden(chunk) and not hidden(chunk - 256)


def test_results_files_calibrate_kernels_and_link_of_their_gpu_only(tmp_path):
    kernels = [dict(device="NVIDIA H200", direction=d, hdim=128, seq=s, causal=c, fa4_tflops=100.0 + s / 1024)
               for d in ("fwd", "bwd") for c in (False, True) for s in (2048, 8192)]
    kernels.append(dict(kernels[0], device="NVIDIA H100 80GB HBM3", fa4_tflops=1.0))
    ring = [dict(device="NVIDIA H200", world=2, kv_bytes_per_step=b, step_ms=dict(fwd_kv=[0.1 + b / 200e6]))
            for b in (1 << 24, 1 << 26)]
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    (tmp_path / "ring.json").write_text(json.dumps(ring))
    topo = plan.calibrate(plan.presets()["h200-x2"], plan._rows(str(tmp_path)), "fa4", 128)
    assert topo.gpu.tflops[("bwd", True)] == ((2048, 102.0), (8192, 108.0))
    assert "kernels.json" in topo.gpu.source
    assert topo.nvlink.gbps == pytest.approx(200.0) and topo.nvlink.latency_ms == pytest.approx(0.1)
    assert "ring.json" in topo.nvlink.source
    untouched = plan.calibrate(plan.presets()["gb200-nvl72"], plan._rows(str(tmp_path)), "fa4", 128)
    assert untouched == plan.presets()["gb200-nvl72"]


def test_measured_ring_rows_are_printed_beside_the_prediction(tmp_path, capsys):
    row = dict(device="NVIDIA H200", world=2, seq=32768, causal=True, heads=32, kv_heads=8, head_dim=128,
               dtype="bfloat16", backend="fa4", efficiency=0.9, ringfa4_ms=30.0, single_ms=54.0)
    (tmp_path / "ring.json").write_text(json.dumps([row]))
    plan.main(["--preset", "h200-x2", "--results", str(tmp_path), "--worlds", "2"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:2] == ["fa4", "32768"])
    p = plan.predict(plan.presets()["h200-x2"], _shape(), 2)
    assert f"0.900 | {p.efficiency:.3f} ({p.efficiency / 0.9 - 1:+6.1%})" in line
    assert f"30.00 | {p.ring_ms:7.2f}" in line and f"54.00 | {p.single_ms:7.2f}" in line


def test_a_step_runs_at_the_kernel_speed_of_its_own_loop_length():
    gpu, shape = plan.presets()["h200-x2"].gpu, _shape()
    flops = 4 * 4096 * 8192 * 32 * 128
    # forward: one CTA per query tile loops over the keys; backward: one per key tile, over the queries
    assert plan._kernel_ms(gpu, shape, "fwd", 4096, 8192, False) == pytest.approx(
        flops / gpu.kernel_tflops("fwd", False, 8192) / 1e9)
    assert plan._kernel_ms(gpu, shape, "bwd", 4096, 8192, False) == pytest.approx(
        2.5 * flops / gpu.kernel_tflops("bwd", False, 4096) / 1e9)


def test_the_model_takes_each_ranks_steps_from_the_rings_schedule():
    shape = _shape(seq=16384)  # W = 2: L = 8192 tokens per rank in two chunks of 4096
    assert plan._rank_steps(shape, 2, 0) == [(8192, 8192, True), (4096, 8192, False)]
    assert plan._rank_steps(shape, 2, 1) == [(8192, 8192, True), (8192, 4096, False)]
    assert plan._rank_steps(replace(shape, causal=False), 2, 1) == [(8192, 8192, False)] * 2


def test_kernel_curves_keep_the_best_reading_at_or_below_each_length(tmp_path):
    rows = [dict(device="NVIDIA H200", direction=d, hdim=128, seq=s, causal=c, fa4_tflops=t, _file="kernels.json")
            for d in ("fwd", "bwd") for c in (False, True) for s, t in ((4096, 500.0), (8192, 600.0), (16384, 550.0))]
    topo = plan.calibrate(plan.presets()["h200-x2"], rows, "fa4", 128)
    assert topo.gpu.tflops[("bwd", True)] == ((4096, 500.0), (8192, 600.0), (16384, 600.0))


def _timeline_rows(topo, overhead, slope, seqs=(16384, 32768, 65536)):
    """ring.json rows whose every step took overhead + slope * (the model's kernel + memory time)."""
    rows = []
    for seq in seqs:
        shape = _shape(seq=seq)
        by_rank = []
        for rank in range(2):
            fwd, bwd, _ = plan._rank_ms(topo, shape, 2, plan._rank_steps(shape, 2, rank))
            by_rank.append(dict(fwd_compute=[overhead[0] + slope * t for t in fwd],
                                bwd_compute=[overhead[1] + slope * t for t in bwd]))
        rows.append(dict(device="NVIDIA H200", world=2, seq=seq, causal=True, heads=32, kv_heads=8, head_dim=128,
                         dtype="bfloat16", backend="fa4", step_ms_by_rank=by_rank, _file="ring.json"))
    return rows


def test_step_overhead_is_the_intercept_of_the_measured_step_times():
    topo = plan.presets()["h200-x2"]
    rows = _timeline_rows(topo, overhead=(0.2, 0.3), slope=1.05)
    overhead, slope, n = plan.fit_step_overhead(topo, rows)
    assert overhead == pytest.approx((0.2, 0.3)) and slope == pytest.approx((1.05, 1.05)) and n == 3 * 2 * 4
    rows[0]["step_ms_by_rank"][1]["bwd_compute"][0] += 5.0  # one slow step does not move the line
    assert plan.fit_step_overhead(topo, rows)[0] == pytest.approx((0.2, 0.3))


def test_a_negative_intercept_is_no_step_overhead():
    topo = plan.presets()["h200-x2"]
    overhead, slope, _ = plan.fit_step_overhead(topo, _timeline_rows(topo, overhead=(-0.4, 0.1), slope=1.03))
    assert overhead == (0.0, pytest.approx(0.1)) and slope == pytest.approx((1.03, 1.03))


def test_calibrated_overhead_is_added_to_every_ring_step_but_not_to_the_1_gpu_call():
    topo = plan.presets()["h200-x2"]
    fitted = plan.calibrate(topo, _timeline_rows(topo, overhead=(0.2, 0.3), slope=1.0), "fa4", 128)
    assert fitted.step_overhead_ms == pytest.approx((0.2, 0.3)) and "ring.json" in fitted.overhead_source
    shape = _shape(seq=65536)
    bare, charged = plan.predict(topo, shape, 2), plan.predict(fitted, shape, 2)
    assert [b - a for a, b in zip(bare.fwd_compute + bare.bwd_compute, charged.fwd_compute + charged.bwd_compute)] \
        == pytest.approx([0.2, 0.2, 0.3, 0.3])
    assert charged.single_ms == bare.single_ms


def test_calibrated_kernel_speed_scales_the_ring_steps_and_the_1_gpu_call_alike():
    topo, shape = plan.presets()["h200-x2"], _shape(seq=65536)
    fitted = plan.calibrate(topo, _timeline_rows(topo, overhead=(0.0, 0.0), slope=1.05), "fa4", 128)
    assert fitted.kernel_scale == pytest.approx((1.05, 1.05))
    bare, scaled = plan.predict(topo, shape, 2), plan.predict(fitted, shape, 2)
    assert scaled.single_ms == pytest.approx(1.05 * bare.single_ms)
    # kernels 5% slower, the memory-bound passes inside the steps as fast as before
    ratios = [b / a for a, b in zip(bare.fwd_compute + bare.bwd_compute, scaled.fwd_compute + scaled.bwd_compute)]
    assert all(1.0 < r <= 1.05 + 1e-9 for r in ratios), ratios


def test_a_fixed_step_overhead_does_not_count_as_hiding_transfers():
    topo, shape = plan.presets()["ib-400g"], _shape()
    slow_steps = replace(topo, step_overhead_ms=(100.0, 100.0))  # longer than any transfer
    assert plan.hiding_chunk(slow_steps, shape, 2) == plan.hiding_chunk(topo, shape, 2)


def test_cli_covers_every_preset_up_to_two_racks(tmp_path, capsys):
    plan.main(["--seq", str(9 << 17), "--results", str(tmp_path)])  # divides into 2 x 576 chunks
    out = capsys.readouterr().out
    for name in plan.presets():
        assert f"== {name}:" in out
    assert "smallest local chunk" in out and " 144 " in out and " 72 " in out and " 576 " in out


def test_worlds_the_sequence_does_not_divide_are_reported_not_dropped(tmp_path, capsys):
    plan.main(["--preset", "gb200-nvl72", "--seq", str(1 << 20), "--worlds", "8,72", "--results", str(tmp_path)])
    assert "W=72: seq 1048576 is not a multiple of 144" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--heads", "32", "--kv-heads", "5"], "--heads (32) must be a multiple of --kv-heads (5)"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--preset", "tpu"], "--preset must be one of"),
    (["--worlds", "1,2"], "--worlds must all be >= 2"),
    (["--seq", "0"], "--seq must be positive"),
])
def test_bad_arguments_are_named_in_the_error(argv, needle, capsys):
    with pytest.raises(SystemExit):
        plan.main(argv)
    assert needle in capsys.readouterr().err


def test_presets_without_a_timeline_of_their_gpu_assume_the_measured_overhead(tmp_path, capsys):
    topo = plan.presets()["h200-x2"]
    (tmp_path / "ring.json").write_text(json.dumps(_timeline_rows(topo, overhead=(0.2, 0.3), slope=1.0)))
    plan.main(["--preset", "all", "--results", str(tmp_path), "--worlds", "8"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "per-step overhead 0.200 ms forward, 0.300 ms" in ln]
    assert len(lines) == len(plan.presets()) and sum("assumed as on H200" in ln for ln in lines) == len(lines) - 1
