"""The recorded training benchmark's tables, as lab 07 prints them, and its table of generated code."""

import pytest

from mhc_lab.course import training_lab


def _row(graph: dict, launched: dict) -> dict:
    # least bytes of a 16384 x 4096 site: 41 C bf16 elements per token
    return {"tokens": 16384, "C": 4096, "n": 4, "bytes": {"least": 41 * 4096 * 2 * 16384},
            "graph_ms": graph, "times_ms": launched}


def test_site_table_gives_the_gpu_time_first_and_the_chained_ratio_per_clock():
    results = {"copy_gbps": 4000.0, "site": [_row({"ours_chained": 1.5, "tilekernels": 3.0},
                                                  {"ours_chained": 2.4, "tilekernels": 3.0, "compiled": 18.0})]}
    text = training_lab.site_table(results)
    graph, launched = text.split("\n\n")
    assert graph.startswith("GPU time (CUDA graph replay):") and launched.startswith("launched op by op:")
    assert "0.50x" in graph and "0.80x" in launched
    assert "torch.compile" in launched and "torch.compile" not in graph  # only what each clock timed
    # 41 C x 2 bytes x 16384 tokens in 1.5 ms against 4000 GB/s of copy
    assert f"{41 * 4096 * 2 * 16384 / 1.5e-3 / 1e9 / 4000:.0%} of copy" in graph


def test_site_table_without_graph_times_shows_the_launched_ones_only():
    text = training_lab.site_table({"site": [_row({}, {"ours_chained": 2.0, "tilekernels": 2.5})]})
    assert "CUDA graph" not in text and "0.80x" in text and text.count("launched op by op:") == 1
    assert training_lab.site_table({}) == "(no site measurements)"


def test_the_recorded_tables_render_every_recorded_row():
    recording = training_lab.load_recorded()
    results = recording["results"]
    site = training_lab.site_table(results)
    for row in results["site"]:
        assert f"{row['graph_ms']['ours_chained']:.2f} ms" in site
    block = training_lab.block_table(results)
    for row in results["block"]:
        for ms in row["times_ms"].values():
            assert f"{ms:.2f} ms" in block


def test_block_table_takes_torch_compile_from_the_latest_run_that_timed_it():
    def block(C, residual, **times):
        return {"C": C, "tokens": 16384, "times_ms": {"residual": residual, **times}, "peak_gib": {}}

    results = {"block": [block(4096, 40.0, mhc_ours=44.0), block(2560, 20.0, mhc_ours=23.0)],
               "block_repeats": [{"run": "A", "block": [block(4096, 30.0, mhc_compiled=60.0)]},
                                 {"run": "B", "block": [block(4096, 50.0, mhc_compiled=75.0)]},
                                 {"run": "C", "block": [block(4096, 50.0, mhc_ours=1.0)]}]}
    text = training_lab.block_table(results)
    at_4096, at_2560 = text.split("C = 2560")
    assert "+10.0%" in at_4096 and "75.00 ms" in at_4096 and "+50.0%" in at_4096 and "(run B" in at_4096
    assert "60.00 ms" not in text and "torch.compile" not in at_2560  # only the latest, only its own width
    results["block"][0]["times_ms"]["mhc_compiled"] = 80.0  # timed in the main run: that one only
    assert "(run" not in training_lab.block_table(results) and "+100.0%" in training_lab.block_table(results)


def test_block_table_and_figure_take_tilekernels_from_the_latest_run_that_timed_it():
    def block(C, residual, **times):
        return {"C": C, "tokens": 16384, "times_ms": {"residual": residual, **times}, "peak_gib": {}}

    results = {"block": [block(4096, 40.0, mhc_ours=44.0)],
               "block_repeats": [{"run": "A", "block": [block(4096, 30.0, mhc_tilekernels=36.0)]},
                                 {"run": "B", "block": [block(2560, 50.0, mhc_tilekernels=75.0)]}]}
    text = training_lab.block_table(results)
    assert "mHC, TileKernels" in text and "+20.0%   peak -   (run A, against its own plain residual)" in text
    assert "+50.0%" not in text  # run B timed another width
    bars = {bar.name: (list(bar.y), list(bar.text)) for bar in training_lab.block_figure(results, "x").data}
    assert bars["mHC, TileKernels"] == ([pytest.approx(20.0)], ["+20.0% (run A)"])
    assert bars["mHC, ours"] == ([pytest.approx(10.0)], ["+10.0%"])


