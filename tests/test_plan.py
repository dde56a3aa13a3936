"""The performance model (python -m ringfa4.plan): its arithmetic, its calibration files, heads x
ring splits and the command line."""
import fnmatch
import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from ringfa4 import flops, plan

ROOT = Path(__file__).resolve().parent.parent


def _shape(seq=32768, heads=32, kv_heads=8, causal=True):
    return plan.Shape(heads, kv_heads, 128, seq, causal, 2)


def _h200(**changes):
    return replace(plan.presets()["h200-x2"], **changes)


def test_the_shipped_calibration_files_load_and_are_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ringfa4"]
    for gpu in plan.CALIBRATED_GPUS:
        path = plan.calibration_path(gpu)
        assert any(fnmatch.fnmatch(f"data/{path.name}", p) for p in patterns), path.name
        cal = plan.load_calibration(path)
        assert cal["gpu"] == gpu and set(cal["kernels"]) == {"fa4", "cute"}


def test_every_number_names_the_file_or_the_assumption_it_comes_from():
    for backend in ("fa4", "cute"):
        for topo in plan.presets(backend).values():
            for source in (topo.gpu.source, topo.nvlink.source, topo.network.source, topo.overhead_source):
                assert "calibration-h" in source or source.startswith("assumed"), source


def test_a_calibration_of_another_format_is_refused(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="calibration format 99"):
        plan.load_calibration(str(tmp_path / "c.json"))


def test_link_fit_recovers_latency_and_bandwidth():
    latency_ms, gbps = 0.05, 300.0
    points = [(b, latency_ms + b / (gbps * 1e9) * 1e3) for b in (1 << 24, 1 << 26, 1 << 28)]
    link = plan.fit_link("test", points, "synthetic")
    assert link.gbps == pytest.approx(gbps, rel=1e-9) and link.latency_ms == pytest.approx(latency_ms, rel=1e-9)


def test_kernel_tflops_interpolate_in_log_length_and_clamp_outside_the_table():
    gpu = _h200().gpu
    points = gpu.tflops[("fwd", True)]
    (s0, t0), (s1, t1) = points[1:3]
    assert gpu.kernel_tflops("fwd", True, math.sqrt(s0 * s1)) == pytest.approx((t0 + t1) / 2)
    assert gpu.kernel_tflops("fwd", True, 10) == points[0][1]
    assert gpu.kernel_tflops("fwd", True, 1 << 30) == points[-1][1]


def test_single_gpu_time_is_flops_over_the_curves_tflops():
    topo, shape = _h200(kernel_scale=(1.0, 1.0)), _shape(seq=16384)
    expected = sum(flops.attention(1, 16384, 16384, 32, 128, True, d) / topo.gpu.kernel_tflops(d, True, 16384) / 1e9
                   for d in ("fwd", "bwd"))
    assert plan.single_ms(topo, shape) == pytest.approx(expected)


def test_a_slow_link_makes_the_ring_as_slow_as_its_transfers():
    topo = plan.presets()["ib-400g"]
    slow = replace(topo, network=replace(topo.network, gbps=0.01))  # 10 MB/s: transfers dominate
    p = plan.predict(slow, _shape(seq=8192), 4)
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
        p = plan.predict(topo, replace(shape, seq=2 * local), 2)
        return p.fwd_compute[0] - topo.step_overhead_ms[0] >= p.kv_ms and \
            p.bwd_compute[1] - topo.step_overhead_ms[1] >= p.dkv_ms

    assert chunk % 256 == 0 and hidden(chunk) and not hidden(chunk - 256)


def test_the_model_takes_each_ranks_steps_from_the_rings_schedule():
    shape = _shape(seq=16384)
    assert plan._rank_steps(shape, 2, 0) == [(8192, 8192, True), (4096, 8192, False)]
    assert plan._rank_steps(shape, 2, 1) == [(8192, 8192, True), (8192, 4096, False)]


def _base():
    return plan.load_calibration(plan.calibration_path("H200"))


