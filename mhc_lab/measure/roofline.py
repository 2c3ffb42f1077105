"""The roofline of the machine you are on: measured copy bandwidth and matmul throughput, and a plot that
places any kernel or layer on it by its counted bytes and FLOPs and its measured time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhc_lab.measure import gigabytes_per_second, time_interleaved

# Spec-sheet leads for devices we know (memory GB/s, dense bf16 TFLOP/s); measured roofs are drawn from these
# only when nothing was measured. Source: NVIDIA H200 datasheet (SXM).
SPEC_SHEETS = {
    "NVIDIA H200": {"bandwidth_gbs": 4800.0, "bf16_tflops": 989.0, "fp32_tflops": 67.0},
    "NVIDIA H100 80GB HBM3": {"bandwidth_gbs": 3350.0, "bf16_tflops": 989.0, "fp32_tflops": 67.0},
}


def copy_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes a copy of ``numel`` elements moves: each read once and written once."""
    return 2 * numel * torch.empty((), dtype=dtype).element_size()


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: int) -> float:
    """FLOP per byte of an [m, k] x [k, n] product that reads A and B and writes C once (2 FLOPs a MAC)."""
    return 2 * m * n * k / ((m * k + k * n + m * n) * bytes_per_element)


@dataclass(frozen=True)
class Roof:
    """A measured roof: bytes per second moved by a copy (read + written), FLOP/s of a large matmul."""

    device: str
    bandwidth_gbs: float
    matmul_tflops: float
    matmul_dtype: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP per byte) where the two roofs meet."""
        return self.matmul_tflops * 1e12 / (self.bandwidth_gbs * 1e9)

    def attainable_gflops(self, intensity: float) -> float:
        return min(self.matmul_tflops * 1e3, self.bandwidth_gbs * intensity)


def roof_sizes(gpu: bool, small: bool = True) -> tuple[int, int]:
    """(MiB of float32 the copy copies, side of the square matmul) that :func:`measure_roof` times: a copy well
    past the caches, and a matmul large enough to reach the machine's peak (bf16 on a GPU)."""
    return (1024, 8192) if gpu else ((64, 512) if small else (256, 2048))