def _kernel2_recording(sweeps: list, sm_count: int = 132) -> dict:
    return {"environment": {"gpu": "Some GPU", "date": "2026-01-02", "sm_count": sm_count},
            "results": {"n": 4, "copy_gbps": 4000.0, "sweeps": sweeps}}


def _lanes(C: int, rows: list, run: str = "U", tokens: int = 16384) -> dict:
    return {"tokens": tokens, "C": C, "run": run, "lanes": rows}


def test_kernel2_steps_table_gives_each_step_and_the_copy_floor():
    rows = [{"add_dx": True, "ms": 0.70}, {"add_dx": True, "leave_out": ["dphi"], "ms": 0.68},
            {"add_dx": True, "leave_out": ["dphi", "dx_gemm"], "ms": 0.49},
            {"add_dx": True, "leave_out": ["dphi", "dx_gemm", "dmix_loads"], "ms": 0.48},
            {"add_dx": True, "lane_splits": 2, "ms": 9.0},  # another tuning: not a step
            {"ms": 0.52}, {"leave_out": ["dphi", "dx_gemm", "dmix_loads"], "ms": 0.33}]
    sweeps = [_lanes(4096, rows), _lanes(2560, rows),  # at 2560 the site runs 3 splits on 132 SMs: left out
              _lanes(4096, [{"add_dx": True, "ms": 5.0}], run="N")]  # another run
    lines = training_lab.kernel2_steps_table(_kernel2_recording(sweeps)).splitlines()
    assert lines[0].startswith("RECORDED on Some GPU, 2026-01-02")
    assert lines[1].startswith("kernel 2 at 16384 x 4096, ms") and len(lines) == 7
    assert [line.split()[-2:] for line in lines[2:6]] == [["0.700", "0.520"], ["0.680", "-"], ["0.490", "-"],
                                                          ["0.480", "0.330"]]
    floor = [16384 * k * 4096 * 2 / 4000e9 * 1e3 for k in (13, 9)]
    assert lines[6].split()[-2:] == [f"{floor[0]:.3f}", f"{floor[1]:.3f}"]


def test_kernel2_steps_table_without_the_run_says_so():
    assert training_lab.kernel2_steps_table(_kernel2_recording([])).startswith("(no kernel 2 leave_out sweep")
    # on a GPU with other SM counts the rule picks other splits: no shape matches the sweep's one split
    text = training_lab.kernel2_steps_table(_kernel2_recording([_lanes(4096, [{"add_dx": True, "ms": 1.0}])], 100))
    assert text.startswith("(no kernel 2 leave_out sweep")


def test_the_recorded_kernel2_steps_table_renders_every_step():
    text = training_lab.kernel2_steps_table()
    u = [s for s in training_lab.load_recorded()["results"]["sweeps"] if s.get("run") == "U" and s["C"] == 4096]
    for row in u[0]["lanes"]:
        assert f"{row['ms']:.3f}" in text
    assert all(line.split()[-2] != "-" for line in text.splitlines()[2:])  # every step with dx_post measured


def test_kernel2_steps_table_takes_a_sweep_that_ran_the_sites_splits():
    """A newer sweep records the token splits it ran: at C = 2560 the rule's 3 make that shape the site's."""
    rows = [{"add_dx": True, "token_splits": 3, "ms": 0.50}, {"add_dx": True, "token_splits": 1, "ms": 0.70},
            {"token_splits": 3, "ms": 0.40}]
    text = training_lab.kernel2_steps_table(_kernel2_recording([_lanes(2560, rows)]))
    lines = text.splitlines()
    assert lines[1].startswith("kernel 2 at 16384 x 2560, ms")
    assert lines[2].split()[-2:] == ["0.500", "0.400"] and "0.700" not in text


def test_kernel2_steps_table_reads_a_recording_the_benchmark_wrote_itself():
    """No run names in a recording the benchmark wrote: its sweep is the one shown; with none, the message
    gives the command that records one."""
    row = {"add_dx": True, "token_splits": 1, "ms": 0.61}
    text = training_lab.kernel2_steps_table(_kernel2_recording([{"tokens": 16384, "C": 4096, "lanes": [row]}]))
    assert "0.610" in text.splitlines()[2]
    empty = training_lab.kernel2_steps_table(_kernel2_recording([]))
    assert training_lab.kernel2_steps_command() in empty and '"leave_out":["dphi","dx_gemm"]' in empty


