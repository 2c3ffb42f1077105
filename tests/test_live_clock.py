"""The live clock of labs 00 and 04 holds from run to run, and every sentence the labs print about a live run is
computed from it, the machine's disagreements with the expectation included."""

import resource
import statistics
import time

import pytest
import torch

from mhc_lab.bench import memory_wall
from mhc_lab.measure import bytes_model, keep_freed_memory, roofline, time_interleaved, timing

TOKENS, C = 2048, 256  # lab 04's small shape


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spin(seconds: float):
    """A stand-in workload of a known CPU time (a busy loop on the clock the timer reads)."""
    def work():
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    return work


# ---- the cause: freed memory handed back to the OS, then faulted in again ----------------------------------


def test_after_keep_freed_memory_a_fresh_large_tensor_costs_no_page_faults(one_thread):
    if not keep_freed_memory():
        pytest.skip("not glibc: malloc's thresholds cannot be set here")
    x = torch.randn(TOKENS, 4, C)  # 8 MiB: past glibc's default threshold, so it would be mmap'd and unmapped

    def call():
        return (x + x) * x  # two 8 MiB results, freed at once

    for _ in range(3):
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        call()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 2 * 8 * 2**20 / 4096, f"{faults} page faults in 20 calls: freed memory went back to the OS"


# ---- the clock itself --------------------------------------------------------------------------------------


def test_cpu_clock_reads_the_thread_on_one_thread_and_the_wall_on_several():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing.cpu_clock() is time.thread_time
        torch.set_num_threads(2)
        assert timing.cpu_clock() is time.perf_counter
    finally:
        torch.set_num_threads(before)


def test_interleaved_clock_finds_known_costs_and_keeps_their_ratio(one_thread):
    result = time_interleaved({"short": _spin(0.001), "long": _spin(0.004)}, rounds=4, calls=2, warmup_s=0.0)
    assert set(result) == {"short", "long"}
    assert result["long"]["repeat"] == 8 and result["long"]["rounds"] == 4 and result["long"]["calls"] == 2
    assert result["short"]["median_s"] == pytest.approx(0.001, rel=0.3)
    assert result["long"]["median_s"] / result["short"]["median_s"] == pytest.approx(4.0, rel=0.2)
    for r in result.values():
        assert r["min_s"] <= r["median_s"] <= r["max_s"]


def test_interleaved_clock_keeps_each_rounds_fastest_call(one_thread, monkeypatch):
    rounds = iter([[3.0, 1.0, 2.0], [5.0, 4.0, 6.0], [0.5, 9.0, 7.0]])
    monkeypatch.setattr(timing, "_timed_calls", lambda fn, calls, on_cuda, before=None: next(rounds))
    result = time_interleaved({"f": lambda: None}, rounds=3, calls=3, warmup_s=0.0)["f"]
    assert (result["median_s"], result["min_s"], result["max_s"]) == (1.0, 0.5, 4.0)


@pytest.mark.parametrize("bad", [{"rounds": 0}, {"calls": -1}, {"rounds": 2.5}, {"calls": True}])
def test_interleaved_clock_rejects_bad_counts_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}: expected a positive int, got"):
        time_interleaved({"f": lambda: None}, **bad)


def test_interleaved_clock_rejects_nothing_to_time():
    with pytest.raises(ValueError, match="fns: expected at least one call"):
        time_interleaved({})


def test_cache_flush_reads_past_the_last_level_cache():
    flush = timing.cache_flush("cpu")
    cache = timing.last_level_cache_bytes("cpu") or 0
    assert flush.__self__.numel() * 4 >= max(2 * cache, 64 * 2**20)
    flush()


# ---- the measuring helper, run twice ------------------------------------------------------------------------


def _ratios(sweep):
    return {f"{name} / residual, n = {r['n']}": r[f"{name}_s"] / r["residual_s"]
            for r in sweep for name in ("hc", "mhc")}


def test_the_lane_sweep_run_twice_agrees_with_itself(one_thread):
    """Lab 04's sweep (its shape, n = 1 and 8) measured twice: every ratio within 35% (lab 04 asks 20% of a run
    on one machine; this test also runs beside other tests on a shared 2-core machine). A clock that lets fresh
    pages or the cache's state in lets the residual's time alone swing tenfold."""
    first, second = (_ratios(memory_wall.lane_sweep(TOKENS, C, (1, 8), "cpu", rounds=7)) for _ in range(2))
    spread = {key: max(first[key], second[key]) / min(first[key], second[key]) for key in first}
    print("ratio spread between the two runs:", {k: round(v, 3) for k, v in spread.items()})
    assert all(v < 1.35 for v in spread.values()), spread


