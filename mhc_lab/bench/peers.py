"""One mHC site beside the fused implementations a user can choose today (part 'peers' of the training benchmark).

n = 4, bf16 lanes, layer F = identity, the same numbers for every implementation (phi rounded to bf16 first, so
that a peer which keeps phi in bf16 reads the same values as one that keeps it in float32), each in its own
layout and its recommended settings:

    ours                 mhc_lab.ops.mhc_site: lanes [T, n, C], phi [n² + 2n, nC] rows [pre, post, res] in
                         float32, alpha [3], H_res applied transposed (DeepSeek-V4's convention)
    tilekernels          DeepSeek's tile_kernels.mhc kernels (2.x), composed as tile_kernels.torch.mhc composes
                         its references: the projection (phi x and the squares' sums, which DeepSeek runs in
                         DeepGEMM, a separate library) by torch, then reduce + RMSNorm, split mixes, Sinkhorn,
                         apply mix, post; forward and backward by its own kernels. Same convention as ours.
    liger                Liger-Kernel's LigerMHC functions: phi [nC, n² + 2n] in bf16 (its recommendation),
                         three scalar alphas, H_res applied untransposed: the res logits are permuted so that it
                         computes our site (Sinkhorn then normalises the other axis first: its error says by how
                         much that differs after 20 rounds)
    transformer_engine   TransformerEngine's Triton mHC (n = 4 only): lanes [T, C, n], phi's columns in that
                         flattening order, beta [1, n² + 2n]; its one cuBLAS call (phi's gradient) is TE's
                         compiled core, which is replaced by torch.matmul (cuBLAS too) so that its Python and
                         Triton parts run without that core.

Each implementation's output and gradients are compared with a float64 site on the same numbers.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

N = 4
PEERS = ("ours", "tilekernels", "liger", "transformer_engine")
PACKAGES = {"tilekernels": "tile-kernels", "liger": "liger-kernel", "transformer_engine": "transformer-engine"}
GRADIENTS = ("x", "phi", "bias", "alpha")
SINKHORN_ROUNDS = 20
EPS = 1e-6  # H_pre's epsilon, Sinkhorn's epsilon and the RMS norm's epsilon, as in DeepSeek-V4


def peer_versions() -> dict[str, str | None]:
    """The installed version of each peer's package (None where it is not installed)."""
    from importlib import metadata

    out = {}
    for name, package in PACKAGES.items():
        try:
            out[name] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def res_transposed(n: int = N) -> torch.Tensor:
    """The permutation of the n² res logits that transposes H_res (index i n + j -> j n + i)."""
    idx = torch.arange(n * n).view(n, n)
    return idx.t().reshape(-1)


def rows_for_untransposed_res(n: int = N) -> torch.Tensor:
    """Row order of phi (and bias) for an implementation that applies H_res untransposed."""
    return torch.cat([torch.arange(2 * n), 2 * n + res_transposed(n)])


def lanes_last_columns(n: int, C: int) -> torch.Tensor:
    """Column order of phi for lanes laid out [C, n] (flattened c n + i) instead of [n, C] (i C + c)."""
    return torch.arange(n * C).view(n, C).t().reshape(-1)


@dataclass
class Site:
    """One implementation: ``operands(x, phi, bias, alpha)`` makes its leaves (its layout, its dtypes) from our
    numbers; ``forward(*leaves)`` is the site; ``to_ours(out)`` and ``grads_to_ours(grads)`` map back."""

    name: str
    operands: Callable
    forward: Callable
    to_ours: Callable = lambda out: out
    grads_to_ours: Callable = lambda grads: grads
    upstream: Callable = lambda g: g  # our upstream gradient [T, n, C] in its output's layout
    note: str = ""


# ---- ours --------------------------------------------------------------------------------------------------


def ours() -> Site:
    from mhc_lab.ops import mhc_site

    def forward(x, phi, bias, alpha):
        return mhc_site(x, phi, bias, alpha, lambda y: y, backend="kernels")

    return Site("ours", lambda *t: t, forward, note="mhc_lab.ops.mhc_site")


# ---- Liger-Kernel ------------------------------------------------------------------------------------------