def _profile_recording(rows: list) -> dict:
    return {"environment": {"gpu": "Some GPU", "date": "2026-01-02"},
            "results": {"kernel2_profiles": {"tokens": 16384, "C": 4096, "rows": rows}}}


def test_kernel2_profile_table_gives_each_variant_its_counters_under_its_run():
    rows = [{"run": "X1", "kernel": "the old kernel", "variant": {"add_dx": True}, "duration_us": 637.0,
             "l2_throughput_pct": 82.9, "l2_tag_requests_pct": 82.1, "l2_write_requests": 30932922,
             "l2_write_sectors": 31932880, "shared_load_bank_conflicts": 31761399,
             "consumer_stall_pct": {"short_sb": 13.4, "selected": 11.4, "wait": 6.3},
             "producer_stall_pct": {"long_sb": 38.5}},
            {"run": "X2", "kernel": "the new kernel", "variant": {"add_dx": True, "stage_dx": False},
             "duration_us": 651.0, "l2_throughput_pct": 85.2, "l2_tag_requests_pct": 85.2,
             "l2_write_requests": 33360876, "l2_write_sectors": 33492167, "shared_load_bank_conflicts": 7539202,
             "consumer_stall_pct": {"selected": 11.8, "short_sb": 12.3}, "producer_stall_pct": {}}]
    lines = training_lab.kernel2_profile_table(_profile_recording(rows)).splitlines()
    assert lines[0].startswith("RECORDED on Some GPU, 2026-01-02") and "16384 x 4096" in lines[1]
    assert lines[3] == "run X1, the old kernel:" and lines[5] == "run X2, the new kernel:"
    first, second = lines[4].split(), lines[6].split()
    assert first[:3] == ["the", "kernel's", "defaults"]  # no tuning but dx_post: the defaults
    assert first[3:9] == ["637", "83", "82", "30.9", "31.9", "31.8"]
    assert "short_sb 13, selected 11" in lines[4] and "wait" not in lines[4] and first[-1] == "38"
    assert second[0] == "stage_dx=False" and second[-1] == "-"  # no producer samples recorded
    assert "short_sb 12, selected 12" in lines[6]  # the two largest, largest first


def test_kernel2_profile_table_without_profiles_says_so():
    assert training_lab.kernel2_profile_table(_profile_recording([])).startswith("(no Nsight Compute profile")


def test_the_recorded_kernel2_profile_table_renders_every_row():
    text = training_lab.kernel2_profile_table()
    rows = training_lab.load_recorded()["results"]["kernel2_profiles"]["rows"]
    assert len(rows) >= 2
    for row in rows:
        assert f"{row['l2_write_requests'] / 1e6:.1f}" in text and f"{row['duration_us']:.0f}" in text


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_lane_mix_reads_each_lane_once_when_bound_and_n_times_as_a_list(n):
    """Lab 07's lesson, checked on the CUDA TileLang generates (no GPU needed): as a Python list of expressions
    the n lane values are loaded (and converted) again for each of the n outputs; bound to names, once."""
    counts = training_lab.lane_mix_counts(n, 64)
    assert counts["bound"] == {"lane_loads": n, "conversions": 2 * n}
    assert counts["list"] == {"lane_loads": n * n, "conversions": 2 * n * n}


def test_lane_mix_program_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match=r"expected 1 <= n <= 8 lanes, got n = 9"):
        training_lab.lane_mix_program(9, 64, True)
    with pytest.raises(ValueError, match=r"expected C a positive multiple of block_c = 64, got C = 100"):
        training_lab.lane_mix_program(4, 100, True)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_designs_table_gives_the_chained_site_with_and_without_the_post_gradient_handed(n):
    """The chained site's row and, under it, the same with the post's output gradient handed to the pre (its
    backward writes no dx: n C fewer in the backward, the forward the same); 46C and 42C at n = 4."""
    rows = training_lab.designs_table(n).splitlines()
    at = next(k for k, line in enumerate(rows) if line.startswith("ours: run_sites"))
    assert "output gradient to the pre" in rows[at + 1]
    chained, handed = ([int(v[:-1]) for v in rows[k].split()[-3:]] for k in (at, at + 1))
    assert handed == [chained[0], chained[1] - n, chained[2] - n]
    if n == 4:
        assert (chained[2], handed[2]) == (46, 42)


