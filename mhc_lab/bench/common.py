"""What the GPU benchmarks share: the timer, the copy bandwidth they are judged against, a site's inputs and
reference, DeepSeek's TileKernels, CUDA graph replays and interleaved rounds."""

from __future__ import annotations

import functools
import math
import statistics

import torch

from mhc_lab.measure import bench_command, save_sections
from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

N = 4  # lanes, as in the paper's models and DeepSeek-V4
SHAPES = ((16384, 2560), (16384, 4096), (8192, 7168))  # tokens x C of the sites


def gpu_timer():
    """(bench, name): bench(fn, warmup_ms, rep_ms) -> median seconds of fn. triton.testing.do_bench (median,
    the L2 flushed between runs) where Triton is installed, else CUDA events through measure.time_fn."""
    try:
        from triton.testing import do_bench

        def bench(fn, warmup_ms=25, rep_ms=100):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3

        return bench, "triton.testing.do_bench (median, L2 flushed between runs)"
    except Exception:  # noqa: BLE001 - no triton: CUDA events through measure.time_fn
        from mhc_lab.measure import time_fn

        def bench(fn, warmup_ms=25, rep_ms=100):
            return time_fn(fn, warmup=3, repeat=20)["median_s"]

        return bench, "mhc_lab.measure.time_fn (median of CUDA events)"


def compile_pass(measure, steps: list, label: str = "building the kernels before any clock starts") -> float:
    """Run ``measure(step, bench)`` for each of ``steps`` with a bench that calls each function once and times
    nothing, so that every kernel the measurement uses is built (TileLang compiles on first use; its on-disk
    cache makes the next run, in any lab, fast) before a timed run starts. Returns the seconds it took."""
    import time

    from tqdm.auto import tqdm

    def once(fn, warmup_ms=None, rep_ms=None):
        fn()
        torch.cuda.synchronize()
        return 1.0

    start = time.perf_counter()
    for step in tqdm(steps, desc=label):
        measure(step, once)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth(bench, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of nbytes, counting bytes read + written, in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src))
    return 2 * nbytes / seconds / 1e9


def l2_read_bandwidth(mbytes: int = 24, loops: int = 200) -> float:
    """Repeated reads of a buffer that fits in L2 (a sum over it), GB/s: the ceiling of on-chip re-reads."""
    a = torch.randn(mbytes * 2**20 // 4, device="cuda")
    for _ in range(3):
        a.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loops):
        a.sum()
    end.record()
    end.synchronize()
    return loops * a.numel() * 4 / (start.elapsed_time(end) * 1e-3) / 1e9


def site_inputs(tokens: int, C: int, seed: int = 0):
    """A site's random bf16 lanes x [tokens, N, C] and float32 phi, bias, alpha on the GPU (seeded)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = N * N + 2 * N
    x = torch.randn(tokens, N, C, device="cuda", generator=g).bfloat16()
    phi = torch.randn(m, N * C, device="cuda", generator=g) / math.sqrt(N * C)
    bias = torch.randn(m, device="cuda", generator=g) * 0.5
    alpha = torch.rand(3, device="cuda", generator=g) + 0.5
    return x, phi, bias, alpha


def reference_site(x, phi, bias, alpha):
    """One site with F = identity, as mhc_lab.reference computes it."""
    pre, post, res = mhc_coefficients(x, phi, bias, alpha)
    return mhc_post(x, mhc_pre(x, pre), post, res)


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@functools.lru_cache(maxsize=None)
def tilekernels_ops():
    """DeepSeek's TileKernels mhc_pre and mhc_post (tile-kernels 1.0.0), looked up once: its package __init__
    imports a module that TileLang 0.1.15 removed, and a failed import runs again at every import statement
    (about 5 ms of the host's time per call, which a launched timing would charge to TileKernels). The mhc
    modules load after that failure, so it is tolerated once."""
    try:
        import tile_kernels  # noqa: F401
    except ModuleNotFoundError:
        pass
    from tile_kernels.modeling.mhc import mhc_pre as tk_pre
    from tile_kernels.modeling.mhc.ops.post import mhc_post as tk_post

    return tk_pre, tk_post


def tilekernels_site(x, phi, bias, alpha, layer=None):
    """One site through TileKernels (20 Sinkhorn rounds, H_post's multiplier 2, passed explicitly): it wants
    lanes as [sequences, tokens, n, C]."""
    tk_pre, tk_post = tilekernels_ops()
    r = x.unsqueeze(0)
    y, (post_mix, comb_mix) = tk_pre(r, phi, alpha, bias, post_mult_value=2.0, sinkhorn_repeat=20)
    f = y if layer is None else layer(y)
    return tk_post(f, r, post_mix, comb_mix).squeeze(0)


def graph_replay(step):
    """step captured as a CUDA graph (after three warm-up runs on a side stream): a function that replays it,
    whose time is the GPU's alone, without the host's per-op work. The replay holds step, and with it every
    tensor the graph reads: a replay whose tensors were freed would read whatever the allocator put there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()

    def replay():
        graph.replay()

    replay.step = step
    return replay


def interleaved_rounds(replays: dict, bench, rounds: int) -> dict[str, list[float]]:
    """Each of ``replays`` (name -> callable) timed by ``bench`` (seconds) in ``rounds`` rounds, the names in
    turn within each round, so that a drift of the GPU's clocks or temperature over the run reaches every
    implementation alike: name -> [ms per round]."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"interleaved_rounds: expected rounds >= 1, got {rounds!r}")
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(bench(replay) * 1e3)
    return times


def round_ratios(ours: list[float] | None, base: list[float] | None) -> dict:
    """The per-round ratio ours / base of two interleaved_rounds lists, with its median, least and most (an
    empty dict when either is missing)."""
    if not ours or not base:
        return {}
    ratios = [a / b for a, b in zip(ours, base)]
    return {"ratios": ratios, "median": statistics.median(ratios), "least": min(ratios), "most": max(ratios)}


def overheads(rounds_ms: dict[str, list[float]], base: str = "residual") -> dict:
    """Each kind's time over ``base``'s in percent, round by round: {kind: {median, least, most}}."""
    out = {}
    for kind, times in rounds_ms.items():
        if kind == base:
            continue
        ratio = round_ratios(times, rounds_ms.get(base))
        if ratio:
            out[kind] = {k: 100 * (ratio[k] - 1) for k in ("median", "least", "most")}
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'16384x2560,8192x7168' -> [(16384, 2560), (8192, 7168)]; a ValueError naming what it expected otherwise."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"expected TOKENSxC pairs of positive integers separated by commas (e.g. "
                             f"4096x768,8192x2048), got {text!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def section_saver(suite: str, args, argv, *, recording: str, order: tuple, sections: dict):
    """save(final) for a suite whose recording is made of sections (forward, training): writes ``sections`` as
    they stand (marked partial until ``final``) into the recording args.name, keeping its other sections;
    nothing with --no-save. The file's full command keeps only the --name and --out this run was given."""
    where = ["--name", args.name] if args.name != recording else []
    where += ["--out", args.out_dir] if args.out_dir else []

    def save(final: bool):
        if args.no_save:
            return None
        marked = {k: v if final else {**v, "partial": True} for k, v in sections.items()}
        return save_sections(args.name, marked, command=bench_command(suite, argv),
                             full_command=bench_command(suite, where), order=order, directory=args.out_dir)

    return save