def liger_operands(x, phi, bias, alpha):
    """Our numbers in Liger's convention: phi [nC, m] in bf16, bias [m], three scalar alphas; the res logits
    permuted so that its untransposed H_res is (up to Sinkhorn's order of normalising) our transposed one."""
    rows = rows_for_untransposed_res(x.shape[-2]).to(phi.device)
    return (x, phi[rows].t().contiguous().bfloat16(), bias[rows].contiguous(), alpha[0].clone(), alpha[1].clone(),
            alpha[2].clone())


def liger_grads_to_ours(grads):
    """Liger's gradients (x, phi [nC, m], b, the three alphas) in our convention."""
    gx, gphi_t, gb, ga0, ga1, ga2 = grads
    inverse = torch.argsort(rows_for_untransposed_res(gx.shape[-2]).to(gb.device))
    return gx, gphi_t.t().float()[inverse], gb[inverse], torch.stack([ga0, ga1, ga2])


def liger() -> Site:
    from liger_kernel.transformers.functional import liger_mhc_coeffs, liger_mhc_post_res, liger_mhc_pre

    def forward(x, phi_t, b, a_pre, a_post, a_res):
        h_pre, h_post, h_res = liger_mhc_coeffs(x, phi_t, b, a_pre, a_post, a_res, tmax=SINKHORN_ROUNDS,
                                                rms_eps=EPS, pre_eps=EPS, sinkhorn_eps=EPS, post_mult=2.0)
        y = liger_mhc_pre(x, h_pre)
        return liger_mhc_post_res(x, y, h_post, h_res)

    return Site("liger", liger_operands, forward, grads_to_ours=liger_grads_to_ours,
                note="phi bf16 [nC, m], scalar alphas, res logits permuted (H_res applied untransposed)")


# ---- TransformerEngine -------------------------------------------------------------------------------------


def _transformer_engine_mhc():
    """TE's transformer_engine/pytorch/triton/mhc.py loaded without TE's compiled core: the package's own
    __init__ loads that core, so the two mhc modules are loaded by path under stand-in packages, and
    cpp_extensions.gemm.general_gemm (its one cuBLAS call) is torch.matmul. Where the package without its core
    would break other imports (an installed but empty transformer-engine raises on import, which other libraries'
    optional imports do not expect), its files can live outside the import path:
    MHC_LAB_TRANSFORMER_ENGINE_SOURCE names their folder."""
    if "mhc_lab_te_mhc" in sys.modules:
        return sys.modules["mhc_lab_te_mhc"]
    root = os.environ.get("MHC_LAB_TRANSFORMER_ENGINE_SOURCE")
    if root is None:
        spec = importlib.util.find_spec("transformer_engine")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("transformer_engine is not installed (or set MHC_LAB_TRANSFORMER_ENGINE_SOURCE "
                                      "to the folder of its Python files)")
        root = list(spec.submodule_search_locations)[0]

    def package(name, path=None):
        module = types.ModuleType(name)
        module.__path__ = [path] if path else []
        sys.modules.setdefault(name, module)
        return sys.modules[name]

    saved = {k: sys.modules.get(k) for k in ("transformer_engine", "transformer_engine.common",
                                            "transformer_engine.common.triton", "transformer_engine.pytorch",
                                            "transformer_engine.pytorch.cpp_extensions",
                                            "transformer_engine.pytorch.cpp_extensions.gemm")}
    try:
        for k in saved:
            sys.modules.pop(k, None)
        package("transformer_engine", root)
        package("transformer_engine.common", f"{root}/common")
        package("transformer_engine.common.triton", f"{root}/common/triton")
        package("transformer_engine.pytorch", f"{root}/pytorch")
        package("transformer_engine.pytorch.cpp_extensions")
        gemm = types.ModuleType("transformer_engine.pytorch.cpp_extensions.gemm")
        gemm.general_gemm = _general_gemm
        sys.modules[gemm.__name__] = gemm
        common_spec = importlib.util.spec_from_file_location("transformer_engine.common.triton.mhc",
                                                             f"{root}/common/triton/mhc.py")
        common = importlib.util.module_from_spec(common_spec)
        sys.modules[common_spec.name] = common
        common_spec.loader.exec_module(common)
        te_spec = importlib.util.spec_from_file_location("mhc_lab_te_mhc", f"{root}/pytorch/triton/mhc.py")
        te = importlib.util.module_from_spec(te_spec)
        te_spec.loader.exec_module(te)
        sys.modules["mhc_lab_te_mhc"] = te
        return te
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None) if k != "transformer_engine.common.triton.mhc" else None
            else:
                sys.modules[k] = v