def test_joined_h200_table_sets_each_variant_against_the_two_kernels_apart():
    """Ratios to kernel 2 + the post backward of the same sweep, the parts named, the one-pass sum of a later
    run under the shape it belongs to; rows of another epilogue and sweeps without joined rows left out."""
    from mhc_lab.course.training_lab import joined_h200_table

    def row(ms, sums, **kw):
        return {"joined": True, "ms": ms, "kernel2_ms": 0.3, "post_backward_ms": 0.2, "sums_ms": sums,
                "epilogue": "reduce_sum per row sum", **kw}

    results = {"sweeps": [
        {"tokens": 128, "C": 64, "run": "X", "lanes": [{"add_dx": True, "ms": 0.3}, row(0.75, 0.05),
                                                        row(0.4, 0.05, joined_leave_out=["row_sums"])]},
        {"tokens": 128, "C": 64, "run": "Y", "lanes": [row(9.0, 0.02, epilogue="per thread",
                                                        sums_pass="one pass (committed)")]},
        {"tokens": 256, "C": 96, "run": "Z", "lanes": [{"add_dx": True, "ms": 0.5}]}]}
    lines = joined_h200_table(results).splitlines()
    assert len(lines) == 6 and not any("9.000" in line or " 96 " in line for line in lines)
    assert lines[1].split()[:2] == ["128", "64"] and lines[1].split()[-2:] == ["0.500", "X"]
    assert lines[2].split()[-3:] == ["0.750", "1.50x", "X"] and "joined kernel" in lines[2]
    assert lines[3].split()[-3:] == ["0.400", "0.80x", "X"] and "without the row sums" in lines[3]
    assert lines[4].split()[-2:] == ["0.050", "X"] and lines[5].split()[-2:] == ["0.020", "Y"]
    assert joined_h200_table({"sweeps": []}) == "(no recorded runs of the joined kernel)"


def test_compare_kernel_times_splits_shared_and_own_kernels():
    """The block breakdown's arithmetic on made-up kernel times: totals, the shared kernels' times on each side,
    each side's own, the largest differences (other less base) and other's largest own kernels, in order."""
    from mhc_lab.bench.training import compare_kernel_times

    base = {"gemm": 10.0, "attention": 6.0, "add": 0.5}
    other = {"gemm": 10.4, "attention": 5.9, "mhc_post": 0.8, "mhc_pre": 1.1}
    c = compare_kernel_times(base, other, top=1)
    assert c["base_ms"] == 16.5 and abs(c["other_ms"] - 18.2) < 1e-12
    assert c["shared_base_ms"] == 16.0 and abs(c["shared_other_ms"] - 16.3) < 1e-12
    assert c["only_base_ms"] == 0.5 and abs(c["only_other_ms"] - 1.9) < 1e-12
    assert [r["kernel"] for r in c["largest_differences"]] == ["gemm"]
    assert abs(c["largest_differences"][0]["ms"] - 0.4) < 1e-12
    assert (c["largest_differences"][0]["base_ms"], c["largest_differences"][0]["other_ms"]) == (10.0, 10.4)
    assert c["largest_own"] == [{"kernel": "mhc_pre", "ms": 1.1}]
    assert compare_kernel_times(base, other)["largest_differences"][-1]["kernel"] == "attention"


def test_kernel_totals_sums_every_kernels_time_and_launches():
    from mhc_lab.bench.training import kernel_totals

    assert kernel_totals({"gemm": (10.0, 4.0), "add": (0.5, 11.0)}) == (10.5, 15.0)
    assert kernel_totals({}) == (0, 0)


def _made_up_comparison(base: dict, other: dict) -> dict:
    from mhc_lab.bench.training import compare_kernel_times

    return compare_kernel_times(base, other, top=16)


