"""The recorded training benchmark's tables, as lab 07 prints them."""

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