def test_the_roof_and_layers_of_lab_04_run_twice_agree(one_thread):
    """measure_live twice: the copy, the ridge and each layer's share of the copy within 35% of the other run."""
    runs = [memory_wall.measure_live(TOKENS, 4, C, "cpu", torch.float32, rounds=7) for _ in range(2)]
    figures = []
    for roof, rows in runs:
        figures.append({"ridge": roof.ridge, **{r["label"]: r["fraction_of_copy"] for r in rows}})
    spread = {key: max(a, b) / min(a, b) for key, a, b in
              ((k, figures[0][k], figures[1][k]) for k in figures[0])}
    print("spread between the two runs:", {k: round(v, 3) for k, v in spread.items()})
    assert all(v < 1.35 for v in spread.values()), spread


# ---- sentences about a live run, from stand-in measurements --------------------------------------------------


def _rows(seconds: dict[str, float], copy_gbs: float = 10.0, launches=None) -> list[dict]:
    launches = launches or {"residual": 1, "hc": 17, "mhc": 144}
    labels = {"residual": "residual merge", "hc": "HC site", "mhc": "mHC site"}
    rows = []
    for layer, s in seconds.items():
        n = 1 if layer == "residual" else 4
        counted = TOKENS * bytes_model.bytes_per_token(layer, n, C, stream_dtype=torch.float32)
        rows.append({"layer": layer, "label": labels[layer], "mode": "eager", "pass": "forward", "tokens": TOKENS,
                     "n": n, "C": C, "median_s": s, "launches": launches[layer], "counted_bytes": counted,
                     "gbs": counted / s / 1e9, "fraction_of_copy": counted / s / 1e9 / copy_gbs})
    return rows


ROOF = roofline.Roof("CPU (stand-in, 1 thread)", bandwidth_gbs=10.0, matmul_tflops=0.05, matmul_dtype="float32")


def test_roof_lines_name_the_expected_layer_when_the_machine_agrees():
    lines = memory_wall.roof_lines(_rows({"residual": 0.0008, "hc": 0.02, "mhc": 0.03}), ROOF)
    text = "\n".join(lines)
    assert "Furthest below the roof: the mHC site" in text and "As expected" in text and "(144)" in text
    assert "disagrees" not in text and "Above the roof" not in text
    assert all("left of the ridge (5.0)" in line for line in lines[:3])


def test_roof_lines_say_so_when_the_machine_disagrees():
    text = "\n".join(memory_wall.roof_lines(_rows({"residual": 0.0008, "hc": 0.04, "mhc": 0.03}), ROOF))
    assert "Furthest below the roof: the HC site" in text
    assert "As expected" not in text and "this machine disagrees" in text
    assert "144 operations against the HC site's 17" in text  # the counts come from the rows


def test_roof_lines_explain_a_layer_above_the_roof():
    rows = _rows({"residual": 0.0002, "hc": 0.02, "mhc": 0.03})  # the residual: 6.3 MB in 0.2 ms, 315% of the copy
    text = "\n".join(memory_wall.roof_lines(rows, ROOF))
    assert "residual merge    0.083 FLOP/byte, left of the ridge (5.0); 315% of the roof above it" in text
    assert "Above the roof: residual merge; the bytes model counts every read and write" in text


def test_bound_lines_never_say_a_fraction_slower():
    lines = memory_wall.bound_lines(_rows({"residual": 0.0002, "hc": 0.02, "mhc": 0.03}), 10.0)
    assert lines[0].startswith("residual merge") and "0.32x the least time" in lines[0] and "FASTER" in lines[0]
    assert "2.8x the least time its counted bytes take at the copy rate" in lines[1] and "FASTER" not in lines[1]
    assert not any("slower" in line for line in lines)


def test_copy_lines_derive_why_two_recorded_copies_differ():
    wall = {"environment": {"gpu": "GPU X", "date": "d1"}, "results": {"copy_bandwidth_gbs": 4000.0}}
    small = {"environment": {"gpu": "GPU X", "date": "d1"}, "results": {"rows": [
        {"kernel": "copy", "counted_bytes": 4000 * 10**6 // 100, "median_s": 11e-6, "gbs": 3636.4,
         "dtype": "bfloat16"}]}}
    lines = memory_wall.copy_lines(wall, small)
    assert lines[0].startswith("copy bandwidth (recorded): 4000 GB/s, copying 1024 MiB of float32")
    assert "10.0 us is its bytes at 4000 GB/s; the other 1.0 us" in lines[1] and "9.1% of that copy" in lines[1]
    other_gpu = {**small, "environment": {"gpu": "GPU Y"}}
    assert len(memory_wall.copy_lines(wall, other_gpu)) == 1 and len(memory_wall.copy_lines(wall, None)) == 1