def test_behind_gemms_table_orders_kernels_by_their_time_alone_with_the_ratio():
    from mhc_lab.course.training_lab import behind_gemms_table

    alone = {"lanes_backward_kernel": 0.5, "mix_lanes_kernel": 0.2, "void at::native::reduce_kernel<128, 4>": 0.03}
    behind = {"lanes_backward_kernel": 0.65, "mix_lanes_kernel": 0.2, "void at::native::reduce_kernel<128, 4>": 0.03}
    results = {"behind_gemms": {"shapes": [{"tokens": 128, "C": 64, "comparison": _made_up_comparison(alone, behind)}]}}
    lines = behind_gemms_table(results, top=2).splitlines()
    assert lines[0] == "128 x 64: all its kernels 0.730 ms alone, 0.880 behind GEMMs"
    assert lines[1].split() == ["lanes_backward", "0.500", "alone", "0.650", "behind", "(1.30x)"]
    assert lines[2].split()[0] == "mix_lanes" and len(lines) == 3
    assert behind_gemms_table({}) == "(no runs behind GEMMs recorded)"


def test_block_breakdown_table_sets_the_blocks_and_the_connections_alone_side_by_side():
    from mhc_lab.course.training_lab import block_breakdown_table, kernel_label

    plain = {"gemm": 10.0, "add": 0.5}
    chained = {"gemm": 10.2, "add": 0.3, "lanes_kernel": 1.2, "post_kernel": 0.3}
    alone = {"lanes_kernel": 1.0, "post_kernel": 0.3, "add": 0.1}
    own = {k: v for k, v in chained.items() if k not in plain}
    rows = {"residual": {"wall_ms": 12.0, "kernel_ms": 10.5, "idle_ms": 1.5, "launches": 10},
            "k": {"wall_ms": 13.0, "kernel_ms": 12.0, "idle_ms": 1.0, "launches": 14},
            "k without layers": {"wall_ms": 1.5, "kernel_ms": 1.4, "idle_ms": 0.1, "launches": 5}}
    entry = {"C": 64, "tokens": 128, "kind": "k", **rows, "comparison": _made_up_comparison(plain, chained),
             "own_against_alone": _made_up_comparison(alone, own)}
    lines = block_breakdown_table({"block_kernels": {"X": [entry]}}, run="X").splitlines()
    assert lines[1].split()[-4:] == ["12.00", "10.50", "1.50", "10"]
    assert lines[2].split()[-4:] == ["13.00", "12.00", "1.00", "14"] and lines[3].startswith("  chained, identity")
    assert "10.50 ms plain, 10.50 chained; mHC's own 1.50 ms" in lines[4]
    assert "1.500 ms in the block, 1.300 with identity layers" in lines[5]
    assert lines[6].split()[0] == "lanes" and lines[6].endswith("(1.20x)")
    assert block_breakdown_table({}, run="X") == "(no block breakdown recorded for run X)"
    assert kernel_label("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>") == "torch reduce_kernel"


