"""docs/results.md and the README's results table are what the recordings give (python -m mhc_lab.bench results)."""

import re

from mhc_lab.bench import results


def test_results_and_readme_table_match_the_recordings(capsys):
    assert results.main(["--check"]) == 0, capsys.readouterr().out


def test_readme_table_has_at_most_nine_rows_each_with_where_and_when():
    table = results.readme_table(results.load_all()).splitlines()[2:]
    assert 0 < len(table) <= 9
    for row in table:
        assert "H200" in row and "2026-" in row, row


def test_stack_rows_are_the_recordings_figures_over_the_plain_stack_run_alike():
    training = {"results": {"stack": {"environment": {"gpu": "GPU", "date": "2026-01-01"}, "shapes": [{
        "tokens": 64, "C": 32, "layers": 2,
        "launched_ms": {"residual": 2.0, "mhc_kernels": 3.0, "residual_reduce_overhead": 1.0,
                        "mhc_kernels_reduce_overhead": 1.25},
        "graph_ms": {"residual": 1.0, "mhc_kernels": 1.5},
        "over_residual": {"launched": {"mhc_kernels": {"median": 1.4}, "mhc_kernels_reduce_overhead": {"median": 1.3}},
                          "graph": {"mhc_kernels": {"median": 1.6}}}}]}}}
    header, rows, measured = results.stack_rows(training)
    assert header[2:] == list(results.STACK_COLUMNS.values()) and measured == "GPU, 2026-01-01"
    assert rows == [["64 × 32, 2", "launched ms", "2.000", "3.000 (1.40x)", "-", "-"],
                    ["64 × 32, 2", "CUDA graph ms", "1.000", "1.500 (1.60x)", "-", "-"],
                    ["64 × 32, 2", "torch.compile, reduce-overhead, ms", "1.000", "1.250 (1.30x)", "-", "-"]]
    assert results.stack_rows({"results": {}}) == ([], [], "")


def test_deepseek_v4_rows_are_the_recordings_figures_and_one_readme_row():
    times = {"step": 10.0, "forward": 4.0, "forward_no_grad": 3.0}
    shape = {"tokens": 64, "hidden": 32, "layers": 4,
             "time_ms": {"unpatched": times, "patched": {k: v / 2 for k, v in times.items()}},
             "patched_over_unpatched": {k: {"median": 0.5} for k in times},
             "peak_memory_mib": {"unpatched": {k: 2048.0 for k in times}, "patched": {k: 1024.0 for k in times}},
             "loss": {"unpatched": 5.5, "patched": 5.25}}
    training = {"results": {"deepseek_v4": {"environment": {"gpu": "NVIDIA H200", "date": "2026-01-01"},
                                            "shapes": [shape]}}}
    header, rows, measured = results.deepseek_v4_rows(training)
    assert len(header) == 6 and measured == "NVIDIA H200, 2026-01-01"
    assert rows[0] == ["64 × 32, 4", "training step", "10.000", "5.000 (0.50x)", "2.00 / 1.00", "5.5000 / 5.2500"]
    assert [r[1] for r in rows] == list(results.DEEPSEEK_V4_PASSES.values()) and rows[1][5] == ""
    assert results.deepseek_v4_rows({"results": {}}) == ([], [], "")
    readme = results.readme_table({"training_h200": training})
    assert ("| training step, a small DeepSeek-V4 in transformers (4 layers, 64 × 32), launched: with use_mhc_lab / "
            "as is | 5.000 / 10.000 ms (0.50x) | NVIDIA H200, 2026-01-01 |") in readme


def _site_shape(tokens, C, ours, theirs):
    return {"tokens": tokens, "C": C, "graph_ms": {"ours_chained": ours, "tilekernels": theirs},
            "time_ms": {"ours_chained": ours / 4, "tilekernels": theirs / 4}}


def test_readme_rows_print_ours_first_and_the_ratio_of_the_figures_in_that_order():
    env = {"gpu": "NVIDIA H200", "date": "2026-01-01"}
    training = {"results": {"site": {"environment": env, "shapes": [_site_shape(64, 32, 1.0, 4.0),
                                                                    _site_shape(8, 16, 3.0, 2.0)]}}}
    forward = {"results": {"sites": {"environment": env, "shapes": [_site_shape(64, 32, 2.0, 1.0)]}}}
    rows = results.readme_table({"training_h200": training, "forward_h200": forward}).splitlines()[2:]
    assert rows == [
        "| one site, forward + backward, 64 × 32, GPU time: ours / TileKernels | 1.000 / 4.000 ms (0.25x) | "
        "NVIDIA H200, 2026-01-01 |",
        "| one site, forward + backward, 8 × 16, GPU time: ours / TileKernels | 3.000 / 2.000 ms (1.50x) | "
        "NVIDIA H200, 2026-01-01 |",
        "| one site, forward only, 64 × 32, GPU time: ours / TileKernels | 0.500 / 0.250 ms (2.00x) | "
        "NVIDIA H200, 2026-01-01 |"]
    assert results.readme_table({}).splitlines()[2:] == []


def test_the_legend_names_the_tilekernels_version_the_recordings_tag_and_no_other():
    env = {"gpu": "NVIDIA H200", "date": "2026-01-01"}
    tagged = {"training_h200": {"results": {"block": {"environment": env},
                                            "site": {"environment": {**env, "tilekernels": "9.8.7"}}}}}
    assert "the version compared is tile-kernels 9.8.7" in results.results_legend(tagged, "g.md")[0]
    untagged = {"training_h200": {"results": {"site": {"environment": env}}}, "forward_h200": None}
    line = results.results_legend(untagged, "g.md")[0]
    assert "do not tag which version" in line and "9.8.7" not in line
    assert all("](g.md#" in link for link in re.findall(r"\]\([^)]*\)", results.results_legend(untagged, "g.md")[1]))
