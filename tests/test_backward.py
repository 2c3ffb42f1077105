"""The backward of one mHC site: the hand-derived reference, the fused backward kernels and the training ops.

- mhc_lab.reference.backward against autograd of the forward reference, in float64 (n = 1, 2, 4, 8, batch
  dimensions, awkward widths, random upstream gradients, never all-ones).
- The backward kernels through TileLang's C target against that float64 truth, on NaN-poisoned outputs;
  their sm_90 builds with nvcc; on a GPU (skipped otherwise) the CUDA kernels at bf16 tolerance, bitwise
  repeatable from run to run.
- The ops and modules of mhc_lab.ops.training: gradcheck, both backends, recompute, torch.compile, bad input.
"""

import contextlib
import math
import re

import pytest
import torch
from torch import nn

from mhc_lab.kernels import nvcc_path
from mhc_lab.reference import InputError, mhc_coefficients, mhc_post, mhc_pre
from mhc_lab.reference.backward import post_backward, pre_backward, sinkhorn_backward
from mhc_lab.reference.sinkhorn import sinkhorn

CUDA = torch.cuda.is_available()


def _site_inputs(lead, n, C, *, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = torch.randn(*lead, n, C, generator=g, dtype=torch.float64)
    phi = torch.randn(m, n * C, generator=g, dtype=torch.float64) / math.sqrt(n * C)
    bias = torch.randn(m, generator=g, dtype=torch.float64) * 0.5
    alpha = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    f = torch.randn(*lead, C, generator=g, dtype=torch.float64)
    return x.to(device, dtype), phi.to(device), bias.to(device), alpha.to(device), f.to(device, dtype)


def _upstream(lead, n, C, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, C, generator=g, dtype=torch.float64).to(device),
            torch.randn(*lead, n, generator=g, dtype=torch.float64).to(device),
            torch.randn(*lead, n, n, generator=g, dtype=torch.float64).to(device),
            torch.randn(*lead, n, C, generator=g, dtype=torch.float64).to(device))


def _autograd_pre(x, phi, bias, alpha, dy, dpost, dres):
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, bias, alpha)]
    co = mhc_coefficients(*leaves)
    return torch.autograd.grad((mhc_pre(leaves[0], co.pre), co.post, co.res), leaves, (dy, dpost, dres))


def _relmax(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} elements are NaN (never written?)"
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("n,C,lead", [(1, 5, (3,)), (2, 7, (2, 3)), (4, 6, (4,)), (8, 3, (2,))])
def test_reference_pre_backward_equals_autograd(n, C, lead):
    x, phi, bias, alpha, _ = _site_inputs(lead, n, C, seed=n)
    dy, dpost, dres, _ = _upstream(lead, n, C, seed=10 + n)
    want = _autograd_pre(x, phi, bias, alpha, dy, dpost, dres)
    got = pre_backward(x, phi, bias, alpha, dy, dpost, dres)
    for name, a, b in zip(got._fields, got, want):
        assert _relmax(a, b) < 1e-12, name


def test_reference_pre_backward_stays_on_the_lanes_device():
    """No tensor of the reference backward is made on the default device (meta: shapes only, any device)."""
    x, phi, bias, alpha, _ = (t.to("meta") for t in _site_inputs((3,), 4, 5))
    dy, dpost, dres, _ = (t.to("meta") for t in _upstream((3,), 4, 5))
    grads = pre_backward(x, phi, bias, alpha, dy, dpost, dres)
    assert all(g.device.type == "meta" for g in grads)
    assert [tuple(g.shape) for g in grads] == [(3, 4, 5), (24, 20), (24,), (3,)]


@pytest.mark.parametrize("n,C,lead", [(1, 5, (3,)), (4, 33, (2, 3)), (8, 2, (1,))])
def test_reference_post_backward_equals_autograd(n, C, lead):
    x, _, _, _, f = _site_inputs(lead, n, C, seed=n)
    g = _upstream(lead, n, C, seed=3)[3]
    post = torch.rand(*lead, n, dtype=torch.float64) * 2
    res = torch.rand(*lead, n, n, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, f, post, res)]
    want = torch.autograd.grad(mhc_post(*leaves), leaves, g)
    got = post_backward(x, f, post, res, g)
    for name, a, b in zip(got._fields, got, want):
        assert _relmax(a, b) < 1e-13, name


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sinkhorn_backward_by_recompute_equals_autograd(n):
    g = torch.Generator().manual_seed(n)
    logits = (torch.randn(5, n, n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    d = torch.randn(5, n, n, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(sinkhorn(logits), logits, d)[0]
    assert _relmax(sinkhorn_backward(logits.detach(), d), want) < 1e-10


# ----------------------------------------------------------------------------------------- C-target kernels

KERNEL_CASES = [(4, 37, 5), (4, 8, 1), (1, 9, 7), (2, 24, 13), (8, 5, 3)]
needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found: the sm_90 build check needs it")


@pytest.mark.parametrize("n,C,tokens", KERNEL_CASES)
def test_split_coefficient_kernels_c_target_equal_the_fused_one(n, C, tokens):
    """Kernel 1 as two programs (dH_pre reduced first, then the per-token backward) on the C target."""
    from mhc_lab.kernels.pre_backward import pre_backward_kernels

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((tokens,), n, C, seed=tokens))
    dy, dpost, dres, _ = (t.float() for t in _upstream((tokens,), n, C, seed=tokens + 4))
    flat = x.reshape(tokens, n * C)
    partial = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], -1)[None]
    m = n * n + 2 * n
    outs = {}
    for phases in ("fused", "split"):
        coefficients, _ = pre_backward_kernels(n, C, "float32", "c", phases=phases)
        got = [torch.full((tokens, k), float("nan")) for k in (n, m, m, 4)]
        coefficients(x, dy, partial, bias, alpha, dpost, dres, *got)
        outs[phases] = got
    for name, a, b in zip(("dpre", "dlogit", "dmix", "extra"), outs["split"], outs["fused"]):
        assert _relmax(a, b) < 1e-6, name


@pytest.mark.parametrize("lanes_grad", [True, False])
@pytest.mark.parametrize("n,C,tokens", KERNEL_CASES)
def test_post_backward_kernel_c_target(n, C, tokens, lanes_grad):
    """lanes_grad=False: no dx argument, the other three gradients as with it."""
    from mhc_lab.kernels.post_backward import post_backward_kernel

    x, _, _, _, f = _site_inputs((tokens,), n, C, seed=tokens)
    g = _upstream((tokens,), n, C, seed=tokens + 1)[3]
    post = torch.rand(tokens, n, dtype=torch.float64) * 2
    res = torch.rand(tokens, n, n, dtype=torch.float64)
    want = post_backward(x, f, post, res, g)
    names, want = (want._fields, want) if lanes_grad else (want._fields[1:], want[1:])
    outs = [torch.full(t.shape, float("nan")) for t in want]
    post_backward_kernel(n, C, "float32", "c", lanes_grad=lanes_grad)(x.float(), f.float(), g.float(),
                                                                       post.float(), res.float(), *outs)
    for name, a, b in zip(names, outs, want):
        assert _relmax(a, b) < 1e-5, name


@pytest.mark.parametrize("link", ["separate", "dx_post", "post_grad"])
@pytest.mark.parametrize("n,C,tokens", KERNEL_CASES)
def test_pre_backward_kernels_c_target(n, C, tokens, link):
    """dx_post: the lane kernel also adds another gradient of the lanes (the post's, in the linked site) to dx;
    post_grad: it takes the post's output gradient g and H_res instead, and adds H_res^T g."""
    from mhc_lab.kernels.pre_backward import pre_backward_kernels

    x, phi, bias, alpha, _ = _site_inputs((tokens,), n, C, seed=tokens)
    dy, dpost, dres, g = _upstream((tokens,), n, C, seed=tokens + 2)
    coefficients_ref = mhc_coefficients(x, phi, bias, alpha)
    want = pre_backward(x, phi, bias, alpha, dy, dpost, dres)
    res = torch.rand(tokens, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
    extra_dx = {"separate": 0, "dx_post": g, "post_grad": torch.einsum("tij,tic->tjc", res, g)}[link]
    want_dx = want.x + extra_dx
    m = n * n + 2 * n
    flat = x.reshape(tokens, n * C)
    partial = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], -1)[None].float()
    pre = coefficients_ref.pre.float()
    coefficients, lanes = pre_backward_kernels(n, C, "float32", "c", add_dx=link == "dx_post",
                                               post_grad=link == "post_grad")
    nan = float("nan")
    dpre, dlogit, dmix, extra = (torch.full((tokens, k), nan) for k in (n, m, m, 4))
    coefficients(x.float(), dy.float(), partial, bias.float(), alpha.float(), dpost.float(), dres.float(),
                 dpre, dlogit, dmix, extra)
    dx, dphi = torch.full(x.shape, nan), torch.full((1, m, n * C), nan)
    lanes_in = {"separate": [], "dx_post": [g.float()], "post_grad": [g.float(), res.float()]}[link]
    lanes(x.float(), dy.float(), pre, dmix, extra, phi.float(), *lanes_in, dx, dphi)
    assert _relmax(dx, want_dx) < 1e-5
    assert _relmax(dphi[0], want.phi) < 1e-5
    assert _relmax(dlogit.sum(0), want.bias) < 1e-5
    assert _relmax(extra[:, :3].sum(0), want.alpha) < 1e-4
    assert _relmax(dpre, torch.einsum("tc,tjc->tj", dy, x)) < 1e-5


@needs_nvcc
@pytest.mark.parametrize("n,C,dtype", [(4, 4096, "bfloat16"), (8, 100, "float16"), (1, 7, "float32")])
def test_post_backward_builds_for_sm90(n, C, dtype):
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.post_backward import post_backward_program

    kernel = compile_program(post_backward_program(n, C, dtype, "sm_90"), "sm_90")
    source = kernel.get_kernel_source()
    assert "warp_reduce_sum" in source
    if C % 8 == 0 and dtype != "float32":
        assert "uint4" in source  # 16-byte vector loads and stores


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40), (1, 1000), (8, 8)])
def test_the_post_gradient_path_builds_for_sm90(n, C):
    """post_grad: kernel 2 takes all n lanes of g per CTA, with H_res, through its pipeline (TMA); the post
    backward without dx writes only df of the lanes' width."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.post_backward import post_backward_program
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    lanes = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True), "sm_90")
    source = lanes.get_kernel_source()
    assert "wgmma" in source and "tma_load(g_desc" in source
    assert source.count("tma_load(g_desc") == n  # one box per lane of g and stage
    post = compile_program(post_backward_program(n, C, "bfloat16", "sm_90", lanes_grad=False), "sm_90")
    assert "__restrict__ dx," not in post.get_kernel_source() and "__restrict__ df," in post.get_kernel_source()


def test_the_post_gradient_path_refuses_what_it_cannot_run():
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    with pytest.raises(ValueError, match="add_dx .* and post_grad .* got both"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", add_dx=True, post_grad=True)
    with pytest.raises(ValueError, match="post_grad needs every lane in each CTA .* lane_group = n = 4, got "
                                         "lane_group = 2"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", post_grad=True, lane_group=2)
    with pytest.raises(ValueError, match="g_once .* needs post_grad and overlap_dx; got post_grad = False"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", add_dx=True, g_once=True)
    with pytest.raises(ValueError, match="g_once .* got post_grad = True, overlap_dx = False"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", post_grad=True, overlap_dx=False, g_once=True)
    with pytest.raises(ValueError, match="held_terms is one of g, acc, .* needs g_once; got held_terms = 'acc', "
                                         "g_once = False"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", post_grad=True, g_once=False, held_terms="acc")
    with pytest.raises(ValueError, match="got held_terms = 'all', g_once = True"):  # tried, measured, dropped
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", post_grad=True, held_terms="all")
    with pytest.raises(ValueError, match="got held_terms = 'some', g_once = True"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", post_grad=True, held_terms="some")


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40), (8, 8)])
def test_g_once_reads_each_lane_of_g_once_per_warpgroup_for_sm90(n, C):
    """g_once: each consumer warpgroup binds the tile's n lanes of g to names once (g0 .. g{n-1}, the second
    warpgroup's with a suffix) and forms H_res^T g per lane, held (held_terms "g") or in the accumulators ("acc",
    the default); without it the epilogue reads them again for every lane. The same pipeline loads."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program

    groups = lane_tiling(n, post_grad=True)[2]
    plain = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True, g_once=False),
                            "sm_90")
    src = plain.get_kernel_source()
    assert not re.findall(r"float2 g[0-9]", src)
    for held_terms in ("g", "acc"):
        held_src = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True,
                                                              held_terms=held_terms), "sm_90").get_kernel_source()
        assert held_src.count("tma_load(g_desc") == src.count("tma_load(g_desc") == n
        assert len(re.findall(r"float2 g[0-9](?:_1)? = ", held_src)) == n * groups


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40), (8, 8)])
def test_held_terms_leave_the_epilogue_no_tile_to_read_after_each_wait_for_sm90(n, C):
    """held_terms "acc" (the default with g_once): every term of dx but the products written into the
    accumulators before the products, dy converted once per warpgroup. After each wait for a lane's products the
    epilogue reads no tile of x, dy or g. With held_terms "g" it still reads dy and x there."""
    held = "acc"
    from mhc_lab.kernels._target import BF16_PAIR_CONVERSION, compile_program
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    def epilogues(src):  # the code after each wait for a lane's products up to its dx store's own wait (the
        # last wait of a tile, for the dphi products, is followed by the stage's release: keep[0])
        parts = [part.split("tma_store_wait")[0] for part in re.split(r"tl::wait_wgmma<\d+>\(\);", src)[1:]]
        return [part for part in parts if "keep[0]" not in part]

    sources = {h: compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True,
                                                             held_terms=h), "sm_90").get_kernel_source()
               for h in ("g", held)}
    assert len(epilogues(sources["g"])) == len(epilogues(sources[held])) >= n
    assert all("dys" in e for e in epilogues(sources["g"]))
    for e in epilogues(sources[held]):
        assert not re.findall(BF16_PAIR_CONVERSION, e) and "dys" not in e and "res_s" not in e
    assert len(re.findall(BF16_PAIR_CONVERSION, sources[held])) < len(re.findall(BF16_PAIR_CONVERSION,
                                                                                  sources["g"]))