def test_floor_kernels_table_puts_each_own_kernel_against_its_bytes_at_the_copies_pace():
    """The copy floor's copies give the pace in the block; each of the chained block's own kernels (those the plain
    block does not launch) is set against its lane-wide bytes at that pace, the small ones against none."""
    from mhc_lab.measure import bytes_model
    from mhc_lab.course.training_lab import CHAINED_KERNEL_ELEMENTS, COPY_KERNEL, floor_kernels_table

    C, tokens = 100, 1000
    bytes_76c = 76 * C * 2 * tokens
    pace = 4e12  # bytes per second: the copies take bytes_76c / pace
    copies_ms = bytes_76c / pace * 1e3
    k2_ms = 2 * 13 * C * 2 * tokens / pace * 1e3 + 0.5  # 0.5 ms beyond its bytes
    floor = {"C": C, "tokens": tokens, "kind": "copy_floor",
             "kernels": {"residual": {"gemm": {"ms": 9.0, "launches": 1}},
                         "copy_floor": {"gemm": {"ms": 9.0, "launches": 1},
                                        COPY_KERNEL: {"ms": copies_ms, "launches": 11}}}}
    chained = {"C": C, "tokens": tokens, "kind": "mhc_ours_chained",
               "kernels": {"residual": {"gemm": {"ms": 9.0, "launches": 1}},
                           "mhc_ours_chained": {"gemm": {"ms": 9.1, "launches": 1},
                                                "lanes_backward_cuda_post_grad_kernel": {"ms": k2_ms, "launches": 2},
                                                "token_coefficients_kernel": {"ms": 0.25, "launches": 2}}}}
    lines = floor_kernels_table({"block_kernels": {"X": [floor, chained]}}, run="X").splitlines()
    assert lines[0].endswith("for 76C per token (4.00 TB/s in the block)")
    k2 = lines[2].split()
    assert k2[0] == "lanes_backward_cuda_post_grad" and k2[2:] == ["2", "13C", f"{k2_ms - 0.5:.3f}", "0.500"]
    assert lines[3].split()[-3:] == ["-", "0.000", "0.250"]
    assert lines[4].split()[-1] == "0.750"
    assert floor_kernels_table({"block_kernels": {"X": [chained]}}, run="X") == \
        "(no copy floor breakdown recorded for run X)"
    # the per-launch counts are bytes_model's: kernel 2 (pre backward 2 with the post's gradient handed over)
    # reads 2n + 1 and writes n; the post backward loses the n C of dx it no longer writes
    backward = {r.operation.split(" (")[0]: r.moved.per_C for r in bytes_model.rows("ours_chained", 4, "backward")}
    assert CHAINED_KERNEL_ELEMENTS["lanes_backward_cuda_post_grad_kernel"] == backward["pre backward 2: dx, dphi"]
    assert CHAINED_KERNEL_ELEMENTS["post_backward_without_dx_kernel"] == (
        backward["post backward"] - bytes_model.post_gradient_saving(4))


def test_block_rounds_table_gives_each_kinds_median_and_range():
    from mhc_lab.course.training_lab import block_rounds_table

    block = {"C": 64, "rounds_ms": {"residual": [10.0, 11.0, 12.0]},
             "overhead_pct_rounds": {"mhc_ours_chained": {"median": 10.0, "least": 5.0, "most": 12.5}}}
    lines = block_rounds_table({"block_rounds": [{"run": "X", "block": [block]}]}).splitlines()
    assert lines[0] == "run X, C = 64, 3 rounds (plain residual 11.00 ms, median):"
    assert lines[1].split()[-6:] == ["median", "+10.0%", "rounds", "+5.0%", "to", "+12.5%"]
    assert block_rounds_table({}) == "(no block runs in rounds recorded)"
    shown = block_rounds_table({"block_rounds": [{"run": "Y", "block": [block], "invalid": "read freed memory: why"},
                                                 {"run": "X", "block": [block]}]}).splitlines()
    assert shown[0] == "run Y: not shown, invalid (read freed memory)" and shown[1].startswith("run X, C = 64")


def test_recorded_block_breakdown_names_the_kernels_the_power_cap_slows():
    """The recording behind lab 07's section 5.1: with identity layers and alone at the full clock, kernel 2 and
    the post + projection are the kernels that take longer beside the layers and behind GEMMs."""
    results = training_lab.load_recorded()["results"]
    behind = training_lab.behind_gemms_table(results).splitlines()
    slow = [line for line in behind if line.startswith("  ") and float(line.split("(")[-1].rstrip("x)")) > 1.15]
    assert {line.split()[0] for line in slow} == {"lanes_backward_cuda_post_grad", "post_project_cuda"}
    assert "lanes_backward_cuda_post_grad" in training_lab.block_breakdown_table(results).splitlines()[5 + 1]
    assert "run BM, C = 4096" in training_lab.block_rounds_table(results)
    assert "run CD (as CUDA graphs): not shown, invalid" in training_lab.block_rounds_table(results)


def test_block_table_gives_the_rounds_median_where_the_run_timed_rounds():
    row = {"C": 64, "tokens": 128, "times_ms": {"residual": 10.0, "mhc_ours_chained": 11.5}, "peak_gib": {},
           "rounds_ms": {"residual": [10.0, 11.0, 12.0], "mhc_ours_chained": [11.0, 12.1, 12.6]},
           "overhead_pct_rounds": {"mhc_ours_chained": {"median": 10.0, "least": 5.0, "most": 10.0}}}
    lines = training_lab.block_table({"block": [row]}).splitlines()
    assert lines[1].endswith("peak -") and "rounds" not in lines[1]
    assert lines[2].endswith("3 rounds: median +10.0%") and "+15.0%" in lines[2]