def _general_gemm(A, B, out_dtype=None, layout="TN", out=None, accumulate=False, **_):
    """TE's cuBLAS wrapper for the one call its mHC makes: D = op(B) op(A) with TE's 'TN' / 'NN' / 'NT' layouts
    (column-major names: the first letter is A's, the second B's). Returns (D, ...) as TE's does."""
    a = A.t() if layout[0] == "T" else A
    b = B.t() if layout[1] == "T" else B
    d = b.float() @ a.float() if out_dtype in (None, torch.float32) else (b @ a)
    if out is not None:
        if accumulate:
            out.add_(d.to(out.dtype))
        else:
            out.copy_(d.to(out.dtype))
        d = out
    elif out_dtype is not None:
        d = d.to(out_dtype)
    return d, None, None, None


def te_operands(x, phi, bias, alpha):
    """Our numbers in TE's convention: lanes [T, 1, C, n], phi's columns in that flattening order, alpha [3],
    beta [1, m]."""
    T, n, C = x.shape
    cols = lanes_last_columns(n, C).to(x.device)
    return x.transpose(1, 2).contiguous().view(T, 1, C, n), phi[:, cols].contiguous(), alpha.clone(), \
        bias.view(1, -1).clone()


def te_to_ours(lanes):
    """TE's lanes [T, 1, C, n] as ours [T, n, C]."""
    T, _, C, n = lanes.shape
    return lanes.view(T, C, n).transpose(1, 2)


def te_from_ours(lanes):
    T, n, C = lanes.shape
    return lanes.transpose(1, 2).contiguous().view(T, 1, C, n)


def te_grads_to_ours(grads):
    gx, gphi, galpha, gbeta = grads
    T, _, C, n = gx.shape
    inverse = torch.argsort(lanes_last_columns(n, C).to(gx.device))
    return te_to_ours(gx), gphi[:, inverse], gbeta.view(-1), galpha


def transformer_engine() -> Site:
    te = _transformer_engine_mhc()

    def forward(x, phi, alpha, beta):
        y, h_post, h_res = te.mhc_generate_mix_and_aggregate(x, phi, alpha, beta)
        return te.mhc_fused_expand_combine(y, None, h_post, x, h_res, N)

    return Site("transformer_engine", te_operands, forward, te_to_ours, te_grads_to_ours, upstream=te_from_ours,
                note="lanes [T, C, n]; general_gemm by torch.matmul (TE's compiled core not loaded)")


# ---- TileKernels 2.x ---------------------------------------------------------------------------------------