@needs_nvcc
@pytest.mark.parametrize("n,C,linked,splits", [(4, 4096, False, 4), (4, 4096, True, 4), (4, 136, True, 4),
                                               (2, 100, True, 1), (8, 24, False, 2), (8, 24, True, 2)])
def test_pre_backward_builds_for_sm90(n, C, linked, splits):
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import pre_backward_coefficients_program, pre_backward_lanes_program

    coefficients = compile_program(pre_backward_coefficients_program(n, C, "bfloat16", "sm_90", splits=splits),
                                   "sm_90")
    assert "float kept[" in coefficients.get_kernel_source()  # Sinkhorn's sums stay on chip
    lanes = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", add_dx=linked,
                                                       splits=2), "sm_90")
    assert "wgmma" in lanes.get_kernel_source()  # the dmix phi and dphi products run on tensor cores


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (8, 24), (2, 40), (1, 7)])
def test_spread_coefficient_kernel_builds_for_sm90(n, C):
    """phases="spread": a token over n R threads, its line sums by warp shuffles, each Sinkhorn step's sums kept
    in shared memory, one slot per thread (the steps unrolled): stored once, read twice (the reciprocal and
    the undo)."""
    from mhc_lab.kernels._coefficients import sinkhorn_steps, spread_layout
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import pre_backward_coefficients_program

    src = compile_program(pre_backward_coefficients_program(n, C, "bfloat16", "sm_90", splits=3, phases="spread"),
                          "sm_90").get_kernel_source()
    layout = spread_layout(n)
    rows_held = layout.entries
    steps = sinkhorn_steps(20)
    row_steps, column_steps = steps // 2, (steps + 1) // 2
    # the kept sums: a row step's stored, then read for the reciprocal and the undo; a column step's stored
    # once and read so by each row the thread holds
    assert src.count("((float*)kept)[") == row_steps * rows_held * 3 + column_steps * (1 + 2 * rows_held)
    # butterflies of log2 n shuffles per row held: the row steps, forward and backward, and the softmax (its
    # max and sum, twice, and its backward's dot); of log2 R per column step, forward and backward; three sums
    # over the token's threads at the end
    row_bits, slot_bits = len(layout.row_bits), len(layout.slot_bits)
    want = ((2 * row_steps + 5) * rows_held * row_bits + 2 * column_steps * slot_bits
            + 3 * (row_bits + slot_bits))
    assert src.count("__shfl_xor_sync") == want


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_spread_layout_covers_the_matrix_and_gates_once(n):
    """The spread kernels' index functions (the same ones their programs call): the threads of a token cover
    every entry of the n x n matrix and every pre/post entry exactly once, within one warp; a row's butterfly
    partners hold the same rows of other columns, a column's the same column of other rows."""
    from mhc_lab.kernels._coefficients import spread_layout

    layout = spread_layout(n)
    assert layout.threads <= 32 and 32 % layout.threads == 0  # a token's group never straddles a warp
    held = [(layout.row(g, e), layout.column(g)) for g in range(layout.threads) for e in range(layout.entries)]
    assert sorted(held) == [(i, j) for i in range(n) for j in range(n)]
    gates = [layout.gate(g, m) for g in range(layout.threads) for m in range(layout.gates)]
    assert sorted(q for q in gates if q < 2 * n) == list(range(2 * n))
    assert sum(layout.row_bits) == n - 1 and sum(layout.slot_bits) == n * (layout.slots - 1)
    for g in range(layout.threads):
        # a row's butterfly reaches g ^ mask for every mask over the row bits: the same rows, all n columns
        row_group = [g ^ mask for mask in range(n)]
        assert all([layout.row(h, e) for e in range(layout.entries)] == [layout.row(g, e) for e in
                                                                        range(layout.entries)] for h in row_group)
        assert sorted(layout.column(h) for h in row_group) == list(range(n))
        # a column's reaches g ^ (mask n) over the slot bits: the same column, all n rows between them
        column_group = [g ^ (mask * n) for mask in range(layout.slots)]
        assert {layout.column(h) for h in column_group} == {layout.column(g)}
        assert sorted(layout.row(h, e) for h in column_group for e in range(layout.entries)) == list(range(n))


def test_spread_coefficient_kernel_refusals():
    from mhc_lab.kernels.pre_backward import pre_backward_coefficients_program
    from mhc_lab.ops import training

    with pytest.raises(ValueError, match="CUDA only"):
        pre_backward_coefficients_program(4, 64, "float32", "c", phases="spread")
    with pytest.raises(ValueError, match="power of two.*n = 3"):
        pre_backward_coefficients_program(3, 64, "bfloat16", "sm_90", phases="spread")
    with pytest.raises(ValueError, match="expected 'fused', 'split' or 'spread', got 'spred'"):
        pre_backward_coefficients_program(4, 64, "bfloat16", "sm_90", phases="spred")
    with pytest.raises(ValueError, match="coefficient_phases: expected one of"):
        training.coefficient_phases("spred")
    assert training.COEFFICIENT_PHASES == "spread"
    assert [training._coefficient_phases_for(n) for n in (1, 2, 3, 4, 6, 8)] == ["spread", "spread", "fused",
                                                                                "spread", "fused", "spread"]
    with training.coefficient_phases("split"):
        assert [training._coefficient_phases_for(n) for n in (3, 4)] == ["split", "split"]
    assert training.COEFFICIENT_PHASES == "spread"


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (4, 136), (8, 24), (1, 7)])
def test_split_coefficient_kernels_build_for_sm90(n, C):
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import dpre_program, pre_backward_coefficients_program

    reduce = compile_program(dpre_program(n, C, "bfloat16", "sm_90"), "sm_90").get_kernel_source()
    assert "warp_reduce_sum" in reduce  # one warp per token, shuffle-reduced
    if C % 8 == 0:
        assert "uint4" in reduce  # 16-byte loads of x and dy
    tokens = compile_program(pre_backward_coefficients_program(n, C, "bfloat16", "sm_90", splits=4, phases="split"),
                             "sm_90").get_kernel_source()
    assert "float kept[" in tokens  # Sinkhorn's sums stay on chip


@needs_nvcc
def test_lane_kernel_stages_the_posts_dx_for_sm90():
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program

    plain, linked = (compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=a, splits=2),
                                     "sm_90").get_kernel_source() for a in (False, True))
    # each lane's dx_post tile arrives by a bulk copy into shared memory, with the other operands (and each
    # lane's x tile: the two kernels may take different numbers of lanes per CTA)
    lanes_plain, lanes_linked = lane_tiling(4)[0], lane_tiling(4, True)[0]
    assert linked.count("tma_load") == plain.count("tma_load") + (lanes_linked - lanes_plain) + lanes_linked


@needs_nvcc
@pytest.mark.parametrize("add_dx", [False, True])
def test_lane_kernel_gives_two_consumer_warpgroups_their_own_tokens_for_sm90(add_dx):
    """128-token tiles and 256 threads: each consumer warpgroup multiplies its own 64 tokens by all the block's
    columns (m64n32k16 for the dx GEMMs with dx_post's 32 columns, m64n64k16 without), not half the columns."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program

    source = compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=add_dx,
                                                        block_tokens=128, threads=256), "sm_90").get_kernel_source()
    columns = lane_tiling(4, add_dx)[1]
    assert "__launch_bounds__(384" in source  # a producer warpgroup and two consumers
    assert f"kFloat32, 64, {columns}, 16, false" in source  # the dx GEMMs: whole rows of the block per warpgroup


@needs_nvcc
def test_lane_kernel_trims_the_lo_product_to_its_rows_for_sm90():
    """trim_lo: the lo.hi product's K is the KH rows that are not zero, half the instructions (C = 4096, n = 4:
    K = 2 x 32 issued as 4 m64n32k16, trimmed as 2, for each lane of the CTA), and only those columns of
    dsplit's lo row are loaded."""
    import re

    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program

    def products(source):  # the trip counts of the loops that issue the tensor-core instructions
        return sorted(int(k) for k in re.findall(r"for \(int ki\w* = 0; ki\w* < (\d+);", source))

    whole, trimmed = (compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True,
                                                                 trim_lo=t), "sm_90").get_kernel_source()
                      for t in (False, True))
    lanes = lane_tiling(4, True)[0]
    assert products(whole) == [4] * 3 * lanes and products(trimmed) == [2] * lanes + [4] * 2 * lanes  # hi, lo, dphi


@needs_nvcc
@pytest.mark.parametrize("n,dx_products,add_dx", [(1, 3, True), (2, 3, True), (4, 3, True), (4, 1, True),
                                                  (8, 3, True), (4, 3, False), (8, 3, False)])
def test_lane_kernel_overlapped_waits_for_each_lane_and_releases_its_operands_last_for_sm90(n, dx_products, add_dx):
    """overlap_dx (the default, with or without dx_post): per token tile, each lane's dx GEMMs are issued before
    the previous lane's epilogue (which first waits for all but the newest lane's groups, then fences the
    accumulator it reads), and the stage's GEMM operands (dmix's three splits, the lanes' x tiles) are handed
    back to the producer only after the tile's last wait. With two consumer warpgroups (the default where each
    gets two lanes or more) each warpgroup's lanes in turn, in its own branch."""
    import re

    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program

    source = compile_program(pre_backward_lanes_program(n, 4096, "bfloat16", "sm_90", add_dx=add_dx,
                                                        dx_products=dx_products),
                             "sm_90").get_kernel_source()
    lanes, _, groups = lane_tiling(n, add_dx)
    assert groups == (2 if n == 4 else 1)  # two warpgroups of two lanes each where n = 4
    own = lanes // groups  # each warpgroup's lanes
    consumer = source[source.index("warpgroup_reg_alloc"):]
    waits = re.findall(r"wait_wgmma<(\d+)>", consumer)
    assert waits == ([str(2 if dx_products == 3 else 1)] * (own - 1) + ["0", "0"]) * groups
    # the GEMMs issued before the first wait: the first two lanes' dx products (one lane's with one lane)
    first_wait = consumer.index("wait_wgmma<")
    per_lane = 2 if dx_products == 3 else 1  # commit groups of one lane's dx GEMMs
    assert consumer[:first_wait].count("warpgroup_commit_batch") == min(own, 2) * per_lane
    tail = consumer[consumer.rindex("wait_wgmma<0>"):]
    released = re.findall(r"mbarrier\[\(\(tb_1 [%&] \d+\) \+ \d+\)\]\.arrive\(\)", tail)  # % or & by the stages
    operands = 2 + (dx_products == 3) + lanes  # a_dx, a_hl (a_l0), the lanes' x tiles
    # one warpgroup: each operand's release; two: the stage's one release, after both warpgroups' branches
    assert len(released) == (operands if groups == 1 else 1), released


@pytest.mark.parametrize("n,add_dx,post_grad", [(4, True, False), (4, False, False), (8, True, False),
                                               (2, False, False), (4, False, True)])
def test_lane_kernel_gives_two_consumer_warpgroups_their_own_lanes_for_sm90(n, add_dx, post_grad):
    """consumer_groups=2 (the CUDA that TileLang generates, no GPU or nvcc needed): a producer and two consumer
    warpgroups, 384 threads. In the token loop the consumers branch on the thread index, and each branch issues
    the tensor-core products of its own half of the CTA's lanes only, into its own accumulators: per lane the dx
    products hi and lo, the first starting from zero (scale-d 0, no clearing of registers in the branch, which
    made ptxas serialise every wgmma), and the dphi product; each waits for its own lanes' dx stores. With the
    post's g (held_terms "acc", the default there) every product adds onto what its accumulator holds (scale-d
    1): the other terms of dx are written into it first."""
    import re

    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program
    from mhc_lab.kernels.source import generated_source, kernel_text

    program = pre_backward_lanes_program(n, 4096, "bfloat16", "sm_90", add_dx=add_dx, post_grad=post_grad, splits=2,
                                         consumer_groups=2)
    src = kernel_text(generated_source(program, "sm_90"))
    half = lane_tiling(n, add_dx, post_grad)[0] // 2
    assert "__launch_bounds__(384" in src
    lines = src[src.index("for (int tb_1 "):].splitlines()
    start = next(k for k, line in enumerate(lines) if line.strip() == "if (((int)threadIdx.x) < 256) {")
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    middle = next(k for k in range(start + 1, len(lines)) if lines[k] == indent + "} else {")
    end = next(k for k in range(middle + 1, len(lines)) if lines[k] == indent + "}")
    accumulators = []
    for branch in ("\n".join(lines[start:middle]), "\n".join(lines[middle:end])):
        assert branch.count("wgmma_ss<") == 3 * half
        first_from_zero = len(re.findall(r"\(\(0 < ki_?\d*\) \? 1 : 0\)", branch))  # each lane's first dx product
        assert first_from_zero == (0 if post_grad else half)
        if post_grad:
            assert len(re.findall(r"wgmma_ss<[^;]*\)\), 1\);", branch)) == 3 * half
        assert branch.count(f"tma_store_wait<{half - 1}, true>") == half
        accumulators.append(set(re.findall(r"\(\(uint32_t\*\)\((\w+) \+ ", branch)))
    assert len(accumulators[0]) == len(accumulators[1]) == 2 * half and not accumulators[0] & accumulators[1]