def test_hot_kernels_table_renders_the_recorded_profiles_and_made_up_ones():
    recorded = training_lab.load_recorded()["results"]
    text = training_lab.hot_kernels_table(recorded)
    for key in training_lab.HOT_KERNEL_PROFILES:
        assert f"run {recorded[key]['run']}" in text
        for name, row in recorded[key]["kernels"].items():
            assert name.split(" (")[0][:14] in text and f"{row['duration_us']:.0f}" in text
            for label, count in row["consumer_loop_instructions_per_warp"].items():
                assert any(line.strip().startswith(label) and str(count) in line for line in text.splitlines())
    now = {"run": "Z", "tokens": 8, "C": 16, "kernels": {
        "one (a)": {"duration_us": 12.0, "consumer_loop_instructions_per_warp": {"adds": 7}},
        "two (b)": {"duration_us": 3.0, "issue_slots_busy_pct": 41.0,
                    "consumer_loop_instructions_per_warp": {"adds": 2, "loads": 5}}}}
    lines = training_lab.hot_kernels_table({"hot_kernels_profile": now}).splitlines()
    assert lines[0] == "8 x 16, Nsight Compute"
    assert lines[1].split() == ["one", "two"] and lines[2].split() == ["run", "Z", "run", "Z"]
    assert lines[3].split() == ["time", "(us)", "12", "3"]
    assert next(x for x in lines if x.startswith("issue slots")).split()[-2:] == ["-", "41"]
    assert next(x for x in lines if x.strip().startswith("loads")).split() == ["loads", "0", "5"]
    assert training_lab.hot_kernels_table({}) == "(no profile of the two kernels recorded)"
    # an earlier run beside it: a column per kernel and run, the earlier first; its note on top
    before = {"run": "Y", "tokens": 8, "C": 16, "note": "built another way", "kernels": {
        "one (a)": {"duration_us": 20.0, "consumer_loop_instructions_per_warp": {"adds": 9}}}}
    lines = training_lab.hot_kernels_table({"hot_kernels_profile": now, "earlier": before},
                                           keys=("earlier", "hot_kernels_profile")).splitlines()
    assert lines[1] == "run Y: built another way"
    assert lines[2].split() == ["one", "one", "two"] and lines[3].split() == ["run", "Y", "run", "Z", "run", "Z"]
    assert lines[4].split() == ["time", "(us)", "20", "12", "3"]
    assert next(x for x in lines if x.strip().startswith("adds")).split() == ["adds", "9", "7", "2"]


def test_overlap_table_gives_each_kernels_hidden_share_and_saving_per_carveout():
    """overlap_table: per run and shape, the GEMM's time per carve-out and each kernel's share hidden and ms saved;
    on the recording, run CF's cuBLASLt carve-outs slow the GEMM and save nothing for kernel 2."""
    from mhc_lab.course.training_lab import overlap_table

    cell = {"gemm_ms": 1.0, "hidden_pct": {"k": 40.0}, "saved_ms": {"k": -0.125}}
    results = {"overlap": {"note": "n", "run_X": {"blas": "cublaslt", "shapes": [
        {"tokens": 8, "C": 16, "alone_ms": {"launched": {"k": 0.25}},
         "carveouts": {"0": {"launched": cell}, "32": {"launched": {**cell, "gemm_ms": 1.5}}}}]}}}
    lines = overlap_table(results).splitlines()
    assert lines[0] == "run X (cublaslt), 8 x 16, launched; SMs left out of the GEMM: 0, 32"
    assert lines[1].split() == ["the", "GEMM", "alone", "1.000", "ms", "1.500", "ms"]
    assert lines[2].split() == ["k", "0.250", "ms", "+40%", "-0.125", "+40%", "-0.125"]
    assert overlap_table({}) == "(no overlap runs recorded)"
    recorded = overlap_table(training_lab.load_recorded()["results"]).splitlines()
    start = recorded.index("run CF (cublaslt), 16384 x 2560, launched; SMs left out of the GEMM: 0, 16, 32, 64")
    assert recorded[start + 1].split()[-2:] == ["1.852", "ms"]
    saved = [float(v) for v in recorded[start + 2].split()[7::2]]
    assert saved[0] == -0.065 and max(saved) < 0
