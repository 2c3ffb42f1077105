"""The roofline of the machine you are on: measured copy bandwidth and matmul throughput, and a plot that
places any kernel or layer on it by its counted bytes and FLOPs and its measured time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhc_lab.measure import gigabytes_per_second, time_fn

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


def measure_copy_bandwidth(device: torch.device | str, megabytes: int = 64, repeat: int = 10) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    device = torch.device(device)
    n = megabytes * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=2, repeat=repeat, device=device)["median_s"]
    return gigabytes_per_second(copy_bytes(src.numel(), src.dtype), t)


def measure_matmul_tflops(device: torch.device | str, size: int = 1024, dtype=None, repeat: int = 5) -> float:
    """TFLOP/s of one square matmul (2 size^3 FLOPs), in bf16 on a GPU and float32 on a CPU by default."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, warmup=2, repeat=repeat, device=device)["median_s"]
    return 2 * size**3 / t / 1e12


def measure_roof(device: torch.device | str, small: bool = True) -> Roof:
    """Both roofs of ``device``; small mode keeps it to a second or two on a laptop CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        bandwidth = measure_copy_bandwidth(device, megabytes=1024, repeat=20)
        tflops = measure_matmul_tflops(device, size=8192, repeat=10)
        name = torch.cuda.get_device_name(device)
    else:
        bandwidth = measure_copy_bandwidth(device, megabytes=64 if small else 256)
        tflops = measure_matmul_tflops(device, size=512 if small else 2048)
        import platform

        threads = torch.get_num_threads()
        name = f"CPU ({platform.machine()}, {threads} thread{'s' if threads != 1 else ''})"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return Roof(name, bandwidth, tflops, dtype)


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