@needs_nvcc
@pytest.mark.parametrize("n,add_dx", [(4, True), (4, False), (2, True), (8, True)])
def test_lane_kernel_stores_dx_by_tma_and_reads_swizzled_tiles_for_sm90(n, add_dx):
    """stage_dx (the default where C is a multiple of 8): each lane's dx tile leaves registers by stmatrix into
    its own shared buffer and goes out by one TMA store per token tile; before a buffer is written again the
    store that read it last time is waited for (LG - 1 stores may stay in flight), and all of them once after
    the token loop; nothing stores dx from registers. swizzle_epilogue: dy's and dx_post's TMA loads use the
    same swizzle as the x tiles the GEMMs read (none without the option). C = 100 cannot take TMA stores. With
    two consumer warpgroups, each waits for its own lanes' stores."""
    import re

    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward import lane_tiling, pre_backward_lanes_program
    from mhc_lab.kernels.source import tma_swizzles

    def build(C=4096, **options):
        return compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", add_dx=add_dx, **options),
                               "sm_90")

    kernel = build()
    source, (lanes, _, groups) = kernel.get_kernel_source(), lane_tiling(n, add_dx)
    assert source.count("tma_store(dx_desc") == lanes and source.count("ptx_stmatrix") == lanes
    # each consumer warpgroup's stores: the warpgroup's lanes minus one in flight, then all of them waited for
    assert re.findall(r"tma_store_wait<(\d+), true>", source) == [str(lanes // groups - 1)] * lanes + ["0"] * groups
    assert source.rindex("tma_store_wait<0") > source.rindex("tma_store(dx_desc")
    assert not re.search(r"\(dx \+ ", source)  # no store of dx from registers
    swizzles = tma_swizzles(kernel.get_host_source())
    epilogue_tiles = ["dy", "dx_post"] if add_dx else ["dy"]
    assert swizzles["x"] != 0 and all(swizzles[t] == swizzles["x"] for t in epilogue_tiles), swizzles
    plain = tma_swizzles(build(swizzle_epilogue=False).get_host_source())
    assert all(plain[t] == 0 for t in epilogue_tiles), plain
    for source in (build(stage_dx=False).get_kernel_source(), build(C=100).get_kernel_source()):
        assert "tma_store" not in source and re.search(r"\(dx \+ ", source)


@needs_nvcc
def test_lane_kernel_two_ctas_per_sm_keep_their_registers_and_fit_for_sm90():
    """ctas_per_sm = 2: the launch bounds ask for two CTAs per SM, the warpgroups keep the registers they launch
    with (no setmaxnreg), and the default lanes and stages fit half an SM's shared memory (two lanes, two stages
    with dx_post at n = 4)."""
    from mhc_lab.kernels._target import compile_program, shared_per_cta
    from mhc_lab.kernels.pre_backward import lane_stages, lane_tiling, lanes_shared_bytes, pre_backward_lanes_program

    source = compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True, ctas_per_sm=2),
                             "sm_90").get_kernel_source()
    assert "__launch_bounds__(256, 2)" in source and "reg_alloc" not in source
    lanes, columns, groups = lane_tiling(4, True, False, 2)
    stages = lane_stages(4, lanes, 64, columns, True, False, 2)
    assert (lanes, columns, groups, stages) == (2, 32, 1, 2)
    assert lanes_shared_bytes(4, lanes, 64, columns, stages, True) <= shared_per_cta(2) < shared_per_cta(1) // 2