def test_refit_takes_kernels_and_link_of_its_gpu_only_from_the_files_given(tmp_path):
    kernels = [dict(device="NVIDIA H200", direction=d, hdim=128, seq=s, causal=c, fa4_tflops=100.0 + s / 1024)
               for d in ("fwd", "bwd") for c in (False, True) for s in (2048, 8192)]
    kernels.append(dict(kernels[0], device="NVIDIA H100 80GB HBM3", fa4_tflops=1.0))
    ring = [dict(device="NVIDIA H200", world=2, kv_bytes_per_step=b, step_ms=dict(fwd_kv=[0.1 + b / 200e6]))
            for b in (1 << 24, 1 << 26)]
    (tmp_path / "k.json").write_text(json.dumps(kernels))
    (tmp_path / "r.json").write_text(json.dumps(ring))
    cal = plan.refit(_base(), [tmp_path / "k.json", tmp_path / "r.json"])
    assert cal["kernels"]["fa4"]["tflops"]["bwd/causal"] == [[2048, 102.0], [8192, 108.0]]
    assert "k.json" in cal["kernels"]["fa4"]["source"] and "k.json" not in cal["kernels"]["cute"]["source"]
    assert cal["nvlink"]["gbps"] == pytest.approx(200.0) and cal["nvlink"]["latency_ms"] == pytest.approx(0.1)


def test_kernel_curves_keep_the_best_reading_at_or_below_each_length():
    assert plan._envelope({(4096, 500.0), (8192, 600.0), (16384, 550.0), (8192, 580.0)}) == \
        [[4096, 500.0], [8192, 600.0], [16384, 600.0]]


def _timeline_rows(topo, overhead, slope, seqs=(16384, 32768, 65536)):
    """bench/ring.py rows whose every step took overhead + slope * (the model's kernel + memory time)."""
    rows = []
    for seq in seqs:
        shape = _shape(seq=seq)
        by_rank = []
        for rank in range(2):
            fwd, bwd, _ = plan._rank_ms(topo, shape, 2, plan._rank_steps(shape, 2, rank))
            by_rank.append(dict(fwd_compute=[overhead[0] + slope * t for t in fwd],
                                bwd_compute=[overhead[1] + slope * t for t in bwd]))
        rows.append(dict(device="NVIDIA H200", world=2, seq=seq, causal=True, heads=32, kv_heads=8, head_dim=128,
                         dtype="bfloat16", backend="fa4", step_ms_by_rank=by_rank))
    return rows


def test_step_overhead_is_the_intercept_of_the_measured_step_times():
    topo = plan._bare(_base(), "fa4")
    rows = _timeline_rows(topo, overhead=(0.2, 0.3), slope=1.05)
    overhead, slope, n = plan.fit_step_overhead(topo, rows)
    assert overhead == pytest.approx((0.2, 0.3)) and slope == pytest.approx((1.05, 1.05)) and n == 3 * 2 * 4
    rows[0]["step_ms_by_rank"][1]["bwd_compute"][0] += 5.0  # one slow step does not move the line
    assert plan.fit_step_overhead(topo, rows)[0] == pytest.approx((0.2, 0.3))
    overhead, _, _ = plan.fit_step_overhead(topo, _timeline_rows(topo, overhead=(-0.4, 0.1), slope=1.03))
    assert overhead == (0.0, pytest.approx(0.1))  # a negative intercept is no overhead


def test_refit_writes_the_fitted_overhead_and_the_model_charges_it_to_every_ring_step(tmp_path):
    topo = plan._bare(_base(), "fa4")
    (tmp_path / "ring.json").write_text(json.dumps(_timeline_rows(topo, overhead=(0.2, 0.3), slope=1.0)))
    cal = plan.refit(_base(), [tmp_path / "ring.json"])
    assert cal["step_overhead"]["fa4"]["ms"] == pytest.approx([0.2, 0.3])
    bare, charged = _h200(step_overhead_ms=(0.0, 0.0)), _h200(step_overhead_ms=(0.2, 0.3))
    p0, p1 = plan.predict(bare, _shape(seq=65536), 2), plan.predict(charged, _shape(seq=65536), 2)
    assert [b - a for a, b in zip(p0.fwd_compute + p0.bwd_compute, p1.fwd_compute + p1.bwd_compute)] == \
        pytest.approx([0.2, 0.2, 0.3, 0.3])
    assert p1.single_ms == p0.single_ms


def test_a_fixed_step_overhead_does_not_count_as_hiding_transfers():
    topo, shape = plan.presets()["ib-400g"], _shape()
    assert plan.hiding_chunk(replace(topo, step_overhead_ms=(100.0, 100.0)), shape, 2) == plan.hiding_chunk(topo, shape, 2)


def test_no_step_is_shorter_than_the_hosts_time_to_issue_it():
    topo, shape = _h200(), _shape(seq=8192)
    p = plan.predict(replace(topo, step_host_ms=5.0), shape, 8)
    assert min(p.fwd_compute + p.bwd_compute) == pytest.approx(5.0)
    assert plan.predict(topo, shape, 8).ring_ms < p.ring_ms