class _TileKernelsPre(torch.autograd.Function):
    """x [1, T, n, C] bf16, phi [m, nC], scale [3], base [m] -> y [1, T, C] bf16, post [1, T, n, 1], res [1, T, n,
    n]: the projection (phi x and the squares' sums) by torch, every other step by tile_kernels.mhc's kernels,
    forward and backward."""

    @staticmethod
    def forward(ctx, x, phi, scale, base):
        from tile_kernels import mhc as tk

        S, T, n, C = x.shape
        m, K = phi.shape
        tokens = S * T
        xf = x.reshape(tokens, K).float()
        out_mul = (xf @ phi.t()).view(1, tokens, 1, m)  # one split: the whole of nC at once
        sqrsum = xf.square().sum(-1).view(1, tokens, 1)
        mul = torch.empty(tokens, 1, m, dtype=torch.float32, device=x.device)
        sq = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
        mixes = torch.empty(S, T, m, dtype=torch.float32, device=x.device)
        tk.mhc_reduce_partials_and_rmsnorm_fwd(out_mul, sqrsum, mul, sq, mixes.view(tokens, m), K, EPS, 1)
        pre = torch.empty(S, T, n, 1, dtype=torch.float32, device=x.device)
        post = torch.empty_like(pre)
        comb = torch.empty(S, T, n, n, dtype=torch.float32, device=x.device)
        tk.mhc_pre_split_mixes_fwd(mixes.view(tokens, m), scale, base, pre.view(tokens, n), post.view(tokens, n),
                                   comb.view(tokens, n * n), 2.0, EPS)
        res = torch.empty_like(comb)
        tk.mhc_sinkhorn_fwd(comb.view(tokens, n, n), res.view(tokens, n, n), SINKHORN_ROUNDS, EPS)
        y = torch.empty(S, T, C, dtype=x.dtype, device=x.device)
        tk.mhc_pre_apply_mix_fwd(x.view(tokens, n, C), pre.view(tokens, n), y.view(tokens, C))
        ctx.save_for_backward(x, phi, scale, base, mul, sq, mixes, pre, post, comb)
        return y, post, res

    @staticmethod
    def backward(ctx, dy, dpost, dres):
        from tile_kernels import mhc as tk

        x, phi, scale, base, mul, sq, mixes, pre, post, comb = ctx.saved_tensors
        S, T, n, C = x.shape
        K, tokens = n * C, S * T
        dx = torch.zeros(tokens, n, C, dtype=x.dtype, device=x.device)  # the kernel accumulates into it
        dpre = tk.mhc_pre_apply_mix_bwd(dy.contiguous().view(tokens, C), x.view(tokens, n, C),
                                        pre.view(tokens, n), dx)
        dcomb = torch.empty_like(comb)
        tk.mhc_sinkhorn_bwd(dres.contiguous().view(tokens, n, n), comb.view(tokens, n, n), dcomb.view(tokens, n, n),
                            SINKHORN_ROUNDS, EPS)
        m = mul.shape[-1]
        dmixes = torch.empty(tokens, m, dtype=torch.float32, device=x.device)
        dscale, dbase = torch.empty_like(scale), torch.empty_like(base)
        tk.mhc_pre_split_mixes_bwd(dpre.view(tokens, n), dpost.contiguous().view(tokens, n),
                                   dcomb.view(tokens, n * n), mixes.view(tokens, m), post.view(tokens, n), scale,
                                   base, dmixes, dscale, dbase, 2.0)
        dmul, dsq = torch.empty_like(mul), torch.empty_like(sq)
        tk.mhc_reduce_partials_and_rmsnorm_bwd(dmixes, mul, sq, dmul, dsq, K, EPS)
        xf = x.reshape(tokens, K).float()
        dmul2 = dmul.view(tokens, m)
        dphi = dmul2.t() @ xf
        dx_flat = dx.view(tokens, K).float() + dmul2 @ phi + 2 * dsq.view(tokens, 1) * xf
        return dx_flat.view(x.shape).to(x.dtype), dphi, dscale, dbase


class _TileKernelsPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, x, post, res):
        from tile_kernels import mhc as tk

        out = tk.mhc_post_fwd(f, x, post, res)
        ctx.save_for_backward(f, x, post, res)
        return out

    @staticmethod
    def backward(ctx, dout):
        from tile_kernels import mhc as tk

        f, x, post, res = ctx.saved_tensors
        return tk.mhc_post_bwd(f, x, post, res, dout.contiguous())


def tilekernels() -> Site:
    import tile_kernels.mhc  # noqa: F401 - fails here, not in the timing, where it cannot load

    def forward(x, phi, bias, alpha):
        r = x.unsqueeze(0)
        y, post, res = _TileKernelsPre.apply(r, phi, alpha, bias)
        return _TileKernelsPost.apply(y, r, post, res).squeeze(0)

    return Site("tilekernels", lambda *t: t, forward,
                note="tile_kernels.mhc kernels; the projection GEMM by torch (DeepSeek runs it in DeepGEMM)")


MAKERS = {"ours": ours, "tilekernels": tilekernels, "liger": liger, "transformer_engine": transformer_engine}


# ---- the same numbers, and the float64 site ----------------------------------------------------------------


def site_numbers(tokens: int, C: int, seed: int = 0, device: str = "cuda"):
    """bf16 lanes x [T, n, C], phi [m, nC] (float32 holding bf16 values), bias [m], alpha [3]."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = N * N + 2 * N
    x = torch.randn(tokens, N, C, device=device, generator=g).bfloat16()
    phi = (torch.randn(m, N * C, device=device, generator=g) / (N * C) ** 0.5).bfloat16().float()
    bias = torch.randn(m, device=device, generator=g) * 0.5
    alpha = torch.rand(3, device=device, generator=g) + 0.5
    upstream = torch.randn(x.shape, device=device, generator=g).bfloat16()
    return (x, phi, bias, alpha), upstream


def float64_site(x, phi, bias, alpha, upstream):
    """The site (F = identity) in float64 on the same numbers: output and the gradients of x, phi, bias, alpha."""
    from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

    leaves = [t.detach().double().requires_grad_() for t in (x, phi, bias, alpha)]
    pre, post, res = mhc_coefficients(*leaves, iterations=SINKHORN_ROUNDS, eps=EPS, rms_eps=EPS)
    out = mhc_post(leaves[0], mhc_pre(leaves[0], pre), post, res)
    grads = torch.autograd.grad(out, leaves, upstream.double())
    return out.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def errors_against_float64(site: Site, numbers, upstream) -> dict:
    """Relative errors of the site's output and gradients against the float64 site."""
    want_out, want_grads = float64_site(*numbers, upstream)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in site.operands(*numbers)]
    out = site.forward(*leaves)
    grads = site.grads_to_ours(torch.autograd.grad(out, leaves, site.upstream(upstream)))
    errs = {"out": rel(site.to_ours(out), want_out)}
    errs.update({k: rel(g, w) for k, g, w in zip(GRADIENTS, grads, want_grads)})
    return errs