@pytest.mark.parametrize("n,splits", [(1, 1), (2, 3), (4, 1), (4, 2), (8, 5)])
def test_dphi_from_partial_sums_splits_and_halves_and_skips_the_padding(n, splits):
    """dphi = the sum over token splits of the dmix_hi rows plus the dmix_lo rows of kernel 2's partial; the
    padding rows past n^2+2n in each half are never read (NaN there must not reach dphi)."""
    from mhc_lab.kernels.pre_backward import dphi_from_partial, gemm_depth

    m, kh = n * n + 2 * n, gemm_depth(n)
    partial = torch.randn(splits, 2 * kh, n * 24, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    partial[:, m:kh], partial[:, kh + m :] = float("nan"), float("nan")
    want = sum(partial[s, h * kh : h * kh + m] for s in range(splits) for h in (0, 1))
    got = dphi_from_partial(partial, n)
    assert got.shape == (m, n * 24)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("add_dx", [False, True])
@pytest.mark.parametrize("block_tokens,ctas", [(64, 1), (128, 1), (64, 2)])
def test_lane_kernel_default_tiles_fit_in_shared_memory(n, add_dx, block_tokens, ctas):
    """The default lanes, columns and stages for any token tile and CTAs per SM fit each CTA's share of shared
    memory (n = 8 with dx_post and 128-token tiles first asked for 235520 bytes)."""
    from mhc_lab.kernels.pre_backward import lane_stages, lane_tiling, lanes_shared_bytes, shared_per_cta

    lanes, columns, groups = lane_tiling(n, add_dx, ctas_per_sm=ctas, block_tokens=block_tokens)
    assert n % lanes == 0 and lanes % groups == 0
    stages = lane_stages(n, lanes, block_tokens, columns, add_dx, ctas_per_sm=ctas)
    assert lanes_shared_bytes(n, lanes, block_tokens, columns, stages, add_dx) <= shared_per_cta(ctas)


def test_lane_kernel_refuses_tiles_beyond_shared_memory():
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    with pytest.raises(ValueError, match=r"4 lanes x 64 columns x 64 tokens in 2 stages with dx_post need 266240 "
                                         r"bytes of shared memory, more than the 232448"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True, lane_group=4, block_c=64, stages=2)
    with pytest.raises(ValueError, match=r"leave_out takes a prefix of .*, got \('dx_gemm',\)"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", leave_out=("dx_gemm",))
    with pytest.raises(ValueError, match=r"8 lanes x 32 columns x 64 tokens in 1 stages with dx_post need 277504 "
                                         r"bytes of shared memory, more than the 232448 each of 1 CTA\(s\) per SM"):
        pre_backward_lanes_program(8, 4096, "bfloat16", "sm_90", add_dx=True, lane_group=8)
    with pytest.raises(ValueError, match=r"more than the 115712 each of 2 CTA\(s\) per SM may use"):
        pre_backward_lanes_program(8, 4096, "bfloat16", "sm_90", add_dx=True, ctas_per_sm=2, lane_group=2)
    with pytest.raises(ValueError, match=r"stage_dx stores dx by TMA, .* a multiple of 8, got C = 100"):
        pre_backward_lanes_program(2, 100, "bfloat16", "sm_90", stage_dx=True)
    with pytest.raises(ValueError, match=r"ctas_per_sm is 1 or 2, got 3"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", ctas_per_sm=3)
    with pytest.raises(ValueError, match=r"consumer_groups is 1 or 2, got 4"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", consumer_groups=4)
    with pytest.raises(ValueError, match=r"consumer_groups = 2 .* got overlap_dx = False, threads = 128, "
                                         r"ctas_per_sm = 1, lane_group = 4"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", consumer_groups=2, overlap_dx=False)
    with pytest.raises(ValueError, match=r"consumer_groups = 2 .* lane_group = 1"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", consumer_groups=2, lane_group=1)
    with pytest.raises(ValueError, match=r"leave_out times parts of the plain lane loop; overlap_dx .* got "
                                         r"leave_out = \('dphi',\)"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", overlap_dx=True, leave_out=("dphi",))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("add_dx", [False, True])
def test_lane_kernel_takes_the_deepest_pipeline_that_fits(n, add_dx):
    from mhc_lab.kernels._target import SMEM_LIMIT
    from mhc_lab.kernels.pre_backward import lane_stages, lane_tiling, lanes_shared_bytes

    lanes, columns, _ = lane_tiling(n, add_dx)
    stages = lane_stages(n, lanes, 64, columns, add_dx)
    assert 1 <= stages <= (3 if add_dx else 2)
    assert lanes_shared_bytes(n, lanes, 64, columns, stages, add_dx) <= SMEM_LIMIT
    if stages < (3 if add_dx else 2):
        assert lanes_shared_bytes(n, lanes, 64, columns, stages + 1, add_dx) > SMEM_LIMIT


@pytest.mark.parametrize("n,C,sms", [(4, 2560, 132), (4, 4096, 132), (4, 7168, 132), (8, 4096, 132), (2, 40, 132),
                                     (4, 4096, 78), (1, 100000, 16)])
@pytest.mark.parametrize("add_dx", [False, True])
@pytest.mark.parametrize("ctas", [1, 2])
def test_lane_splits_fill_the_waves_of_ctas(n, C, sms, add_dx, ctas):
    # kernel 2 runs `ctas` CTAs per SM: (column blocks x splits) CTAs in waves of ctas x `sms`; the policy
    # takes the fewest splits whose waves are at least 90% full, or else the fullest waves there are
    from mhc_lab.kernels.pre_backward import lane_splits_for, lane_tiling

    lanes, columns, _ = lane_tiling(n, add_dx, False, ctas)
    blocks = -(-C // columns) * (n // lanes)
    wave = sms * ctas

    def fullness(s):
        return blocks * s / (wave * -(-(blocks * s) // wave))

    chosen = lane_splits_for(n, C, sms, add_dx=add_dx, ctas_per_sm=ctas)
    assert 1 <= chosen <= 32
    best = max(fullness(s) for s in range(1, 33))
    if best >= 0.9:
        assert fullness(chosen) >= 0.9 and all(fullness(s) < 0.9 for s in range(1, chosen))
    else:
        assert fullness(chosen) == best


def test_backward_factories_refuse_bad_configurations():
    from mhc_lab.kernels.post_backward import post_backward_program
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    with pytest.raises(ValueError, match="expected 1 <= n <= 16 lanes, got n = 17"):
        post_backward_program(17, 8, "float32", "c")
    with pytest.raises(ValueError, match="expected dtype in \\('float32',\\)"):
        post_backward_program(4, 8, "bfloat16", "c")
    with pytest.raises(ValueError, match="expected 1 <= n <= 8 lanes, got n = 9"):
        pre_backward_lanes_program(9, 8, "bfloat16", "sm_90")
    with pytest.raises(ValueError, match="expected dtype in \\('bfloat16',\\)"):
        pre_backward_lanes_program(4, 8, "float16", "sm_90")


# ------------------------------------------------------------------------------------------ training ops


def _site(backend, x, phi, bias, alpha, weight, linked=False):
    """One site with layer tanh(y W): as mhc_pre then mhc_post, or (linked) as mhc_site."""
    from mhc_lab.ops.training import mhc_post as op_post, mhc_pre as op_pre, mhc_site

    def layer(y):
        return torch.tanh(y @ weight.to(y.dtype))

    if linked:
        return mhc_site(x, phi, bias, alpha, layer, backend=backend)
    y, post, res = op_pre(x, phi, bias, alpha, backend=backend)
    return op_post(x, layer(y), post, res, backend=backend)


def _site_truth(x, phi, bias, alpha, weight, g):
    leaves = [t.double().detach().requires_grad_() for t in (x, phi, bias, alpha)]
    co = mhc_coefficients(*leaves)
    y = mhc_pre(leaves[0], co.pre)
    out = mhc_post(leaves[0], torch.tanh(y @ weight.double()), co.post, co.res)
    return torch.autograd.grad(out, leaves, g.double())


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ops_gradcheck_reference_backend(n, linked):
    x, phi, bias, alpha, _ = _site_inputs((2, 3), n, 5, seed=n)
    weight = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) / 3
    leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha)]
    assert torch.autograd.gradcheck(lambda *a: _site("reference", *a, weight, linked), leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("kernels", torch.float32, 2e-5),
                                               ("kernels", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("n,C", [(4, 24), (2, 7), (8, 3)])
def test_ops_gradients_match_float64(backend, dtype, tol, n, C, linked):
    x, phi, bias, alpha, _ = _site_inputs((2, 5), n, C, seed=C)
    weight = torch.randn(C, C, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) / math.sqrt(C)
    g = _upstream((2, 5), n, C, seed=C)[3]
    x = x.to(dtype)  # the truth starts from the same (rounded) lanes
    want = _site_truth(x, phi, bias, alpha, weight, g)
    coef_dtype = torch.float64 if backend == "reference" else torch.float32
    leaves = [x.clone().requires_grad_()] + [t.to(coef_dtype).requires_grad_() for t in (phi, bias, alpha)]
    out = _site(backend, *leaves, weight, linked)
    got = torch.autograd.grad(out, leaves, g.to(out.dtype))
    for name, a, b in zip(("x", "phi", "bias", "alpha"), got, want):
        assert a.dtype == leaves[("x", "phi", "bias", "alpha").index(name)].dtype, name
        assert _relmax(a, b) < tol, name


@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("kernels", torch.float32, 2e-5),
                                               ("kernels", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n,C", [(4, 24), (2, 7), (1, 5), (8, 3)])
def test_linked_site_with_the_post_gradient_to_pre_matches_float64(monkeypatch, backend, dtype, tol, n, C):
    """post_gradient_to_pre: the post's backward writes no dx and hands g back through link; the pre's backward
    adds H_res^T g. Same gradients as the float64 truth; the ops see the flags decided at the forward."""
    from mhc_lab.ops import training

    calls = {"post": [], "pre": []}
    real_post, real_pre = training.post_backward, training.pre_backward

    def spy_post(*args):
        calls["post"].append(args[6] if len(args) > 6 else True)
        return real_post(*args)

    def spy_pre(*args):
        calls["pre"].append(args[12] if len(args) > 12 else False)
        return real_pre(*args)

    monkeypatch.setattr(training, "post_backward", spy_post)
    monkeypatch.setattr(training, "pre_backward", spy_pre)
    x, phi, bias, alpha, _ = _site_inputs((2, 5), n, C, seed=C + n)
    weight = torch.randn(C, C, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) / math.sqrt(C)
    g = _upstream((2, 5), n, C, seed=C)[3]
    x = x.to(dtype)
    want = _site_truth(x, phi, bias, alpha, weight, g)
    coef_dtype = torch.float64 if backend == "reference" else torch.float32
    leaves = [x.clone().requires_grad_()] + [t.to(coef_dtype).requires_grad_() for t in (phi, bias, alpha)]
    before = training.POST_GRADIENT_TO_PRE
    with training.post_gradient_to_pre(True):
        out = _site(backend, *leaves, weight, linked=True)
    assert training.POST_GRADIENT_TO_PRE is before  # the flag is back; the backward keeps what the forward decided
    got = torch.autograd.grad(out, leaves, g.to(out.dtype))
    assert calls == {"post": [False], "pre": [True]}  # no dx from the post; the pre adds H_res^T g
    for name, a, b in zip(("x", "phi", "bias", "alpha"), got, want):
        assert _relmax(a, b) < tol, name


@pytest.mark.parametrize("n,expected", [(1, False), (2, False), (4, True), (8, False)])
def test_post_gradient_goes_to_the_pre_by_default_where_kernel_2_has_two_warpgroups(n, expected):
    """The default (POST_GRADIENT_TO_PRE None): the 42C path on CUDA where kernel 2 splits all n lanes between two
    consumer warpgroups (n = 4), the 46C path elsewhere and on the CPU; the switch overrides it both ways."""
    from types import SimpleNamespace

    from mhc_lab.ops import training

    cuda_lanes = SimpleNamespace(shape=(16, n, 64), device=torch.device("cuda"))  # no GPU needed to decide
    assert training.POST_GRADIENT_TO_PRE is None
    assert training.post_gradient_to_pre_for(cuda_lanes, "kernels") is expected
    assert training.post_gradient_to_pre_for(cuda_lanes, "reference") is False
    assert training.post_gradient_to_pre_for(torch.empty(16, n, 64), "kernels") is False
    for forced in (True, False):
        with training.post_gradient_to_pre(forced):
            assert training.post_gradient_to_pre_for(cuda_lanes, "kernels") is forced
            assert training.post_gradient_to_pre_for(torch.empty(16, n, 64), "kernels") is forced
    assert training.POST_GRADIENT_TO_PRE is None


def test_ops_gradcheck_with_the_post_gradient_to_pre():
    from mhc_lab.ops import training

    x, phi, bias, alpha, _ = _site_inputs((2, 3), 4, 5, seed=7)
    weight = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) / 3
    leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha)]
    with training.post_gradient_to_pre(True):
        assert torch.autograd.gradcheck(lambda *a: _site("reference", *a, weight, True), leaves, eps=1e-6,
                                        atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "kernels"])
@pytest.mark.parametrize("linked", [False, True])
def test_pre_backward_takes_the_links_gradient_only_from_a_linked_site(monkeypatch, backend, linked):
    # the separate site (mhc_pre then mhc_post) leaves pre_forward's link unused: its backward must get None
    # and run the unlinked kernels, not a zero gradient of the lanes' size to add (same gradients, 8C more bytes)
    from mhc_lab.ops import training

    seen = []
    real = training.pre_backward

    def spy(*args):
        seen.append(args[10] is not None)
        return real(*args)

    monkeypatch.setattr(training, "pre_backward", spy)
    x, phi, bias, alpha, _ = _site_inputs((3,), 4, 8, seed=2, dtype=torch.float32)
    leaves = [t.float().requires_grad_() for t in (x, phi, bias, alpha)]
    out = _site(backend, *leaves, torch.eye(8, dtype=torch.float64), linked)
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert seen == [linked]


def _chain_of_sites(backend, dtype, n, C, device="cpu"):
    """Three layers and their MHCConnections (phi drawn away from its identity init), lanes [2, 3, n, C] and an
    upstream gradient, the same in every process."""
    from mhc_lab.ops import training

    torch.manual_seed(1)  # the layers' and connections' initial weights
    layers = [_Layer(C).to(device, dtype) for _ in range(3)]
    connections = [training.MHCConnection(n, C, backend=backend).to(
        device, dtype if backend == "reference" else torch.float32) for _ in layers]
    with torch.no_grad():
        for c in connections:
            c.phi.normal_(0, 0.3)
    x = torch.randn(2, 3, n, C, dtype=dtype, generator=torch.Generator().manual_seed(2)).to(device)
    upstream = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)
    return layers, connections, x, upstream


def _chained_against_unchained(monkeypatch, backend, dtype, n, C, device="cpu"):
    """run_sites against sites that each project for themselves: the largest relative difference over the
    output and every gradient; asserts that every pre but the first took its partial_in."""
    from mhc_lab.ops import training

    layers, connections, x, upstream = _chain_of_sites(backend, dtype, n, C, device)
    params = [p for c in connections for p in c.parameters()]

    def grads(run):
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        return (out.detach(), *torch.autograd.grad(out, [leaf, *params], upstream))

    def unchained(h):
        for c, layer in zip(connections, layers):
            h = c(h, layer)
        return h

    seen = []
    real = training.pre_forward

    def spy(*args):
        seen.append(len(args) > 5 and args[5] is not None)
        return real(*args)

    want = grads(unchained)
    monkeypatch.setattr(training, "pre_forward", spy)
    got = grads(lambda h: training.run_sites(h, connections, layers))
    assert seen == [False, True, True]
    return max(_relmax(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("kernels", torch.float32, 1e-5),
                                               ("kernels", torch.bfloat16, 1e-6)])
@pytest.mark.parametrize("n,C", [(4, 8), (2, 5), (1, 3)])
def test_chained_sites_match_unchained_sites(monkeypatch, backend, dtype, tol, n, C):
    """run_sites: each post projects its lanes for the next pre (kernels/post_project.py); same values and
    gradients as sites that each project for themselves; every pre but the first takes its partial_in."""
    assert _chained_against_unchained(monkeypatch, backend, dtype, n, C) < tol


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA kernels run only there")
@pytest.mark.parametrize("n,C", [(4, 4096), (4, 136), (2, 40), (8, 16), (1, 1000)])
def test_cuda_chained_sites_match_unchained_sites(monkeypatch, n, C):
    """The same on CUDA with bf16 lanes, chaining switched on: the fused post + projection and the pre's own
    projection sum in other orders, so the coefficients differ by float32 rounding and the lanes by at most
    about one bf16 rounding."""
    from mhc_lab.ops import training

    with training.chaining_on_cuda(True):
        assert _chained_against_unchained(monkeypatch, "kernels", torch.bfloat16, n, C, device="cuda") < 2e-2


def _chain_against_joined(monkeypatch, backend, dtype, n, C, device="cpu") -> dict:
    """run_sites as it is ("apart") against run_sites with each post and the next pre as one op
    (join_sites_backward, "joined"), and both against the same chain in float64 on the reference backend: the
    relative difference of the output and of every gradient (the largest entry's, to the largest of the
    second), as lists {"between": joined against apart, "apart": apart against float64, "joined": joined
    against float64}. Asserts that both boundaries of the
    three sites ran joined_backward, with the joined kernel where it applies (the C target on the CPU; CUDA at
    n = 4 and C a multiple of 8)."""
    import copy

    from mhc_lab.ops import training

    layers, connections, x, upstream = _chain_of_sites(backend, dtype, n, C, device)

    def grads(connections, layers, x, upstream):
        params = [p for c in connections for p in c.parameters()] + [p for lay in layers for p in lay.parameters()]
        leaf = x.clone().requires_grad_()
        out = training.run_sites(leaf, connections, layers)
        return (out.detach(), *torch.autograd.grad(out, [leaf, *params], upstream))

    exact_connections = copy.deepcopy(connections)
    for c in exact_connections:
        c.backend = "reference"
    exact = grads([c.double() for c in exact_connections], [copy.deepcopy(lay).double() for lay in layers],
                  x.double(), upstream.double())
    calls = []
    real = training.joined_backward

    def spy(*args):
        calls.append(training.joined_kernel_applies(args[-1], args[0]))
        return real(*args)

    apart = grads(connections, layers, x, upstream)
    monkeypatch.setattr(training, "joined_backward", spy)
    with training.join_sites_backward(True):
        joined = grads(connections, layers, x, upstream)
    assert training.JOIN_SITES_BACKWARD is False
    kernel = backend == "kernels" and (device == "cpu" or (n == 4 and C % 8 == 0))
    assert calls == [kernel] * 2

    def rel(got, want):
        return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(got, want)]

    return {"between": rel(joined, apart), "apart": rel(apart, exact), "joined": rel(joined, exact)}


@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("kernels", torch.float32, 2e-5)])
@pytest.mark.parametrize("n,C", [(4, 8), (2, 5), (1, 3), (8, 4)])
def test_joined_sites_match_the_chain_of_sites(monkeypatch, backend, dtype, tol, n, C):
    """join_sites_backward: the same output and gradients (lanes, every connection's and layer's parameters) as
    run_sites without it, and both as near the float64 chain as the working precision allows."""
    errors = _chain_against_joined(monkeypatch, backend, dtype, n, C)
    assert max(errors["between"]) < tol
    assert max(errors["joined"] + errors["apart"]) < 50 * tol


def _joined_no_less_exact(errors) -> None:
    """With bf16 lanes the joined kernel keeps the lanes' gradient between two sites in float32 where the two
    kernels apart round it to bf16 on its way through memory: so the joined chain is compared with the float64
    chain. The output and the lanes' gradient must be within bf16's reach of it, and the output and every
    gradient no further from it than the chain apart's (to 10% and one bf16 step, 2^-7, of its largest entry).
    (The small gradients, alpha's three above all, are sums that cancel: both chains miss them by more.)"""
    assert max(errors["joined"][:2]) < 5e-2, errors
    assert all(j <= 1.1 * a + 2**-7 for j, a in zip(errors["joined"], errors["apart"])), errors


@pytest.mark.parametrize("n,C", [(4, 8), (2, 5), (1, 3), (8, 4), (4, 24)])
def test_joined_sites_in_bf16_stay_near_float64(monkeypatch, n, C):
    _joined_no_less_exact(_chain_against_joined(monkeypatch, "kernels", torch.bfloat16, n, C))


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA joined kernel runs only there")
@pytest.mark.parametrize("n,C", [(4, 4096), (4, 136), (2, 40)])
def test_cuda_joined_sites_match_the_chain_of_sites(monkeypatch, n, C):
    """The same on CUDA with bf16 lanes (the joined kernel at n = 4, the two kernels apart elsewhere)."""
    _joined_no_less_exact(_chain_against_joined(monkeypatch, "kernels", torch.bfloat16, n, C, device="cuda"))


def test_chained_partials_have_their_own_split_count():
    """On CUDA a chained post projects into CHAIN_SPLITS partial sums and the pre's own projection pass into
    SPLIT_DEFAULTS['splits']; the pre takes partial_in with the chained count. Elsewhere both are 1."""
    from types import SimpleNamespace

    from mhc_lab.kernels.pre_cuda import SPLIT_DEFAULTS
    from mhc_lab.ops import training

    cuda_lanes = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 64))
    assert training.partial_splits("kernels", cuda_lanes, chained=True) == training.CHAIN_SPLITS
    assert training.partial_splits("kernels", cuda_lanes) == SPLIT_DEFAULTS["splits"]
    cpu = torch.zeros(3, 4, 8)
    assert training.partial_splits("kernels", cpu, chained=True) == training.partial_splits("kernels", cpu) == 1
    with pytest.raises(InputError, match=r"partial_in: expected shape \(1, 3, 25\)"):
        training.pre_forward(cpu, torch.zeros(24, 32), torch.zeros(24), torch.ones(3), "kernels",
                             torch.zeros(4, 3, 25))


def test_chained_sites_on_cuda_follow_the_switch():
    """On CUDA a post projects for the next pre only when CHAIN_ON_CUDA is on (or within chaining_on_cuda) and
    C is a multiple of 8; elsewhere always."""
    from types import SimpleNamespace

    from mhc_lab.ops import training

    cuda_lanes = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 64))
    odd_width = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 60))
    assert training.fused_projection_applies("kernels", cuda_lanes) is training.CHAIN_ON_CUDA
    assert not training.fused_projection_applies("kernels", odd_width)
    assert training.fused_projection_applies("reference", odd_width)
    assert training.fused_projection_applies("kernels", torch.zeros(3, 4, 60))
    for enabled in (True, False):
        with training.chaining_on_cuda(enabled):
            assert training.fused_projection_applies("kernels", cuda_lanes) is enabled
        assert training.fused_projection_applies("kernels", cuda_lanes) is training.CHAIN_ON_CUDA


def test_pre_forward_refuses_a_partial_of_the_wrong_shape():
    from mhc_lab.ops.training import pre_forward

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((5,), 4, 8))
    with pytest.raises(InputError, match=r"partial_in: expected shape \(1, 5, 25\)"):
        pre_forward(x, phi, bias, alpha, "kernels", torch.zeros(1, 4, 25))


class _Layer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def _stream(recompute_block, backend="reference", layers=6, n=4, width=16):
    from mhc_lab.ops.training import MHCResidualStream

    torch.manual_seed(0)
    stream = MHCResidualStream([_Layer(width) for _ in range(layers)], n, width, backend=backend,
                               recompute_block=recompute_block)
    with torch.no_grad():
        for site in stream.connections:
            site.phi.normal_(0, 0.1)
    return stream