def roof_kernels(device: torch.device | str, small: bool = True) -> dict[str, dict]:
    """The two kernels a roof is measured with, ready to time: {"copy": {"fn", "bytes"}, "matmul": {"fn",
    "flops"}}: a copy past the caches (bytes read plus written) and a square matmul into a kept output (2 size^3
    FLOPs, bf16 on a GPU and float32 on a CPU). Sizes from :func:`roof_sizes`."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    megabytes, size = roof_sizes(gpu, small)
    dtype = torch.bfloat16 if gpu else torch.float32
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    return {"copy": {"fn": lambda: dst.copy_(src), "bytes": copy_bytes(src.numel(), src.dtype)},
            "matmul": {"fn": lambda: torch.matmul(a, b, out=out), "flops": 2 * size**3,
                       "dtype": str(dtype).replace("torch.", "")}}


def roof_from(device: torch.device | str, kernels: dict, timings: dict) -> Roof:
    """The Roof that :func:`roof_kernels` timed (``timings``: measure.time_interleaved's, median_s of each)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        threads = torch.get_num_threads()
        name = f"CPU ({platform.machine()}, {threads} thread{'s' if threads != 1 else ''})"
    bandwidth = gigabytes_per_second(kernels["copy"]["bytes"], timings["copy"]["median_s"])
    tflops = kernels["matmul"]["flops"] / timings["matmul"]["median_s"] / 1e12
    return Roof(name, bandwidth, tflops, kernels["matmul"]["dtype"])


def measure_roof(device: torch.device | str, small: bool = True, rounds: int = 8) -> Roof:
    """Both roofs of ``device``, measured warm: :func:`roof_kernels` timed against each other by
    :func:`measure.time_interleaved` (a warm-up, then ``rounds`` rounds, each keeping a kernel's fastest of 3
    calls, and the median over rounds): the clock every live comparison of the labs uses, so a kernel timed the
    same way lands on the roof or under it by its own merit, not by the luck of a quieter moment. Small mode
    keeps it to a second or two on a laptop CPU."""
    kernels = roof_kernels(device, small)
    timings = time_interleaved({name: k["fn"] for name, k in kernels.items()}, rounds=rounds, warmup_s=0.2,
                               device=device)
    return roof_from(device, kernels, timings)


def position(roof: Roof, point: dict) -> float:
    """How high ``point`` ({"flops", "bytes", "seconds"}) reaches, as a fraction of the roof above it: its GB/s
    over the copy rate when it has no FLOPs, else its GFLOP/s over the roof at its intensity (1 is on the roof,
    below 1 under it, above 1 over it)."""
    if point["flops"] <= 0:
        return point["bytes"] / point["seconds"] / 1e9 / roof.bandwidth_gbs
    achieved = point["flops"] / point["seconds"] / 1e9
    return achieved / roof.attainable_gflops(point["flops"] / point["bytes"])


def position_lines(roof: Roof, points: list[dict], cache_bytes: int | None = None) -> list[str]:
    """One sentence per point: what fraction of the roof it reaches and, for a point above the roof, why it can.

    A point reaches past the roof it was measured against in two ways: under the bandwidth roof, its data fit
    in the cache (``cache_bytes``, the last level's size, when known) and never came from memory, as the roof's
    copy's did; or it is work like the roof's own, and two timings of it differ by the machine's noise."""
    lines = []
    for p in points:
        share = position(roof, p)
        where = "on the roof" if abs(share - 1) <= 0.05 else ("below the roof" if share < 1 else "ABOVE the roof")
        line = f"{p['name']}: {100 * share:.0f}% of the roof above it ({where})"
        if share > 1.05:
            memory_bound = p["flops"] <= 0 or p["flops"] / p["bytes"] < roof.ridge
            if memory_bound and cache_bytes and p["bytes"] <= cache_bytes:
                line += (f": its {p['bytes'] / 2**20:.1f} MiB fit in the {cache_bytes / 2**20:.0f} MiB cache, so it "
                         "need not fetch them from memory, which the roof's copy does")
            else:
                line += (": work like the roof's own, timed apart from it; two timings of the same work on this "
                         "machine differ by its noise (other programs, clocks), and this one came out faster")
        lines.append(line)
    return lines


def roofline_figure(roof: Roof, points: list[dict] | None = None, title: str | None = None,
                    spec: dict | None = None):
    """Plotly roofline (log-log): attainable GFLOP/s against FLOP per byte, with points placed on it.

    Each point is {"name", "flops", "bytes", "seconds"}: its intensity is flops / bytes, its height the
    achieved GFLOP/s. The x axis spans 1e-2 to past the ridge, widened to take in every point with FLOPs.

    A kernel with no FLOPs (a copy) has intensity 0, which a log axis cannot show. It is drawn at the plot's
    left edge, as a left-pointing triangle labelled "0 FLOP/byte", at the height its measured bytes per second
    reach there: on the slope of the bandwidth roof when it streams at the roof's rate, below it by as much as
    it falls short (its GB/s is in its label and hover text).
    """
    import numpy as np
    import plotly.graph_objects as go

    points = list(points or [])
    intensities = [p["flops"] / p["bytes"] for p in points if p["flops"] > 0]
    lo = min([1e-2] + [v / 2 for v in intensities])
    hi = max([1e3, roof.ridge * 20] + [v * 2 for v in intensities])
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[roof.attainable_gflops(v) for v in x], mode="lines",
                             name=f"measured roof ({roof.bandwidth_gbs:.0f} GB/s, "
                                  f"{roof.matmul_tflops:.2f} TFLOP/s {roof.matmul_dtype})"))
    if spec:
        fig.add_trace(go.Scatter(
            x=x, y=[min(spec["bf16_tflops"] * 1e3, spec["bandwidth_gbs"] * v) for v in x], mode="lines",
            line=dict(dash="dot"), name=f"spec sheet ({spec['bandwidth_gbs']:.0f} GB/s, {spec['bf16_tflops']:.0f} TFLOP/s)"))
    for p in points:
        gbs = p["bytes"] / p["seconds"] / 1e9
        if p["flops"] > 0:
            intensity = p["flops"] / p["bytes"]
            achieved = p["flops"] / p["seconds"] / 1e9
            style = dict(textposition="top center")
            label = p["name"]
            hover = f"{intensity:.3g} FLOP/byte, {gbs:.1f} GB/s, {achieved:.2f} GFLOP/s, {p['seconds'] * 1e3:.3f} ms"
        else:  # no FLOPs: intensity 0, drawn at the left edge on its own bandwidth slope
            intensity = lo
            achieved = gbs * lo
            style = dict(textposition="top right", cliponaxis=False, marker=dict(symbol="triangle-left", size=12))
            label = f"{p['name']}: 0 FLOP/byte, {gbs:.1f} GB/s"
            hover = (f"0 FLOPs: intensity 0, drawn at the left edge ({lo:g} FLOP/byte) at {gbs:.1f} GB/s x {lo:g} "
                     f"FLOP/byte; {p['seconds'] * 1e3:.3f} ms")
        fig.add_trace(go.Scatter(x=[intensity], y=[achieved], mode="markers+text", text=[label], name=label,
                                 hovertext=[hover], **style))
    fig.update_xaxes(type="log", range=[np.log10(lo), np.log10(hi)],
                     title="arithmetic intensity (FLOP per byte moved)")
    fig.update_yaxes(type="log", title="GFLOP/s")
    fig.update_layout(title=title or f"Roofline of {roof.device}", height=450, legend=dict(font=dict(size=10)))
    return fig