# ---- the benchmark -----------------------------------------------------------------------------------------


def least_elements(n: int = N) -> dict[str, int]:
    """Lane-wide elements per token, in units of C, that any site must move: forward, and forward + backward
    (mhc_lab.measure.bytes_model's fewest-bytes plan)."""
    from mhc_lab.measure import bytes_model

    forward = bytes_model.total("mhc_minimal", n, "forward").moved.per_C
    both = sum(bytes_model.total("mhc_minimal", n, d).moved.per_C for d in bytes_model.DIRECTIONS)
    return {"forward": forward, "forward_backward": both}


def bench_peers(tokens: int, C: int, bench, copy_gbps: float, *, peers=PEERS, rounds: int = 3, log=print) -> dict:
    """One shape: each peer's relative errors against the float64 site, its forward and forward + backward
    launched from Python and as CUDA graphs (then the graphs again in ``rounds`` interleaved rounds), and the
    share of the copy floor each reaches (the least bytes a site moves over its time, against ``copy_gbps``)."""
    from mhc_lab.bench.common import graph_replay, interleaved_rounds

    numbers, upstream = site_numbers(tokens, C)
    least = least_elements(N)
    out = {"tokens": tokens, "C": C, "n": N,
           "least_bytes": {k: tokens * v * C * 2 for k, v in least.items()},
           "rel_err": {}, "launched_ms": {}, "graph_ms": {}, "notes": {}, "errors": {}}
    replays = {}
    for name in peers:
        try:
            site = MAKERS[name]()
            out["notes"][name] = site.note
            out["rel_err"][name] = errors_against_float64(site, numbers, upstream)
            leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in site.operands(*numbers)]
            g = site.upstream(upstream)

            def forward(site=site, leaves=leaves):
                return site.forward(*leaves)

            def step(site=site, leaves=leaves, g=g):
                return torch.autograd.grad(site.forward(*leaves), leaves, g)

            out["launched_ms"][name] = {"forward": bench(forward) * 1e3, "forward_backward": bench(step) * 1e3}
            graphs = {"forward": graph_replay(forward), "forward_backward": graph_replay(step)}
            out["graph_ms"][name] = {k: bench(r) * 1e3 for k, r in graphs.items()}
            for k, r in graphs.items():
                replays[f"{name}.{k}"] = r
            errs = " ".join(f"{k} {v:.1e}" for k, v in out["rel_err"][name].items())
            log(f"  peers {tokens}x{C} {name:18s} forward {out['launched_ms'][name]['forward']:7.3f} / "
                f"{out['graph_ms'][name]['forward']:7.3f} ms, forward+backward "
                f"{out['launched_ms'][name]['forward_backward']:7.3f} / "
                f"{out['graph_ms'][name]['forward_backward']:7.3f} ms (launched / graph); rel err {errs}")
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is recorded with why
            out["errors"][name] = repr(e)[:500]
            log(f"  peers {tokens}x{C} {name:18s} FAILED {repr(e)[:300]}")
        torch.cuda.synchronize()
    if replays:
        rounds_ms = interleaved_rounds(replays, bench, rounds)
        out["graph_rounds_ms"] = {}
        for key, times in rounds_ms.items():
            name, what = key.split(".")
            out["graph_rounds_ms"].setdefault(name, {})[what] = times
        replays.clear()
    out["copy_floor_share"] = {
        name: {what: out["least_bytes"][what] / (ms * 1e-3) / 1e9 / copy_gbps for what, ms in times.items()}
        for name, times in out["graph_ms"].items()}
    return out