def test_a_head_group_of_one_is_the_ring_and_a_ring_of_one_is_one_call_per_rank():
    topo, shape = plan.presets()["gb200-nvl72"], _shape(seq=1 << 17)
    ring_only = plan.predict_split(topo, shape, 1, 16)
    assert ring_only.rank_ms == pytest.approx(plan.predict(topo, shape, 16).ring_ms) and ring_only.a2a_ms == 0
    heads_only = plan.predict_split(topo, shape, 8, 1)
    per_rank = plan.single_ms(topo, replace(shape, heads=4, kv_heads=1))
    assert heads_only.rank_ms == pytest.approx(per_rank + heads_only.a2a_ms) and heads_only.a2a_ms > 0


def test_all_to_alls_move_what_the_head_group_trades():
    topo, shape = plan.presets()["gb200-nvl72"], _shape(seq=1 << 17, heads=32, kv_heads=8)
    counted = replace(topo.nvlink, latency_ms=0.0, gbps=1.0)  # 1 GB/s: ms = bytes / 1e6
    u, L, d = 4, (1 << 17) // (4 * 2), 128
    sent = 2 * (u - 1) * L * d * 2 * (32 // u + 8 // u + 8 // u + 32 // u)  # q, k, v, out and their gradients
    copies = 2 * 4 * u * L * d * 2 * (32 // u + 8 // u + 8 // u + 32 // u)
    assert plan._a2a_ms(topo, shape, u, 2, counted) == pytest.approx(sent / 1e6 + plan._hbm_ms(topo.gpu, copies))


def test_splits_are_those_whose_head_group_divides_the_heads_and_fits_the_domain():
    topo = plan.presets()["gb200-nvl72"]
    assert [s.head_world for s in plan.splits(topo, _shape(heads=32, kv_heads=8), 72, 8)] == [1, 2, 4, 8]
    assert [s.head_world for s in plan.splits(topo, _shape(heads=24, kv_heads=8), 16, 16)] == [1, 2, 4, 8]
    assert [s.head_world for s in plan.splits(plan.presets()["ib-400g"], _shape(), 8, 8)] == [1]


def test_head_groups_span_the_nvlink_domain_unless_capped():
    topo = plan.presets()["gb200-nvl72"]
    assert [s.head_world for s in plan.splits(topo, _shape(heads=32, kv_heads=8), 64)] == [1, 2, 4, 8, 16, 32]
    assert [s.head_world for s in plan.splits(plan.presets()["h100-node"], _shape(), 64)] == [1, 2, 4, 8]


def test_refit_takes_the_graphed_rings_overhead_and_the_graphed_model_issues_no_step_from_the_host(tmp_path):
    rows = [dict(device="NVIDIA H200", kind="overhead_nccl", backend="cute", world=2, local=local,
                 eager_overhead_us_per_step=300.0, graph_overhead_us_per_step=us)
            for local, us in ((512, -10.0), (1024, 20.0), (2048, 40.0))]
    (tmp_path / "ring_overhead.json").write_text(json.dumps(rows))
    base = _base()
    cal = plan.refit(base, [tmp_path / "ring_overhead.json"])
    assert cal["step_overhead_graph"]["cute"]["ms"] == pytest.approx(0.02)
    assert "CUDA graph" in cal["step_overhead_graph"]["cute"]["source"] and "-10 to 40 us" in \
        cal["step_overhead_graph"]["cute"]["source"]
    assert cal["step_overhead"] == base["step_overhead"]  # the eager fits stay
    cals = {"H200": dict(cal, _file="cal.json"), "H100": base | {"gpu": "H100"}}
    graphed = plan.presets("cute", cals, graphed=True)
    assert graphed["h200-x2"].step_overhead_ms == pytest.approx((0.02, 0.02))
    assert graphed["h200-x2"].step_host_ms == 0.0
    assert "assumed as on H200" in graphed["gb200-nvl72"].overhead_source
    with pytest.raises(ValueError, match="no per-step overhead of a CUDA-graphed ring for backend 'fa4'"):
        plan.presets("fa4", cals, graphed=True)


def test_w72_models_the_nearest_length_that_splits_instead_of_refusing(capsys):
    plan.main(["--preset", "gb200-nvl72", "--seq", str(1 << 17), "--worlds", "72"])
    out = capsys.readouterr().out
    assert " 72   8 x 9 " in out and "129024" in out and "<- best" in out


def test_cli_covers_every_preset_up_to_two_racks(capsys):
    plan.main(["--seq", str(9 << 17)])
    out = capsys.readouterr().out
    for name in plan.presets():
        assert f"== {name}:" in out
    assert "smallest local chunk" in out and " 576 " in out


def test_measured_rows_in_the_calibration_are_printed_beside_the_prediction(tmp_path, capsys):
    cal = _base()
    ring_row = dict(kind="ring", backend="fa4", world=2, seq=32768, causal=True, heads=32, kv_heads=8, head_dim=128,
                    dtype="bfloat16", efficiency=0.9, ringfa4_ms=30.0, single_ms=54.0)
    sim_row = dict(kind="simulated", backend="fa4", world=8, head_world=2, ring_world=4, seq=1 << 17, causal=True,
                   heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", efficiency=0.8, rank_ms={"0": 40.0, "3": 41.0})
    heads_row = dict(ring_row, head_world=2, ring_world=1, efficiency=0.8, ringfa4_ms=33.0)
    cal["checks"] = [ring_row, heads_row, sim_row]
    path = tmp_path / "calibration-h200.json"
    path.write_text(json.dumps({k: v for k, v in cal.items() if k != "_file"}))
    plan.main(["--preset", "h200-x2", "--calibration", str(path), "--worlds", "2"])
    out = capsys.readouterr().out
    topo = plan.presets("fa4", {"H200": plan.load_calibration(str(path)), "H100": _base() | {"gpu": "H100"}})["h200-x2"]
    p = plan.predict(topo, _shape(), 2)
    assert f"efficiency 0.900 | {p.efficiency:.3f} ({p.efficiency / 0.9 - 1:+6.1%})" in out
    u2 = plan.predict_split(topo, _shape(), 2, 1)  # a measured 2 x 1 row meets the model of all-to-alls, links included
    assert f"W=2   2 x 1   efficiency 0.800 | {u2.efficiency:.3f}" in out and f"ring ms 33.00 | {u2.rank_ms:.2f}" in out
    s = plan.predict_split(topo, _shape(seq=1 << 17), 2, 4, links=False)
    assert f"rank ms 41.00 | {s.rank_ms:.2f} ({s.rank_ms / 41 - 1:+6.1%})" in out and str(path) in out


def test_simulated_rows_replayed_from_a_graph_are_checked_against_the_graphed_model(tmp_path, capsys):
    """The eager row meets the eager model (host floor and eager per-step overhead); the same
    ranks replayed from a CUDA graph meet the model with the graphed overhead and no host floor."""
    cal = _base()
    row = dict(kind="simulated", backend="cute", world=64, head_world=1, ring_world=64, seq=1 << 17, causal=True,
               heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", efficiency=0.3, rank_ms={"0": 50.0},
               graph_efficiency=0.9, graph_rank_ms={"0": 14.0})
    cal["checks"] = [row]
    path = tmp_path / "calibration-h200.json"
    path.write_text(json.dumps({k: v for k, v in cal.items() if k != "_file"}))
    plan.main(["--preset", "h200-x2", "--backend", "cute", "--calibration", str(path), "--worlds", "2"])
    out = capsys.readouterr().out
    topo = plan.presets("cute", {"H200": plan.load_calibration(str(path)), "H100": _base() | {"gpu": "H100"}})["h200-x2"]
    g = cal["step_overhead_graph"]["cute"]["ms"]
    graphed = replace(topo, step_overhead_ms=(g, g), kernel_scale=(1.0, 1.0), step_host_ms=0.0)
    shape = _shape(seq=1 << 17)
    eager, replayed = (plan.predict_split(t, shape, 1, 64, links=False) for t in (topo, graphed))
    assert replayed.rank_ms < eager.rank_ms  # the host floor binds these 1k-token steps eagerly
    assert f"simulated   131072 W=64  1 x 64  efficiency 0.300 | {eager.efficiency:.3f}" in out
    assert f"graphed   131072 W=64  1 x 64  efficiency 0.900 | {replayed.efficiency:.3f}" in out
    assert f"rank ms 14.00 | {replayed.rank_ms:.2f}" in out


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


def test_refit_takes_the_simulators_per_step_overhead_and_keeps_earlier_checks(tmp_path):
    rows = [dict(device="NVIDIA H200", kind="overhead", backend="ringfa4.backends.cute", world=8, local=local,
                 eager_overhead_us_per_step=us, host_us_per_step=host)
            for local, us, host in ((512, 40.0, 160.0), (1024, 30.0, 170.0), (2048, 20.0, 180.0))]
    rows.append(dict(device="NVIDIA H200", kind="efficiency", backend="ringfa4.backends.cute", seq=1 << 17, heads=32,
                     kv_heads=8, head_dim=128, causal=True, dtype="bfloat16", world=8, head_world=2, ring_world=4,
                     rank_ms={"0": 40.0}, efficiency=0.9))
    (tmp_path / "simulate.json").write_text(json.dumps(rows))
    base = _base()
    cal = plan.refit(base, [tmp_path / "simulate.json"])
    assert cal["step_overhead"]["cute"]["ms"] == pytest.approx([0.03, 0.03])
    assert cal["step_overhead"]["cute"]["host_ms"] == pytest.approx(0.17)
    assert "bench/simulate.py --overhead" in cal["step_overhead"]["cute"]["source"]
    assert cal["step_overhead"]["fa4"] == base["step_overhead"]["fa4"]
    simulated = [c for c in cal["checks"] if c["kind"] == "simulated"]
    assert simulated and simulated[0]["backend"] == "cute" and len(cal["checks"]) == len(base["checks"]) + 1


def test_refit_takes_the_all_to_all_from_head_parallel_rows_and_the_model_uses_it(tmp_path):
    """U x 1 rows whose time beyond the 1-GPU call's 1/U is 8 exchanges of a known link plus the
    packing give back that link; the split model then charges it, and a plain ring row leaves it alone."""
    base = _base()
    hbm = plan.Gpu("H200", base["hbm_gbps"], {}, "")
    true = plan.Link("x", 150.0, 0.04, "")
    rows = []
    for seq in (16384, 65536, 131072):
        shape = plan.Shape(32, 8, 128, seq, True, 2)
        traffic = plan._a2a_traffic(shape, 2, 1)
        a2a = sum(true.ms(sent) + plan._hbm_ms(hbm, packed) for sent, packed in traffic)
        rows.append(dict(device="NVIDIA H200", backend="cute", world=2, head_world=2, ring_world=1, seq=seq, causal=True,
                         heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", single_ms=seq / 100.0,
                         ringfa4_ms=seq / 200.0 + a2a, efficiency=0.9))
    (tmp_path / "r.json").write_text(json.dumps(rows))
    cal = plan.refit(base, [tmp_path / "r.json"])
    fitted = cal["nvlink_all_to_all"]
    assert fitted["gbps"] == pytest.approx(150.0) and fitted["latency_ms"] == pytest.approx(0.04)
    assert cal["nvlink"] == base["nvlink"]  # the ring's link is fitted from ring transfers only
    path = tmp_path / "calibration-h200.json"
    path.write_text(json.dumps(cal))
    topo = plan.presets("cute", {"H200": plan.load_calibration(str(path)), "H100": base | {"gpu": "H100"}})["h200-x2"]
    shape = plan.Shape(32, 8, 128, 65536, True, 2)
    expected = plan._a2a_ms(topo, shape, 2, 1, plan.Link("x", 150.0, 0.04, ""))
    assert plan.predict_split(topo, shape, 2, 1).a2a_ms == pytest.approx(expected)


def test_refit_replaces_the_check_row_of_a_case_measured_again(tmp_path):
    row = dict(device="NVIDIA H200", kind="efficiency", backend="ringfa4.backends.cute", seq=1 << 17, heads=32,
               kv_heads=8, head_dim=128, causal=True, dtype="bfloat16", world=8, head_world=2, ring_world=4,
               rank_ms={"0": 40.0}, efficiency=0.9)
    (tmp_path / "old.json").write_text(json.dumps([row]))
    (tmp_path / "new.json").write_text(json.dumps([dict(row, rank_ms={"0": 36.0}, efficiency=1.0)]))
    first = plan.refit(_base(), [tmp_path / "old.json"])
    second = plan.refit(first, [tmp_path / "new.json"])
    case = [c for c in second["checks"] if c.get("rank_ms") in ({"0": 40.0}, {"0": 36.0})]
    assert [c["efficiency"] for c in case] == [1.0] and len(second["checks"]) == len(first["checks"])


def test_a_cute_backward_step_loops_over_the_query_heads_its_ctas_walk():
    """GQA 32/8: a cute backward CTA walks its group's 4 query heads (no split with 16 K/V blocks
    on 132 SMs), so the step runs at the kernel rows' TFLOP/s of a 4x longer loop; fa4's does not."""
    shape = plan.Shape(32, 8, 128, 1 << 17, True, 2)
    cute, fa4 = (plan.presets(b)["h200-x2"] for b in ("cute", "fa4"))
    assert plan._loop(cute, shape, "bwd", 1024, 2048, False) == 4096
    assert plan._loop(fa4, shape, "bwd", 1024, 2048, False) == 1024
    assert plan._loop(cute, shape, "fwd", 1024, 2048, False) == 2048