def test_recompute_gives_the_same_gradients_and_keeps_fewer_bytes():
    from mhc_lab.course.training_lab import activation_memory

    h = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for block in (None, 2, "auto"):
        stream = _stream(block)
        memory = activation_memory(stream, lambda stream=stream: stream(h).square().sum(), [h])
        out = stream(h)
        results[block] = (out.detach(), [p.grad.clone() for p in stream.parameters()], memory["kept"])
    assert _stream("auto").recompute_block == 2  # Eq. 20's integer optimum at n = 4, L = 6
    for block in (2, "auto"):
        assert torch.equal(results[block][0], results[None][0])
        for a, b in zip(results[block][1], results[None][1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # kept between forward and backward: without recompute every site keeps its lanes (n C floats per token);
    # with blocks of 2 only each block's input lanes and the layers' own results
    assert results[2][2] < 0.8 * results[None][2], (results[2][2], results[None][2])


def test_recompute_refuses_layers_that_modify_kept_tensors_in_place():
    from mhc_lab.ops.training import MHCResidualStream

    class InPlace(torch.nn.Module):
        def forward(self, h):
            y = torch.tanh(h)
            return y.mul_(0.5)

    stream = MHCResidualStream([InPlace(), InPlace()], 2, 8, recompute_block=2)
    with pytest.raises(InputError, match=r"modifies a tensor in place \(aten.mul_"):
        stream(torch.randn(3, 8, requires_grad=True))


def test_ops_keep_float32_coefficients_under_autocast():
    from mhc_lab.ops.training import mhc_pre as op_pre

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((5,), 4, 16))
    want = mhc_coefficients(x, phi, bias, alpha)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, post, res = op_pre(x, phi, bias, alpha, backend="reference")
    assert post.dtype == res.dtype == torch.float32
    torch.testing.assert_close(res, want.res, rtol=1e-6, atol=1e-7)


def test_stream_under_torch_compile_matches_eager():
    h = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    eager, compiled = _stream(None, layers=3), _stream(None, layers=3)
    out_e = eager(h)
    out_e.square().sum().backward()
    torch._dynamo.reset()
    run = torch.compile(compiled, fullgraph=True)  # fullgraph: no graph break around the custom ops
    out_c = run(h)
    out_c.square().sum().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_ops_refuse_bad_input_clearly():
    from mhc_lab.ops.training import MHCConnection, MHCResidualStream, mhc_post as op_post, mhc_pre as op_pre

    x, phi, bias, alpha, f = _site_inputs((3,), 4, 8)
    with pytest.raises(InputError, match="backend: expected one of"):
        op_pre(x, phi, bias, alpha, backend="fast")
    with pytest.raises(InputError, match=r"phi: expected shape \(24, 32\)"):
        op_pre(x, phi[:, :8], bias, alpha)
    with pytest.raises(InputError, match="kernels take float32/bfloat16/float16 lanes, got torch.float64"):
        op_pre(x, phi, bias, alpha, backend="kernels")
    x9, phi9, bias9, alpha9, _ = _site_inputs((2,), 9, 2)
    with pytest.raises(InputError, match="n = 1..8 lanes, got n = 9"):
        op_pre(x9.float(), phi9.float(), bias9.float(), alpha9.float(), backend="kernels")
    with pytest.raises(InputError, match="layer_output: expected dtype torch.float64"):
        op_post(x, f.float(), torch.ones(3, 4), torch.ones(3, 4, 4))
    with pytest.raises(InputError, match="recompute_block: expected None, 'auto' or a positive int, got 0"):
        MHCResidualStream([_Layer(8)], 4, 8, recompute_block=0)
    with pytest.raises(InputError, match="expected n = 4"):
        MHCConnection(4, 8)(torch.randn(2, 3, 8), torch.tanh)


# ------------------------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA backward kernels run only there")


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_split_coefficient_kernels_match_the_fused_one(n, C, tokens):
    """Kernel 1 as two kernels (dpre_program, then one thread per token, or a token over n R threads: "spread"
    in several tunings) against the fused kernel 1: the same math, dH_pre and the spread lines summed in
    another order, each group of the gradients (pre, post, res) on its own scale; and the spread kernels' bias
    and alpha gradients against the float64 truth of the same bf16 inputs."""
    from mhc_lab.kernels.pre_backward import coef_width, gemm_depth, pre_backward_kernels, two_phase_coefficients

    x, phi, bias, alpha, _ = _site_inputs((tokens,), n, C, seed=tokens, device="cuda")
    x = x.to(torch.bfloat16)
    dy, dpost, dres, _ = _upstream((tokens,), n, C, seed=5, device="cuda")
    dy = dy.to(torch.bfloat16)
    m = n * n + 2 * n
    flat = x.double().reshape(tokens, n * C)
    partial = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], -1).float()[None].repeat(4, 1, 1) / 4
    pre = mhc_coefficients(x.double(), phi, bias, alpha).pre.float().contiguous()
    spreads = {"spread": {}, "spread 256": {"threads": 256}, "spread 64": {"threads": 64}}
    kernels = {"fused": pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4)[0],
               "split": pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, phases="split")[0],
               **{name: two_phase_coefficients(n, C, "bfloat16", "cuda", splits=4, phases="spread", spread=tuning)
                  for name, tuning in spreads.items()}}
    outs = {}
    for name, coefficients in kernels.items():
        f32 = dict(dtype=torch.float32, device="cuda")
        got = [torch.full((tokens, k), float("nan"), **f32) for k in (n, m, m, 4)]
        dsplit = torch.full((tokens, 3, 2 * gemm_depth(n)), float("nan"), dtype=torch.bfloat16, device="cuda")
        coef = torch.full((tokens, coef_width(n)), float("nan"), **f32)
        coefficients(x, dy, partial, bias.float(), alpha.float(), dpost.float(), dres.float(), pre, *got, dsplit,
                     coef)
        outs[name] = got + [dsplit, coef]
    groups = {"pre": slice(0, n), "post": slice(n, 2 * n), "res": slice(2 * n, m)}
    if n == 1:  # one lane's 1 x 1 Sinkhorn is constant: its gradient is zero up to rounding
        del groups["res"]
    for name in kernels:
        for what, a, b in zip(("dpre", "dlogit", "dmix", "extra", "dsplit", "coef"), outs[name], outs["fused"]):
            if what in ("dlogit", "dmix"):
                for group, cols in groups.items():
                    assert _relmax(a[:, cols], b[:, cols]) < 1e-4, (name, what, group)
            else:
                assert _relmax(a, b) < (1e-2 if what == "dsplit" else 1e-4), (name, what)
    want = pre_backward(*(t.double() for t in (x, phi, bias, alpha, dy, dpost, dres)))
    for name in spreads:
        for group, cols in groups.items():
            assert _relmax(outs[name][1][:, cols].double().sum(0), want.bias[cols]) < 1e-4, (name, group)
        assert _relmax(outs[name][3][:, :3].double().sum(0), want.alpha) < 1e-4, name


def _cuda_site_case(n, C, tokens):
    """One CUDA site test's inputs: x (bf16), phi, bias, alpha, the layer's weight [C, C] float64, the upstream
    gradient g, all seeded (the same in every process), and the float64 truth of the site's gradients."""
    x, phi, bias, alpha, _ = _site_inputs((tokens,), n, C, seed=tokens, device="cuda")
    x = x.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(C)
    weight = (torch.randn(C, C, dtype=torch.float64, generator=gen) / math.sqrt(C)).to("cuda")
    g = _upstream((tokens,), n, C, seed=3, device="cuda")[3]
    return x, phi, bias, alpha, weight, g, _site_truth(x, phi, bias, alpha, weight, g)


def _cuda_site_grads(x, phi, bias, alpha, weight, g, linked):
    """The gradients of x, phi, bias and alpha of one site through the kernels (x as given, the rest float32)."""
    leaves = [x.clone().requires_grad_()] + [t.float().requires_grad_() for t in (phi, bias, alpha)]
    out = _site("kernels", *leaves, weight, linked)
    return torch.autograd.grad(out, leaves, g.to(out.dtype))


def _assert_site_grads_close(got, want, site):
    """Each gradient within 2e-2 of the float64 truth, relative in norm (bf16 tolerance)."""
    for name, a, b in zip(("x", "phi", "bias", "alpha"), got, want):
        rel = float((a.double() - b).norm() / b.norm())
        assert rel < 2e-2, (site, name, rel)


def _assert_site_grads_repeat(got, again):
    """The same gradients bit for bit from two runs of the same site."""
    for name, a, b in zip(("x", "phi", "bias", "alpha"), got, again):
        assert torch.equal(a, b), f"{name}: two runs differ (the backward must be deterministic)"


@needs_cuda
@pytest.mark.parametrize("phases", ["fused", "spread"])
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_backward_matches_reference_and_repeats_bitwise(n, C, tokens, phases):
    from mhc_lab.ops.training import coefficient_phases

    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)
    with coefficient_phases(phases):
        runs = [_cuda_site_grads(x, phi, bias, alpha, weight, g, linked) for linked in (False, True, True)]
    for site, got in (("separate", runs[0]), ("linked", runs[1])):
        _assert_site_grads_close(got, want, site)
    _assert_site_grads_repeat(runs[1], runs[2])


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_linked_site_with_the_post_gradient_to_pre_matches_float64(n, C, tokens):
    """The post's backward without dx, kernel 2 adding H_res^T g from g itself: bf16 tolerance of float64,
    deterministic."""
    from mhc_lab.ops.training import post_gradient_to_pre

    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)
    with post_gradient_to_pre(True):
        runs = [_cuda_site_grads(x, phi, bias, alpha, weight, g, True) for _ in range(2)]
    _assert_site_grads_close(runs[0], want, "linked, g to the pre")
    _assert_site_grads_repeat(*runs)


@needs_cuda
@pytest.mark.parametrize("tuning", [{"trim_lo": False}, {"block_tokens": 128, "threads": 256}, {"overlap_dx": False},
                                    {"overlap_dx": True}])
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_site_with_a_lane_tuning_matches_float64(n, C, tokens, tuning):
    """Whole sites (separate and linked) with kernel 2 tuned through lane_tuning: gradients at bf16 tolerance
    of float64. trim_lo (the default) leaves out products of zeros only, so the untrimmed product gives the same
    gradients bit for bit."""
    from mhc_lab.ops.training import lane_tuning

    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)

    for linked in (False, True):
        with lane_tuning(**tuning):
            got = _cuda_site_grads(x, phi, bias, alpha, weight, g, linked)
        _assert_site_grads_close(got, want, "linked" if linked else "separate")
        if tuning == {"trim_lo": False}:
            for name, a, b in zip(("x", "phi", "bias", "alpha"), got,
                                  _cuda_site_grads(x, phi, bias, alpha, weight, g, linked)):
                assert torch.equal(a, b), f"{name}: trim_lo changed the bits"


def test_lane_tuning_sets_kernel_2s_tuning_for_a_block_only():
    from mhc_lab.ops import training

    assert training.LANE_TUNING == {}
    with training.lane_tuning(block_tokens=128, threads=256):
        assert training.LANE_TUNING == {"block_tokens": 128, "threads": 256}
        with training.lane_tuning(trim_lo=True):
            assert training.LANE_TUNING == {"trim_lo": True}
        assert training.LANE_TUNING == {"block_tokens": 128, "threads": 256}
    assert training.LANE_TUNING == {}
    with pytest.raises(InputError, match=r"lane_tuning: expected keys among block_tokens, .*, got add_dx, colour"):
        with training.lane_tuning(colour=1, add_dx=True):
            pass
    assert training.LANE_TUNING == {}
    # lane_splits: the grid's token splits, taken instead of the wave rule's and kept out of the program's keywords
    # (the wave rule needs a GPU's SM count; the override answers without one)
    with training.lane_tuning(lane_splits=8, g_once=True):
        assert training._lane_splits(4, 2560, torch.device("cpu"), False, True) == 8
        assert training.lane_program_tuning() == {"g_once": True}
    for wrong in (0, 2.5, True, "8"):
        with pytest.raises(InputError, match=f"lane_splits expected a positive integer .*, got {wrong!r}"):
            training.check_lane_tuning({"lane_splits": wrong})
    assert training.LANE_TUNING == {}


def _lane_operands(tokens, n, C, seed):
    """Random operands of kernel 2 on CUDA as kernel 1 lays them out (dmix split into bf16 hi and lo), and the
    float64 dmix they stand for."""
    from mhc_lab.kernels.pre_backward import coef_width, gemm_depth

    g = torch.Generator().manual_seed(seed)
    m, kh = n * n + 2 * n, gemm_depth(n)
    dmix = torch.randn(tokens, m, generator=g, dtype=torch.float64)
    hi = dmix.to(torch.bfloat16)
    lo = (dmix - hi.double()).to(torch.bfloat16)
    dsplit = torch.zeros(tokens, 3, 2 * kh, dtype=torch.bfloat16)
    dsplit[:, 0, :m], dsplit[:, 0, kh : kh + m] = hi, hi
    dsplit[:, 1, :m] = lo
    dsplit[:, 2, :m], dsplit[:, 2, kh : kh + m] = hi, lo
    coef = torch.zeros(tokens, coef_width(n), dtype=torch.float32)
    coef[:, : n + 1] = torch.randn(tokens, n + 1, generator=g)
    return dsplit.cuda(), coef.cuda(), hi.double() + lo.double()


def _kernel2_dx_truth(x, dy, coef, dmix, phi32):
    """float64 dx of kernel 2 from its operands (no dx_post, no g): dmix phi_j + H_pre[j] dy + 2 ds x_j."""
    tokens, n, C = x.shape
    c = coef.double()
    return ((dmix.cuda() @ phi32.double()).reshape(tokens, n, C) + c[:, :n, None] * dy.double()[:, None]
            + c[:, n, None, None] * x.double())


