"""docs/results.md and the README's results table are what the recordings give (python -m mhc_lab.bench results)."""

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
    assert ("| DeepSeek-V4 training step (64 × 32, 4 layers), transformers / use_mhc_lab | 10.000 / 5.000 (0.50x) "
            "ms | NVIDIA H200, 2026-01-01 |") in readme