@needs_cuda
@pytest.mark.parametrize("tuning", [{}, {"dx_products": 1}, {"block_tokens": 128, "threads": 256}, {"trim_lo": False},
                                    {"overlap_dx": False}, {"overlap_dx": True},
                                    {"overlap_dx": True, "dx_products": 1},
                                    {"stage_dx": False, "swizzle_epilogue": False}, {"dy_once": True},
                                    {"dy_once": False}, {"consumer_groups": 2}])
@pytest.mark.parametrize("add_dx", [False, True])
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_lane_kernel_tunings_match_float64(n, C, tokens, add_dx, tuning):
    """Kernel 2 alone, in each tuning, against float64 sums of the operands it is given: dx = dmix phi_j +
    H_pre[j] dy + 2 ds x_j (+ dx_post), dphi = dmix^T x; outputs poisoned first. With one product for dx
    (dmix rounded to bf16 in it) dx stays within one bf16 rounding of the truth."""
    from mhc_lab.kernels.pre_backward import dphi_from_partial, gemm_depth, lane_tiling, pre_backward_kernels

    x, phi, _, _, _ = _site_inputs((tokens,), n, C, seed=tokens + 7, device="cuda")
    x = x.to(torch.bfloat16)
    dy, _, _, dx_post = _upstream((tokens,), n, C, seed=11, device="cuda")
    dy, dx_post = dy.to(torch.bfloat16), dx_post.to(torch.bfloat16)
    dsplit, coef, dmix = _lane_operands(tokens, n, C, seed=tokens)
    phi32 = phi.float()
    if tuning.get("consumer_groups", 1) > 1 and lane_tiling(n, add_dx)[0] % 2:  # one lane per CTA: refused
        with pytest.raises(ValueError, match=r"consumer_groups = 2 .* lanes per CTA divisible by 2"):
            pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, add_dx=add_dx, lane_splits=2, **tuning)
        return
    _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, add_dx=add_dx, lane_splits=2, **tuning)
    dx = torch.full_like(x, float("nan"))
    partial = torch.full((2, 2 * gemm_depth(n), n * C), float("nan"), device="cuda")
    lanes(x, dy, dsplit, coef, phi32, *([dx_post] if add_dx else []), dx, partial)
    want = _kernel2_dx_truth(x, dy, coef, dmix, phi32)
    if add_dx:
        want = want + dx_post.double()
    assert _relmax(dx, want) < 1e-2
    assert _relmax(dphi_from_partial(partial, n), dmix.cuda().t() @ x.double().reshape(tokens, n * C)) < 1e-4


@needs_cuda
@pytest.mark.parametrize("extra", ["none", "add_dx", "post_grad"])
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_lane_kernel_overlapped_gives_the_plain_kernels_bits(n, C, tokens, extra):
    """overlap_dx reorders only when each GEMM is waited for, not what any accumulator sums or in which order
    (nor do two CTAs per SM, nor two consumer warpgroups with their own lanes): dx and dphi are the plain
    kernel's bit for bit, with every extra operand, in the default tiling and with one lane per CTA. With the
    post's g, H_res^T g is summed in line (g_once off): held per warpgroup it is added in another order, which
    test_cuda_lane_kernel_g_once_matches_float64 checks against float64."""
    from mhc_lab.kernels.pre_backward import gemm_depth, lane_tiling, pre_backward_kernels

    x, phi, _, _, _ = _site_inputs((tokens,), n, C, seed=tokens + 3, device="cuda")
    x = x.to(torch.bfloat16)
    dy, _, _, g = _upstream((tokens,), n, C, seed=5, device="cuda")
    dy, g = dy.to(torch.bfloat16), g.to(torch.bfloat16)
    dsplit, coef, _ = _lane_operands(tokens, n, C, seed=tokens + 1)
    more = {"none": [], "add_dx": [g], "post_grad": [g, torch.rand(tokens, n, n, device="cuda")]}[extra]
    flags = {"add_dx": extra == "add_dx", "post_grad": extra == "post_grad"}
    if extra == "post_grad":
        flags["g_once"] = False
    groups = [{}] + ([{"lane_group": 1}] if extra != "post_grad" and n > 1 else [])  # the default and one lane
    orders = [{"overlap_dx": False}, {"overlap_dx": True}]
    if extra != "post_grad" and n <= 4:  # two CTAs per SM: other lanes and stages, the same sums
        orders.append({"ctas_per_sm": 2})
    for group in groups:
        outs = []
        split_lanes = not group and lane_tiling(n, flags["add_dx"], flags["post_grad"])[0] % 2 == 0
        for order in orders + ([{"consumer_groups": 2}] if split_lanes else []):
            _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, lane_splits=2, **order, **flags,
                                            **group)
            dx = torch.full_like(x, float("nan"))
            partial = torch.full((2, 2 * gemm_depth(n), n * C), float("nan"), device="cuda")
            lanes(x, dy, dsplit, coef, phi.float(), *more, dx, partial)
            outs.append((dx, partial))
        for order, (dx, partial) in zip((orders + [{"consumer_groups": 2}])[1:], outs[1:]):
            assert torch.equal(outs[0][0], dx), f"dx differs ({extra}, {group}, {order})"
            assert torch.equal(outs[0][1], partial), f"dphi partial differs ({extra}, {group}, {order})"


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_lane_kernel_g_once_matches_float64(n, C, tokens):
    """Kernel 2 with the post's output gradient, H_res^T g formed per warpgroup (g_once), held or in the
    accumulators with the other terms (held_terms "acc", the default), and not, against float64 sums of its
    operands: dx = dmix phi_j + H_pre[j] dy + 2 ds x_j + sum_i H_res[i, j] g_i; outputs poisoned first.
    dphi does not see g: the same bits either way."""
    from mhc_lab.kernels.pre_backward import gemm_depth, pre_backward_kernels

    x, phi, _, _, _ = _site_inputs((tokens,), n, C, seed=tokens + 5, device="cuda")
    x = x.to(torch.bfloat16)
    dy, _, _, g = _upstream((tokens,), n, C, seed=9, device="cuda")
    dy, g = dy.to(torch.bfloat16), g.to(torch.bfloat16)
    res = torch.rand(tokens, n, n, device="cuda")
    dsplit, coef, dmix = _lane_operands(tokens, n, C, seed=tokens + 2)
    phi32 = phi.float()
    want = _kernel2_dx_truth(x, dy, coef, dmix, phi32) + torch.einsum("tij,tic->tjc", res.double(), g.double())
    partials = []
    # H_res^T g in line, held per warpgroup, and every term but the products in the accumulators before the
    # products (the default)
    for tuning in ({"g_once": False}, {"held_terms": "g"}, {}):
        _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, post_grad=True, lane_splits=2, **tuning)
        dx = torch.full_like(x, float("nan"))
        partial = torch.full((2, 2 * gemm_depth(n), n * C), float("nan"), device="cuda")
        lanes(x, dy, dsplit, coef, phi32, g, res, dx, partial)
        assert _relmax(dx, want) < 1e-2, tuning
        partials.append(partial)
    assert all(torch.equal(partials[0], p) for p in partials[1:])


def test_training_benchmark_times_every_op_it_names():
    """The benchmark's per-op timings call the custom ops with their current signatures (here on the CPU,
    through the C target, with a stand-in timer that runs each call once)."""
    from mhc_lab.course.bench_training import _site_components

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((9,), 4, 16))
    g = _upstream((9,), 4, 16)[3].float()
    calls = []

    def bench(fn):
        calls.append(fn())
        return 1e-3

    times = _site_components(x, phi, bias, alpha, g, bench)
    assert set(times) == {"fwd.pre", "fwd.post", "bwd.post", "bwd.pre", "bwd.add_dx", "bwd.pre_linked",
                          "fwd.pre_chained", "fwd.post_chained", "bwd.pre_chained"}
    assert len(calls) == len(times)


def test_host_benchmark_calls_every_op_it_names():
    """The host part's per-op rows call each op with its current signature (here on the CPU, through the C
    target), with a stand-in clock that counts the calls."""
    from mhc_lab.course.bench_training import _op_host_costs

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((9,), 4, 16))
    counted = []

    def wall_ms(fn, steps):
        fn()
        counted.append(steps)
        return 0.5

    costs = _op_host_costs(x, phi, bias, alpha, wall_ms, 3)
    assert {"pre_forward through torch.ops", "pre_backward through torch.ops", "post_backward through torch.ops",
            "post kernel called bare", "an empty custom op"} <= set(costs)
    assert len(counted) == len(costs) and all(v == 500.0 for v in costs.values())  # microseconds


@pytest.mark.parametrize("connection", ["residual", "copy_floor", "mhc_ours", "mhc_reference"])
def test_benchmark_block_runs_forward_and_backward(connection):
    """The block benchmark's model, tiny and on the CPU (the kernels through the C target): each connection
    kind runs forward and backward, and mHC ours (chained sites) gives the reference's output."""
    from mhc_lab.course.bench_training import N, _Block

    torch.manual_seed(0)
    block = _Block(32, 2, connection)
    shape = (2, 5, 32) if connection in ("residual", "copy_floor") else (2, 5, N, 32)
    h = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    out = block(h)
    out.float().square().sum().backward()
    assert out.shape == shape and torch.isfinite(h.grad.float()).all()
    if connection == "mhc_ours":
        from mhc_lab.ops.training import MHCConnection

        for site in block.sites:
            assert isinstance(site, MHCConnection)
        reference = _Block(32, 2, "mhc_ours")
        reference.load_state_dict(block.state_dict())
        for site in reference.sites:
            site.backend = "reference"
        with torch.no_grad():
            assert _relmax(block(h), reference(h)) < 2e-2  # bf16 lanes; the kernels round where the reference does not


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_lab07_pass_table_is_the_bytes_model(n):
    """Lab 07's named passes of a site move what the library's byte model ("mhc_minimal") says, per direction."""
    from mhc_lab.course import bytes_model
    from mhc_lab.course.training_lab import site_elements

    for direction in bytes_model.DIRECTIONS:
        lanes = sum(r + w for name, (r, w) in site_elements(n).items() if name.startswith(direction))
        assert lanes == bytes_model.total("mhc_minimal", n, direction).moved.per_C, direction


@pytest.mark.skipif(CUDA, reason="checks the command lines by parsing them on a machine without a GPU")
def test_warm_commands_are_valid_benchmark_command_lines():
    """bench warm runs each benchmark at 64 tokens: every command line it builds must parse (the benchmarks
    parse their arguments, then stop without a GPU with status 1; a bad argument would exit with 2)."""
    import importlib

    from mhc_lab.bench import SUITES
    from mhc_lab.course.bench_warm import commands

    lines = commands((2560, 4096))
    assert {line[0] for line in lines} == {"training", "forward"} and len(lines) == 4
    for line in lines:
        assert importlib.import_module(SUITES[line[0]]).main(line[1:]) == 1, line


def test_warm_runs_each_selected_test_in_a_process_of_its_own():
    """bench warm --tests: one pytest command line per selected test (here the CUDA tests of the fused post +
    projection, collected whether or not this machine would skip them)."""
    from mhc_lab.course.bench_warm import selected_test_commands

    lines = selected_test_commands("cuda_post_project")
    ids = [line[-1] for line in lines]
    assert len(ids) == len(set(ids)) >= 6
    assert all(i.startswith("tests/test_kernels_forward.py::test_cuda_post_project_") for i in ids)
    assert any(i.startswith("tests/test_kernels_forward.py::test_cuda_post_project_matches_float64[") for i in ids)
    assert all(line[:2] == ["-m", "pytest"] and "addopts=" in line for line in lines)


def test_warm_reports_the_end_of_a_failed_log(tmp_path):
    """A failed process's reason comes back in bench warm's own output: the last lines of its log."""
    from mhc_lab.course.bench_warm import failure_report

    log = tmp_path / "07-test.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)) + "\nE   AssertionError: ('linked', 'x', 0.5)\n")
    report = failure_report(str(log), lines=3).splitlines()
    assert report == ["    | line 98", "    | line 99", "    | E   AssertionError: ('linked', 'x', 0.5)"]
    (tmp_path / "empty.log").write_text("")
    assert failure_report(str(tmp_path / "empty.log")) == "    | (empty log)"


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("kernels", torch.float32)])
@pytest.mark.parametrize("next_phi", [False, True])
def test_linked_post_never_reads_the_values_of_link(backend, dtype, next_phi):
    """link only carries the lanes' gradient from the post back to the pre: pre_forward hands out an unfilled
    view for it, so the linked post's outputs must not depend on its values (NaN or zero, the same results)."""
    from mhc_lab.ops.training import post_forward_linked, pre_forward

    n, C, tokens = 4, 24, 5
    x, phi, bias, alpha, f = _site_inputs((tokens,), n, C, seed=3, dtype=dtype)
    y, post, res, _, _, _ = pre_forward(x, phi.to(dtype), bias.to(dtype), alpha.to(dtype), backend)
    results = []
    for fill in (float("nan"), 0.0):
        link = torch.full((1,), fill, dtype=dtype).expand(x.shape)
        out, partial = post_forward_linked(x, link, f, post, res, backend, phi.to(dtype) if next_phi else None)
        results.append((out, partial))
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_interleaved_rounds_time_every_implementation_in_turn_and_ratio_per_round():
    """The site benchmark's interleaved rounds: each round times every graph once, in turn (a drift over the
    run reaches all alike), and the chained site's ratio to TileKernels is taken per round."""
    from mhc_lab.course.bench_training import interleaved_rounds, round_ratios

    order, seconds = [], {"ours_chained": iter([1.0e-3, 1.2e-3, 0.9e-3]), "tilekernels": iter([2e-3, 2e-3, 2e-3])}

    def bench(fn):
        order.append(fn())
        return next(seconds[order[-1]])

    replays = {name: (lambda name=name: name) for name in ("ours_chained", "tilekernels")}
    rounds = interleaved_rounds(replays, bench, 3)
    assert order == ["ours_chained", "tilekernels"] * 3
    assert rounds == {"ours_chained": pytest.approx([1.0, 1.2, 0.9]), "tilekernels": pytest.approx([2.0, 2.0, 2.0])}
    ratio = round_ratios(rounds)
    assert ratio["ratios"] == pytest.approx([0.5, 0.6, 0.45])
    assert (ratio["median"], ratio["least"], ratio["most"]) == pytest.approx((0.5, 0.45, 0.6))
    assert round_ratios({"ours_chained": [1.0, 3.0], "tilekernels": [2.0, 2.0]})["median"] == pytest.approx(1.0)
    assert round_ratios({"ours_chained": [1.0]}) == {}
    with pytest.raises(ValueError, match=r"expected rounds >= 1, got 0"):
        interleaved_rounds(replays, bench, 0)


@pytest.mark.parametrize("flag", ["--graph-rounds", "--block-rounds"])
def test_training_benchmark_refuses_fewer_than_one_round(capsys, flag):
    from mhc_lab.course.bench_training import main

    with pytest.raises(SystemExit):
        main(["--parts", "site", flag, "0"])
    assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(CUDA, reason="checks the command line by parsing it on a machine without a GPU")
def test_training_benchmark_takes_uniform_branches_block_graphs_and_weight_grads_beside():
    """--uniform-branches, --block-graphs and --weight-grads-beside parse, and the overlap part is taken (then the
    benchmark stops without a GPU, status 1)."""
    from mhc_lab.course.bench_training import main

    assert main(["--parts", "site,block,overlap,block_zeroed", "--uniform-branches", "--block-graphs",
                 "--weight-grads-beside", "--blas", "cublaslt"]) == 1


@pytest.mark.parametrize("parts,bad", [("site,blocks", "blocks"), ("overlap,zeros,sweep", "zeros")])
def test_training_benchmark_refuses_a_part_it_does_not_have(capsys, parts, bad):
    from mhc_lab.course.bench_training import main

    with pytest.raises(SystemExit):
        main(["--parts", parts])
    err = capsys.readouterr().err
    assert "--parts: expected parts among site, block, sweep," in err and err.rstrip().endswith(f"got {bad}")


@pytest.mark.parametrize("kinds", ["residual", "mhc_ours_chained,chained"])
def test_training_benchmark_refuses_a_block_kind_it_does_not_have(capsys, kinds):
    from mhc_lab.course.bench_training import main

    with pytest.raises(SystemExit):
        main(["--parts", "block_kernels", "--block-kernels-kinds", kinds])
    err = capsys.readouterr().err
    assert "--block-kernels-kinds: expected kinds among copy_floor, mhc_ours," in err
    assert err.rstrip().endswith(f"got {kinds.split(',')[-1]}")


def test_copy_floor_moves_the_chained_sites_extra_bytes_and_leaves_the_block_as_the_residual():
    """The block benchmark's copy floor: its plan counts 76C per token for two chained sites at n = 4 (the 88C
    of the kernel notes less the residual's 12C), derived from bytes_model at other n too; its block gives the
    plain residual's output and input gradient bit for bit, and each pass copies the plan's elements."""
    from mhc_lab.course import bench_training as bt

    plan = bt.copy_floor_plan(4)
    assert plan[0]["pre"] == {"forward": [4, 5], "backward": [5, 13]}
    assert plan[1]["pre"] == {"forward": [5], "backward": [5, 13]}
    assert all(p["post"] == {"forward": [6], "backward": [7]} for p in plan)
    moved = [sum(sum(ks) for place in site.values() for ks in place.values()) for site in bt.copy_floor_plan(4)]
    assert sum(moved) == 76
    # per site: pre apply n + 1, post + projection 2n + 1, post backward 2n + 2 (g, x, f read; df written),
    # dpre_reduce n + 1, kernel 2 3n + 1, less the residual's 3 + 3: 9n; and the first site's projection, n
    for n in (1, 2, 8):
        assert sum(sum(ks) for site in bt.copy_floor_plan(n) for place in site.values()
                   for ks in place.values()) == 19 * n

    torch.manual_seed(0)
    residual = bt._Block(32, 2, "residual")
    floor = bt._Block(32, 2, "copy_floor")
    floor.load_state_dict(residual.state_dict())
    copied = []
    original = torch.Tensor.copy_

    def counting_copy(dst, src, *args, **kwargs):
        copied.append(src.numel())
        return original(dst, src, *args, **kwargs)

    h = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    g = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    grads = []
    for block, count in ((residual, False), (floor, True)):
        x = h.clone().requires_grad_(True)
        if count:
            torch.Tensor.copy_ = counting_copy
        try:
            out = block(x)
            out.backward(g)
        finally:
            torch.Tensor.copy_ = original
        grads.append((out, x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    tokens_c = h.numel()
    assert sorted(copied) == sorted(k * tokens_c // 2 for site in plan for place in site.values()
                                    for ks in place.values() for k in ks)


def test_block_rounds_take_each_kinds_overhead_per_round(monkeypatch):
    """The block benchmark's interleaved rounds (stand-in steps and timer): every kind timed once, then once per
    round in turn; the overhead over the plain residual taken per round, its median, least and most."""
    from mhc_lab.course import bench_training as bt

    monkeypatch.setattr(bt, "BLOCK_KINDS", ("residual", "mhc_ours_chained"))
    monkeypatch.setattr(bt, "_block_step", lambda width, kind, batch, seq: (lambda: kind))
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2**30)
    order = []
    seconds = {"residual": iter([10e-3, 10e-3, 11e-3, 12e-3]),
               "mhc_ours_chained": iter([11.5e-3, 11e-3, 12.1e-3, 12.6e-3])}

    def bench(fn, warmup_ms=25, rep_ms=100):
        order.append(fn())
        return next(seconds[order[-1]])

    out = bt.bench_block(256, bench, rounds=3, log=lambda line: None)
    assert order == ["residual", "mhc_ours_chained"] * 4
    assert out["overhead_pct"]["mhc_ours_chained"] == pytest.approx(15.0)
    assert out["rounds_ms"]["residual"] == pytest.approx([10.0, 11.0, 12.0])
    o = out["overhead_pct_rounds"]["mhc_ours_chained"]
    assert (o["median"], o["least"], o["most"]) == pytest.approx((10.0, 5.0, 10.0))
    assert out["peak_gib"] == {"residual": 1.0, "mhc_ours_chained": 1.0}


def test_block_rounds_with_weight_grads_beside_also_time_the_plain_block_without(monkeypatch):
    """With the layers' weight gradients beside (stand-in steps and timer), the block benchmark also times the plain
    block built without the side stream, and reads each kind per round against the faster of the two plain ones."""
    from mhc_lab.course import bench_training as bt

    monkeypatch.setattr(bt, "BLOCK_KINDS", ("residual", "mhc_ours_chained", "mhc_compiled"))
    monkeypatch.setattr(bt, "_block_step", lambda width, kind, batch, seq: (
        lambda k=bt.INLINE_RESIDUAL if bt.WEIGHT_GRADS_BESIDE is None else kind: k))
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2**30)
    seconds = {"residual": iter([10e-3, 10e-3, 12e-3]), "mhc_ours_chained": iter([11e-3, 11e-3, 12.6e-3]),
               bt.INLINE_RESIDUAL: iter([10.5e-3, 10.5e-3, 11e-3])}
    order = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        order.append(fn())
        return next(seconds[order[-1]])

    with bt.layers_weight_grads_beside(True):
        out = bt.bench_block(256, bench, rounds=2, log=lambda line: None)
    assert order == ["residual", "mhc_ours_chained", bt.INLINE_RESIDUAL] * 3
    assert "torch.compile" in out["errors"]["mhc_compiled"]
    assert out["overhead_pct_rounds"]["mhc_ours_chained"]["median"] == pytest.approx(7.5)  # 10%, 5%
    o = out["overhead_pct_rounds_vs_best_plain"]
    assert set(o) == {"mhc_ours_chained"}  # rounds: the plain blocks' faster 10 then 11 ms
    least_most = (o["mhc_ours_chained"]["least"], o["mhc_ours_chained"]["most"])
    assert least_most == pytest.approx((10.0, 100 * (12.6 / 11 - 1)))
    out = bt.bench_block(256, bench=lambda fn, **kw: 1e-2, rounds=2, log=lambda line: None)  # without: not timed
    assert bt.INLINE_RESIDUAL not in out["times_ms"] and "overhead_pct_rounds_vs_best_plain" not in out


def test_block_zeroed_times_the_plain_graph_on_random_tensors_then_on_zeros(monkeypatch):
    """bench_block_zeroed (a stand-in step on the CPU, its graph the step itself): two timings on the step's random
    tensors, then every tensor it reads zeroed in place (parameters and inputs) and two more; the difference in
    per cent of the faster random one."""
    from mhc_lab.course import bench_training as bt

    torch.manual_seed(0)
    layer, h, g = nn.Linear(8, 8), torch.randn(3, 8), torch.randn(3, 8)

    def step():
        return None

    step.block, step.inputs = layer, (h, g)
    monkeypatch.setattr(bt, "_block_step", lambda width, kind, batch, seq: step if kind == "residual" else None)
    monkeypatch.setattr(bt, "_graph_replay", lambda s: s)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    times = iter([10e-3, 11e-3, 8e-3, 9e-3])
    seen = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        seen.append(all(bool((t == 0).all()) for t in (h, g, *layer.parameters())))
        return next(times)

    out = bt.bench_block_zeroed(256, bench, log=lambda line: None)
    assert seen == [False, False, True, True]
    assert out["random_ms"] == pytest.approx([10.0, 11.0]) and out["zeroed_ms"] == pytest.approx([8.0, 9.0])
    assert out["zeroed_faster_pct"] == pytest.approx(20.0)


def test_graph_replay_keeps_the_steps_tensors_alive(monkeypatch):
    """_graph_replay (stand-in streams and graph): the step runs three times on a side stream, once under capture,
    and the replay it returns replays the graph and holds the step, so that the tensors the graph reads (held by
    the step's closure) outlive the step's other references."""
    import gc
    import weakref

    from mhc_lab.course import bench_training as bt

    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph):
        events.append("capture")
        yield

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Weights:  # what a block's step holds
        pass

    def make():
        weights = Weights()
        return (lambda: events.append("step") if weights else None), weakref.ref(weights)

    step, held = make()
    replay = bt._graph_replay(step)
    del step
    gc.collect()
    assert held() is not None
    assert events == ["step"] * 3 + ["capture", "step"]
    replay()
    assert events[-1] == "replay"
    del replay
    gc.collect()
    assert held() is None


def test_block_graphs_time_each_steps_replay_and_take_the_peak_launched(monkeypatch):
    """bench_block(graphs=True) (stand-in steps, timer and capture): each kind's step runs launched for its peak
    memory, then is captured, and the timer (rounds included) sees only the replays; after its timing each replay's
    input gradient is checked against the launched step's, and a kind whose replay computes something else (here
    copy_floor's, as a graph reading freed memory would) is refused with the difference, not timed."""
    from mhc_lab.course import bench_training as bt

    monkeypatch.setattr(bt, "BLOCK_KINDS", ("residual", "copy_floor", "mhc_ours"))
    launched = []

    def block_step(width, kind, batch, seq):
        h = torch.randn(4, 8, requires_grad=True)
        g = torch.randn(4, 8)

        def step():
            launched.append(kind)
            h.grad = 2 * g

        step.block, step.inputs = nn.Linear(8, 8), (h, g)
        if kind == "copy_floor":
            broken.append(step)
        return step

    def graph_replay(step):
        h, g = step.inputs

        def replay():
            h.grad = 0 * g if step in broken else 2 * g
            return "replay"

        replay.step = step
        return replay

    broken = []
    monkeypatch.setattr(bt, "_block_step", block_step)
    monkeypatch.setattr(bt, "_graph_replay", graph_replay)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2**30)
    timed = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        timed.append(fn())
        return 10e-3

    out = bt.bench_block(256, bench, rounds=2, log=lambda line: None, graphs=True)
    assert launched == ["residual", "residual", "copy_floor", "copy_floor", "mhc_ours", "mhc_ours"]
    assert timed == ["replay"] * (3 + 2 * 2) and out["timed"] == "as CUDA graphs"
    assert out["graph_rel_diff"] == {"residual": 0.0, "copy_floor": 1.0, "mhc_ours": 0.0}
    assert set(out["times_ms"]) == {"residual", "mhc_ours"} and set(out["rounds_ms"]) == {"residual", "mhc_ours"}
    assert "1.00e+00 (relative) off the launched step's, where 0.01 was expected" in out["errors"]["copy_floor"]
    assert out["peak_gib"] == {"residual": 1.0, "copy_floor": 1.0, "mhc_ours": 1.0}


def test_post_project_tuning_sets_the_fused_kernels_options_within_its_block():
    """post_project_tuning: the fused post + projection's CUDA options within the block, its defaults after it,
    and clear errors for a key or a value the kernel does not take."""
    from mhc_lab.ops import training as tr

    assert tr.POST_PROJECT_TUNING == {}
    with tr.post_project_tuning(gemm_wait="each"):
        assert tr.POST_PROJECT_TUNING == {"gemm_wait": "each"}
    assert tr.POST_PROJECT_TUNING == {}
    with pytest.raises(InputError, match="post_project_tuning: gemm_wait expected one of each, once, got 'later'"):
        with tr.post_project_tuning(gemm_wait="later"):
            pass
    with pytest.raises(InputError, match="expected keys among gemm_wait, got out_store"):
        tr.check_post_project_tuning({"out_store": "tma"})
    with pytest.raises(InputError, match="expected keys among gemm_wait, got block_k"):
        tr.check_post_project_tuning({"block_k": 32})
    assert tr.POST_PROJECT_TUNING == {}


def test_hidden_pct_reads_the_pairs_time_against_the_two_in_turn():
    from mhc_lab.course.bench_training import hidden_pct

    assert hidden_pct(1.0, 0.25, 1.0) == pytest.approx(100.0)  # the pair takes the GEMM's time
    assert hidden_pct(1.0, 0.25, 1.25) == pytest.approx(0.0)  # the two in turn
    assert hidden_pct(1.0, 0.25, 1.1) == pytest.approx(60.0)
    assert hidden_pct(1.0, 0.25, 1.5) == pytest.approx(-100.0)  # together slower than in turn


def test_overlap_times_each_kernel_alone_and_beside_the_gemm_and_resets_the_carveout(monkeypatch):
    """bench_overlap (stand-in streams, capture and timer, on the CPU): every kernel timed alone, then the GEMM
    alone and each kernel launched beside it on a side stream, in each mode (as a graph, launched, launched on a
    high-priority side stream) and per carve-out, the carve-out reset after each (also when a timing fails)."""
    from mhc_lab.course import bench_training as bt

    events, made = [], []

    class Stream:
        def __init__(self, priority=0):
            self.priority = priority
            made.append(self)

        @staticmethod
        def priority_range():
            return 0, -5

        def wait_stream(self, other):
            events.append("wait")

    main = Stream()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    ran = []

    @contextlib.contextmanager
    def on(stream):
        events.append(f"side {stream.priority}")
        yield
        events.append("back")

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(bt, "_graph_replay", lambda step: (lambda: (ran.append("graph"), step())))
    carved = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", carved.append, raising=False)
    calls = {"k": lambda: ran.append("k")}
    mm = torch.mm

    def gemm(a, b, out):
        ran.append("gemm")
        return mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", gemm)
    ms = {("k",): 0.25, ("copy",): 0.5, ("gemm",): 1.0, ("k", "gemm"): 1.1, ("copy", "gemm"): 1.5}
    graphs = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        ran.clear()
        fn()
        graphs.append(ran[:1] == ["graph"])
        key = tuple("copy" if r is None else r for r in ran if r != "graph")
        return (ms[key] + (0.05 if graphs[-1] else 0.0)) * 1e-3  # graphs timed a little slower, to tell them apart

    copy_ = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src: (ran.append(None), copy_(dst, src))[1])
    out = bt.bench_overlap(8, 16, bench, carveouts=(0, 16), calls=calls, device="cpu", log=lambda line: None)
    assert out["modes"] == ["graph", "launched", "launched_priority"]
    assert out["alone_ms"]["graph"] == pytest.approx({"k": 0.30, "copy of 8C per token": 0.55})
    assert out["alone_ms"]["launched"] == out["alone_ms"]["launched_priority"] == pytest.approx(
        {"k": 0.25, "copy of 8C per token": 0.5})
    assert carved == [16, None]  # none set for 0; 16 for the second, then the setting before
    for k in ("0", "16"):
        row = out["carveouts"][k]
        assert row["graph"]["gemm_ms"] == pytest.approx(1.05)
        assert row["graph"]["hidden_pct"] == pytest.approx({"k": 100 * (1.05 + 0.3 - 1.15) / 0.3,
                                                            "copy of 8C per token": 100 * 0.05 / 0.55})
        for mode in ("launched", "launched_priority"):
            assert row[mode]["gemm_ms"] == pytest.approx(1.0)
            assert row[mode]["hidden_pct"] == pytest.approx({"k": 60.0, "copy of 8C per token": 0.0})
    for k in ("0", "16"):  # against the GEMM without a carve-out (the same here) and the kernel in turn
        row = out["carveouts"][k]
        assert row["graph"]["saved_ms"] == pytest.approx({"k": 1.05 + 0.3 - 1.15, "copy of 8C per token": 0.05})
        assert row["launched"]["saved_ms"] == pytest.approx({"k": 0.15, "copy of 8C per token": 0.0})
    # per carve-out: 2 GEMM timings and 3 modes x 2 kernels, after 2 modes x 2 kernels alone
    assert len(graphs) == 4 + 2 * 8 and sum(graphs) == 2 + 2 * 3
    high = [st for st in made if st.priority == -5]
    assert len(high) == 1  # the highest priority of the range, for the launched_priority mode's side stream
    assert "side -5" in events and "side 0" in events
    assert events[:4] == ["wait", "side 0", "back", "wait"]  # the side stream waits, runs the kernel, main joins
    assert out["gemm"] == "dW [64, 16] = [64, 8] @ [8, 16], bf16"

    carved.clear()
    timings = iter(range(100))

    def failing(fn, warmup_ms=25, rep_ms=100):
        if next(timings) == 4:  # the GEMM's first timing, after the two kernels' alone in two modes
            raise RuntimeError("timing failed")
        return bench(fn)

    with pytest.raises(RuntimeError, match="timing failed"):
        bt.bench_overlap(8, 16, failing, carveouts=(32,), calls=calls, device="cpu", log=lambda line: None)
    assert carved == [32, None]


class _StandInStream:
    """A stream stand-in for the CPU: records what waits on what."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def _stand_in_side_stream(log, side_stream=None):
    from mhc_lab.course.bench_training import SideStream

    side_stream = side_stream or SideStream
    main, side = _StandInStream("main", log), _StandInStream("side", log)

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append("back")

    return side_stream(stream=side, on=on, current=lambda: main)


@pytest.mark.parametrize("shape,out,bias", [((2, 5, 7), 3, True), ((11, 16), 40, False), ((1, 1, 1), 1, True)])
def test_weight_grads_beside_equal_linears_and_are_written_on_the_side_stream(shape, out, bias):
    """LinearWeightGradBeside (float64, stand-in streams): the output and the gradients of x, W and b equal
    nn.Linear's for a random upstream gradient, added to gradients already there; the side stream waits for the
    main one before each weight gradient, the main one waits for it once when the backward ends, and what the
    side stream read is let go then."""
    from mhc_lab.course.bench_training import LinearWeightGradBeside

    torch.manual_seed(1)
    log = []
    side = _stand_in_side_stream(log)
    plain = nn.Linear(shape[-1], out, bias=bias).double()
    twin = nn.Linear(shape[-1], out, bias=bias).double()
    twin.load_state_dict(plain.state_dict())
    beside = nn.Sequential(LinearWeightGradBeside(twin, side), nn.Tanh(), LinearWeightGradBeside(
        nn.Linear(out, 5).double(), side))
    reference = nn.Sequential(plain, nn.Tanh(), nn.Linear(out, 5).double())
    reference[2].load_state_dict({"weight": beside[2].weight.detach(), "bias": beside[2].bias.detach()})
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 5, dtype=torch.float64)
    for _ in range(2):  # the second pass adds to the first's gradients
        got = [x.clone().requires_grad_(True) for _ in range(2)]
        ys = [model(xi) for model, xi in zip((reference, beside), got)]
        assert torch.allclose(ys[0], ys[1], rtol=1e-12, atol=1e-12)
        for y in ys:
            y.backward(g)
        assert torch.allclose(got[0].grad, got[1].grad, rtol=1e-12, atol=1e-12)
        for p, q in zip(reference.parameters(), beside.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)
        assert side.held == [] and side.joins is None
    one_pass = ["side waits for main", "on side", "back"] * 2 + ["main waits for side"]
    assert log == one_pass * 2

    class Fails(torch.autograd.Function):  # a backward that fails after the side stream's work was queued
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("later node failed")

    log.clear()
    with pytest.raises(RuntimeError, match="later node failed"):
        beside(Fails.apply(x.clone().requires_grad_(True))).backward(g)
    assert "main waits for side" not in log and side.joins is not None  # the failed pass never reached its end
    beside(x.clone().requires_grad_(True)).backward(g)  # the next pass queues its own join
    assert log[-1] == "main waits for side" and side.held == []


def test_blocks_layers_take_their_weight_gradients_beside_within_the_switch(monkeypatch):
    """_Block built within layers_weight_grads_beside(True) has no nn.Linear left in its layers, every one replaced
    on the same parameters, and gives the plain block's output and gradients (float64, stand-in streams)."""
    from mhc_lab.course import bench_training as bt

    log = []
    real = bt.SideStream
    carveouts = []
    monkeypatch.setattr(bt, "SideStream", lambda carveout: (carveouts.append(carveout),
                                                             _stand_in_side_stream(log, real))[1])
    torch.manual_seed(0)
    plain = bt._Block(32, 2, "residual").double()
    with bt.layers_weight_grads_beside(True):
        beside = bt._Block(32, 2, "residual").double()
    assert bt.WEIGHT_GRADS_BESIDE is None and carveouts == [0]
    assert not any(isinstance(m, nn.Linear) for m in beside.modules())
    assert sum(isinstance(m, bt.LinearWeightGradBeside) for m in beside.modules()) == 4
    beside.load_state_dict(plain.state_dict())
    h = torch.randn(2, 6, 32, dtype=torch.float64)
    g = torch.randn(2, 6, 32, dtype=torch.float64)
    xs = [h.clone().requires_grad_(True) for _ in range(2)]
    for block, x in zip((plain, beside), xs):
        block(x).backward(g)
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), beside.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    assert log.count("main waits for side") == 1 and log.count("side waits for main") == 4


@needs_cuda
@pytest.mark.parametrize("connection", ["residual", "mhc_ours"])
@pytest.mark.parametrize("carveout", [0, 16])
def test_cuda_weight_grads_beside_match_the_plain_block_launched_and_as_a_graph(connection, carveout):
    """On CUDA streams (the block benchmark's width 2560, 512 tokens, bf16): a block whose layers' weight gradients
    are computed on a side stream, with and without SMs carved out of those matmuls, gives the plain block's input
    and parameter gradients, for a random upstream gradient, launched and replayed as a CUDA graph (the side
    stream forked and joined inside the capture); a race with the side stream would read unfinished sums."""
    from mhc_lab.course import bench_training as bt
    from mhc_lab.ops.training import chaining_on_cuda

    width = 2560
    shape = (1, 512, width) if connection == "residual" else (1, 512, bt.N, width)

    def build():
        torch.manual_seed(0)
        return bt._Block(width, width // 128, connection).cuda()

    plain = build()
    with bt.layers_weight_grads_beside(True, carveout):
        beside = build()
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(block):
        def run():
            h.grad = None
            block.zero_grad(set_to_none=True)
            with chaining_on_cuda(True):
                block(h).backward(g)
        return run

    def grads(block):
        torch.cuda.synchronize()
        return [h.grad.float().clone()] + [p.grad.float().clone() for p in block.parameters()]

    def near(got, want, what):
        for k, (a, b) in enumerate(zip(got, want)):
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert err < 1e-2, f"{what}: gradient {k} off by {err:.2e} (relative norm)"

    step(plain)()
    want = grads(plain)
    step(beside)()
    near(grads(beside), want, "launched")
    replay = bt._graph_replay(step(beside))
    for p in beside.parameters():  # stale values would pass unseen: the replay must write every gradient
        p.grad.fill_(float("nan"))
    h.grad.fill_(float("nan"))
    replay()
    near(grads(beside), want, "as a CUDA graph")


def test_sm_carveout_sets_and_restores_and_refuses_a_torch_without_it(monkeypatch):
    from mhc_lab.course.bench_training import layers_weight_grads_beside, sm_carveout

    state = {"sms": 8}
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["sms"], raising=False)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda k: state.update(sms=k), raising=False)
    with sm_carveout(24):
        assert state["sms"] == 24
    assert state["sms"] == 8
    with sm_carveout(0):
        assert state["sms"] == 8
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    with pytest.raises(RuntimeError, match="an SM carve-out of 16 needs torch._C._set_sm_carveout_experimental"):
        with sm_carveout(16):
            pass
    with pytest.raises(ValueError, match="carveout: expected a number of SMs >= 0, got -1"):
        with layers_weight_grads_beside(True, -1):
            pass


@pytest.mark.parametrize("argv,message", [
    (["--beside-carveout", "16"], "--beside-carveout 16: expected with --weight-grads-beside, given without"),
    (["--weight-grads-beside", "--beside-carveout", "-2"], "--beside-carveout: expected a number of SMs >= 0, got -2"),
])
def test_training_benchmark_refuses_a_carveout_it_cannot_use(capsys, argv, message):
    from mhc_lab.course.bench_training import main

    with pytest.raises(SystemExit):
        main(["--parts", "block", *argv])
    assert message in capsys.readouterr().err


def test_weight_grads_beside_skip_dx_for_an_input_that_needs_none():
    """An input without requires_grad (a stack's first layer): no dx is formed, and W's and b's gradients still
    equal nn.Linear's."""
    from mhc_lab.course.bench_training import LinearWeightGradBeside

    torch.manual_seed(2)
    plain = nn.Linear(9, 5).double()
    twin = nn.Linear(9, 5).double()
    twin.load_state_dict(plain.state_dict())
    beside = LinearWeightGradBeside(twin, _stand_in_side_stream([]))
    x = torch.randn(3, 4, 9, dtype=torch.float64)
    g = torch.randn(3, 4, 5, dtype=torch.float64)
    plain(x).backward(g)
    beside(x).backward(g)
    assert x.grad is None
    for p, q in zip(plain.parameters(), beside.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)
