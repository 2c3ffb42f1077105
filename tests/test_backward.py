"""The backward of one mHC site: the hand-derived reference, the fused backward kernels and the training ops.

- mhc_lab.reference.backward against autograd of the forward reference, in float64 (n = 1, 2, 4, 8, batch
  dimensions, awkward widths, random upstream gradients, never all-ones).
- The backward kernels through TileLang's C target against that float64 truth, on NaN-poisoned outputs;
  their sm_90 builds with nvcc; on a GPU (skipped otherwise) the CUDA kernels at bf16 tolerance, bitwise
  repeatable from run to run.
- The ops and modules of mhc_lab.ops: gradcheck, both backends, both paths of a linked site, chained sites,
  recompute, torch.compile, bad input.
"""

import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

KERNEL_CASES = [(4, 37, 5), (4, 8, 1), (1, 9, 7), (2, 24, 13), (8, 5, 3), (3, 11, 4)]
needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found: the sm_90 build check needs it")


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
    dpre, dtok, dmix = (torch.full((tokens, k), nan) for k in (n, m + 4, m))
    coefficients(x.float(), dy.float(), partial, bias.float(), alpha.float(), dpost.float(), dres.float(),
                 dpre, dtok, dmix)
    dx, dphi = torch.full(x.shape, nan), torch.full((1, m, n * C), nan)
    lanes_in = {"separate": [], "dx_post": [g.float()], "post_grad": [g.float(), res.float()]}[link]
    lanes(x.float(), dy.float(), pre, dmix, dtok, phi.float(), *lanes_in, dx, dphi)
    dlogit, extra = dtok[:, :m], dtok[:, m:]  # per token: the bias gradient, then alpha's and ds
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
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

    lanes = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True), "sm_90")
    source = lanes.get_kernel_source()
    assert "wgmma" in source and "tma_load(g_desc" in source
    assert source.count("tma_load(g_desc") == n  # one box per lane of g and stage
    post = compile_program(post_backward_program(n, C, "bfloat16", "sm_90", lanes_grad=False), "sm_90")
    assert "__restrict__ dx," not in post.get_kernel_source() and "__restrict__ df," in post.get_kernel_source()


def test_lane_kernel_refuses_both_forms_of_the_posts_gradient():
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

    with pytest.raises(ValueError, match="add_dx .* and post_grad .* got both"):
        pre_backward_lanes_program(4, 64, "bfloat16", "sm_90", add_dx=True, post_grad=True)


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40), (8, 8)])
def test_the_post_gradient_kernel_reads_each_lane_of_g_once_per_warpgroup_for_sm90(n, C):
    """With g each consumer warpgroup binds the tile's n lanes of g to names once (g0 .. g{n-1}, the second
    warpgroup's with a suffix) and forms every term of dx but the products from them; one pipeline load per lane
    of g."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program

    groups = lane_tiling(n, post_grad=True)[2]
    src = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True),
                          "sm_90").get_kernel_source()
    assert src.count("tma_load(g_desc") == n
    assert len(re.findall(r"float2 g[0-9](?:_1)? = ", src)) == n * groups


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40), (8, 8)])
def test_the_post_gradient_kernel_leaves_the_epilogue_no_tile_to_read_after_each_wait_for_sm90(n, C):
    """With g every term of dx but the products is written into the accumulators before the products (dy
    converted once per warpgroup): after each wait for a lane's products the epilogue reads no tile of x, dy or
    g, and unpacks no bf16 pair."""
    from mhc_lab.kernels._target import BF16_PAIR_CONVERSION, compile_program
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

    def epilogues(src):  # the code after each wait for a lane's products up to its dx store's own wait (the
        # last wait of a tile, for the dphi products, is followed by the stage's release: keep[0])
        parts = [part.split("tma_store_wait")[0] for part in re.split(r"tl::wait_wgmma<\d+>\(\);", src)[1:]]
        return [part for part in parts if "keep[0]" not in part]

    source = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", post_grad=True),
                             "sm_90").get_kernel_source()
    assert len(epilogues(source)) >= n
    for e in epilogues(source):
        assert not re.findall(BF16_PAIR_CONVERSION, e) and "dys" not in e and "res_s" not in e


@needs_nvcc
@pytest.mark.parametrize("n,C,linked,splits", [(4, 4096, False, 4), (4, 4096, True, 4), (4, 136, True, 4),
                                               (2, 100, True, 1), (8, 24, False, 2), (8, 24, True, 2),
                                               (3, 40, True, 4)])
def test_pre_backward_builds_for_sm90(n, C, linked, splits):
    """Kernel 1 in the form its n takes (two kernels where n is a power of two, else one) and kernel 2, with
    and without the post's dx."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_coefficients import coefficient_programs
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

    programs = coefficient_programs(n, C, "bfloat16", "sm_90", splits=splits)
    assert len(programs) == (1 if n == 3 else 2)
    tokens = compile_program(programs[-1], "sm_90").get_kernel_source()
    # Sinkhorn's sums stay on chip: a thread's local array, or (spread) a column of shared memory per thread
    assert ("float kept[" if n == 3 else "((float*)kept)[") in tokens
    lanes = compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", add_dx=linked,
                                                       splits=2), "sm_90")
    assert "wgmma" in lanes.get_kernel_source()  # the dmix phi and dphi products run on tensor cores


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (8, 24), (2, 40), (1, 7)])
def test_spread_coefficient_kernel_builds_for_sm90(n, C):
    """The spread kernel: a token over n R threads, its line sums by warp shuffles, each Sinkhorn step's sums
    kept in shared memory, one slot per thread (the steps unrolled): stored once, read twice (the reciprocal
    and the undo)."""
    from mhc_lab.kernels._coefficients import sinkhorn_steps, spread_layout
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_coefficients import spread_coefficients_program

    src = compile_program(spread_coefficients_program(n, C, "bfloat16", "sm_90", splits=3),
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


def test_kernel_1_takes_its_form_from_n_and_the_target():
    """Two CUDA kernels (the streaming dH_pre, then the spread per-token kernel) where n is a power of two,
    one kernel elsewhere and on the C target; the two CUDA-only programs refuse what they cannot run."""
    from mhc_lab.kernels.pre_backward_coefficients import (
        coefficient_programs,
        dpre_program,
        spread_coefficients_program,
    )

    assert [len(coefficient_programs(n, 16, "bfloat16", "sm_90")) for n in (1, 2, 3, 4, 6, 8)] == [2, 2, 1, 2, 1, 2]
    assert [len(coefficient_programs(n, 16, "float32", "c")) for n in (1, 3, 4)] == [1, 1, 1]
    with pytest.raises(ValueError, match="CUDA only"):
        spread_coefficients_program(4, 64, "float32", "c")
    with pytest.raises(ValueError, match="power of two.*n = 3"):
        spread_coefficients_program(3, 64, "bfloat16", "sm_90")
    with pytest.raises(ValueError, match="a CUDA kernel"):
        dpre_program(4, 64, "float32", "c")


@needs_nvcc
@pytest.mark.parametrize("n,C", [(4, 4096), (4, 136), (8, 24), (1, 7)])
def test_dpre_kernel_builds_for_sm90(n, C):
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_coefficients import dpre_program

    reduce = compile_program(dpre_program(n, C, "bfloat16", "sm_90"), "sm_90").get_kernel_source()
    assert "warp_reduce_sum" in reduce  # one warp per token, shuffle-reduced
    if C % 8 == 0:
        assert "uint4" in reduce  # 16-byte loads of x and dy


@needs_nvcc
def test_lane_kernel_stages_the_posts_dx_for_sm90():
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program

    plain, linked = (compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=a, splits=2),
                                     "sm_90").get_kernel_source() for a in (False, True))
    # each lane's dx_post tile arrives by a bulk copy into shared memory, with the other operands (and each
    # lane's x tile: the two kernels may take different numbers of lanes per CTA)
    lanes_plain, lanes_linked = lane_tiling(4)[0], lane_tiling(4, True)[0]
    assert linked.count("tma_load") == plain.count("tma_load") + (lanes_linked - lanes_plain) + lanes_linked


@needs_nvcc
def test_lane_kernel_trims_the_lo_product_to_its_rows_for_sm90():
    """The lo.hi product's K is the KH rows that are not zero (C = 4096, n = 4: 2 m64n32k16 per lane, against 4
    for each of the two K = 2 x 32 products), and only those columns of dsplit's lo row are loaded."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program

    def products(source):  # the trip counts of the loops that issue the tensor-core instructions
        return sorted(int(k) for k in re.findall(r"for \(int ki\w* = 0; ki\w* < (\d+);", source))

    trimmed = compile_program(pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True),
                              "sm_90").get_kernel_source()
    lanes = lane_tiling(4, True)[0]
    assert products(trimmed) == [2] * lanes + [4] * 2 * lanes  # lo, then hi and dphi


@needs_nvcc
@pytest.mark.parametrize("n,add_dx", [(1, True), (2, True), (4, True), (8, True), (4, False), (8, False)])
def test_lane_kernel_overlapped_waits_for_each_lane_and_releases_its_operands_last_for_sm90(n, add_dx):
    """Per token tile, each lane's dx GEMMs are issued before the previous lane's epilogue (which first waits
    for all but the newest lane's groups, then fences the accumulator it reads), and the stage's GEMM operands
    (dmix's three splits, the lanes' x tiles) are handed back to the producer only after the tile's last wait.
    With two consumer warpgroups (n = 4) each warpgroup's lanes in turn, in its own branch."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program

    source = compile_program(pre_backward_lanes_program(n, 4096, "bfloat16", "sm_90", add_dx=add_dx),
                             "sm_90").get_kernel_source()
    lanes, _, groups = lane_tiling(n, add_dx)
    assert groups == (2 if n == 4 else 1)  # two warpgroups of two lanes each where n = 4
    own = lanes // groups  # each warpgroup's lanes
    consumer = source[source.index("warpgroup_reg_alloc"):]
    waits = re.findall(r"wait_wgmma<(\d+)>", consumer)
    assert waits == (["2"] * (own - 1) + ["0", "0"]) * groups
    # the GEMMs issued before the first wait: the first two lanes' dx products (one lane's with one lane), two
    # commit groups per lane (hi, lo)
    first_wait = consumer.index("wait_wgmma<")
    assert consumer[:first_wait].count("warpgroup_commit_batch") == min(own, 2) * 2
    tail = consumer[consumer.rindex("wait_wgmma<0>"):]
    released = re.findall(r"mbarrier\[\(\(tb_1 [%&] \d+\) \+ \d+\)\]\.arrive\(\)", tail)  # % or & by the stages
    operands = 3 + lanes  # a_dx, a_hl, a_l0, the lanes' x tiles
    # one warpgroup: each operand's release; two: the stage's one release, after both warpgroups' branches
    assert len(released) == (operands if groups == 1 else 1), released


@pytest.mark.parametrize("add_dx,post_grad", [(True, False), (False, False), (False, True)])
def test_lane_kernel_gives_two_consumer_warpgroups_their_own_lanes_for_sm90(add_dx, post_grad):
    """n = 4 (the CUDA that TileLang generates, no GPU or nvcc needed): a producer and two consumer warpgroups,
    384 threads. In the token loop the consumers branch on the thread index, and each branch issues the
    tensor-core products of its own half of the CTA's lanes only, into its own accumulators: per lane the dx
    products hi and lo, the first starting from zero (scale-d 0, no clearing of registers in the branch, which
    made ptxas serialise every wgmma), and the dphi product; each waits for its own lanes' dx stores. With the
    post's g every product adds onto what its accumulator holds (scale-d 1): the other terms of dx are written
    into it first."""
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program
    from mhc_lab.kernels.source import generated_source, kernel_text

    program = pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=add_dx, post_grad=post_grad, splits=2)
    src = kernel_text(generated_source(program, "sm_90"))
    lanes, _, groups = lane_tiling(4, add_dx, post_grad)
    assert groups == 2
    half = lanes // 2
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
    """Where C is a multiple of 8 each lane's dx tile leaves registers by stmatrix into its own shared buffer
    and goes out by one TMA store per token tile; before a buffer is written again the store that read it last
    time is waited for (LG - 1 stores may stay in flight), and all of them once after the token loop; nothing
    stores dx from registers. dy's and dx_post's TMA loads use the same swizzle as the x tiles the GEMMs read.
    C = 100 cannot take TMA stores. With two consumer warpgroups, each waits for its own lanes' stores."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import lane_tiling, pre_backward_lanes_program
    from mhc_lab.kernels.source import tma_swizzles

    def build(C=4096):
        return compile_program(pre_backward_lanes_program(n, C, "bfloat16", "sm_90", add_dx=add_dx), "sm_90")

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
    source = build(C=100).get_kernel_source()
    assert "tma_store" not in source and re.search(r"\(dx \+ ", source)


@pytest.mark.parametrize("n,splits", [(1, 1), (2, 3), (4, 1), (4, 2), (8, 5)])
def test_dphi_from_partial_sums_splits_and_halves_and_skips_the_padding(n, splits):
    """dphi = the sum over token splits of the dmix_hi rows plus the dmix_lo rows of kernel 2's partial; the
    padding rows past n^2+2n in each half are never read (NaN there must not reach dphi)."""
    from mhc_lab.kernels.pre_backward_lanes import dphi_from_partial
    from mhc_lab.kernels.pre_backward_operands import gemm_depth

    m, kh = n * n + 2 * n, gemm_depth(n)
    partial = torch.randn(splits, 2 * kh, n * 24, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    partial[:, m:kh], partial[:, kh + m :] = float("nan"), float("nan")
    want = sum(partial[s, h * kh : h * kh + m] for s in range(splits) for h in (0, 1))
    got = dphi_from_partial(partial, n)
    assert got.shape == (m, n * 24)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("add_dx,post_grad", [(False, False), (True, False), (False, True)])
def test_lane_kernel_tiles_fit_in_shared_memory_in_the_deepest_pipeline_that_fits(n, add_dx, post_grad):
    """The lanes, columns and stages of kernel 2 fit a CTA's shared memory, and one stage more would not (up to
    3 with dx_post or g, 2 without); lanes divide n and the warpgroups' lanes, and g takes every lane."""
    from mhc_lab.kernels._target import SMEM_LIMIT
    from mhc_lab.kernels.pre_backward_lanes import lane_stages, lane_tiling, lanes_shared_bytes

    lanes, columns, groups = lane_tiling(n, add_dx, post_grad)
    assert n % lanes == 0 and lanes % groups == 0 and (lanes == n or not post_grad)
    deepest = 3 if add_dx or post_grad else 2
    stages = lane_stages(n, lanes, columns, add_dx, post_grad)
    assert 1 <= stages <= deepest
    assert lanes_shared_bytes(n, lanes, columns, stages, add_dx, post_grad) <= SMEM_LIMIT
    if stages < deepest:
        assert lanes_shared_bytes(n, lanes, columns, stages + 1, add_dx, post_grad) > SMEM_LIMIT


@pytest.mark.parametrize("n,C,sms", [(4, 2560, 132), (4, 4096, 132), (4, 7168, 132), (8, 4096, 132), (2, 40, 132),
                                     (4, 4096, 78), (1, 100000, 16), (3, 1280, 132)])
@pytest.mark.parametrize("add_dx,post_grad", [(False, False), (True, False), (False, True)])
def test_lane_splits_fill_the_waves_of_ctas(n, C, sms, add_dx, post_grad):
    # kernel 2 runs one CTA per SM: (column blocks x splits) CTAs in waves of `sms`; the policy takes the
    # fewest splits whose waves are at least 90% full, or else the fullest waves there are
    from mhc_lab.kernels.pre_backward_lanes import lane_splits_for, lane_tiling

    lanes, columns, _ = lane_tiling(n, add_dx, post_grad)
    blocks = -(-C // columns) * (n // lanes)

    def fullness(s):
        return blocks * s / (sms * -(-(blocks * s) // sms))

    chosen = lane_splits_for(n, C, sms, add_dx=add_dx, post_grad=post_grad)
    assert 1 <= chosen <= 32
    best = max(fullness(s) for s in range(1, 33))
    if best >= 0.9:
        assert fullness(chosen) >= 0.9 and all(fullness(s) < 0.9 for s in range(1, chosen))
    else:
        assert fullness(chosen) == best


def test_backward_factories_refuse_bad_configurations():
    from mhc_lab.kernels.post_backward import post_backward_program
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

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
    from mhc_lab.ops import mhc_post as op_post, mhc_pre as op_pre, mhc_site

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


def _post_gradient_to_pre(monkeypatch, enabled: bool) -> None:
    """Linked sites take the other path than their lanes' default: the post hands g to the pre's backward
    (enabled), or writes H_res^T g for it. The ops decide by dispatch.post_gradient_to_pre_for at the forward;
    the tests replace it to run both paths on any n and device."""
    from mhc_lab.ops import site_ops

    monkeypatch.setattr(site_ops, "post_gradient_to_pre_for", lambda x, backend: enabled)


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
@pytest.mark.parametrize("n,C", [(4, 24), (2, 7), (8, 3), (3, 10)])
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
    """The post's backward writes no dx and hands g back through link; the pre's backward adds H_res^T g (the
    path linked sites take on CUDA at n = 4, here on the CPU at any n). Same gradients as the float64 truth;
    the ops see the path decided at the forward."""
    from mhc_lab.ops import site_ops

    calls = {"post": [], "pre": []}
    real_post, real_pre = site_ops.post_backward_impl, site_ops.pre_backward_impl

    def spy_post(*args):
        calls["post"].append(args[6] if len(args) > 6 else True)
        return real_post(*args)

    def spy_pre(*args):
        calls["pre"].append(args[12] if len(args) > 12 else False)
        return real_pre(*args)

    monkeypatch.setattr(site_ops, "post_backward_impl", spy_post)  # what the eager path's backward calls
    monkeypatch.setattr(site_ops, "pre_backward_impl", spy_pre)
    x, phi, bias, alpha, _ = _site_inputs((2, 5), n, C, seed=C + n)
    weight = torch.randn(C, C, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) / math.sqrt(C)
    g = _upstream((2, 5), n, C, seed=C)[3]
    x = x.to(dtype)
    want = _site_truth(x, phi, bias, alpha, weight, g)
    coef_dtype = torch.float64 if backend == "reference" else torch.float32
    leaves = [x.clone().requires_grad_()] + [t.to(coef_dtype).requires_grad_() for t in (phi, bias, alpha)]
    with monkeypatch.context() as forward_only:
        _post_gradient_to_pre(forward_only, True)
        out = _site(backend, *leaves, weight, linked=True)
    got = torch.autograd.grad(out, leaves, g.to(out.dtype))  # the backward keeps what the forward decided
    assert calls == {"post": [False], "pre": [True]}  # no dx from the post; the pre adds H_res^T g
    for name, a, b in zip(("x", "phi", "bias", "alpha"), got, want):
        assert _relmax(a, b) < tol, name


@pytest.mark.parametrize("linked,post_grad,add_dx,to_pre", [(0, 0, False, False), (0, 1, False, False),
                                                            (1, 0, True, False), (1, 1, False, True)])
def test_registered_pre_backward_asks_for_the_kernel_2_the_other_paths_take(monkeypatch, linked, post_grad, add_dx,
                                                                             to_pre):
    """native.cpp's registered pre backward asks site_ops for its plan with what the op was given (the forward
    partial's splits, whether dx_post came, post_grad, as ints); the plan it gets is for the kernel 2 that the
    eager path's plans and the CPU path take for the same call: H_res^T g only for a linked pre with post_grad."""
    from types import SimpleNamespace

    from mhc_lab.ops import site_ops

    asked = []

    def plan(x, op, *flags):
        asked.append((op, flags))
        return SimpleNamespace(splits=3)  # a forward plan's partial splits, for the eager pre's backward plan

    monkeypatch.setattr(site_ops, "_plan", plan)
    site_ops.plan_for_native("pre_backward", torch.empty(2, 4, 8), 3, linked, post_grad)
    site_ops._choose_plan(torch.empty(2, 4, 8), "pre", False, bool(linked), bool(post_grad))
    assert asked[0] == ("pre_backward", (3, add_dx, to_pre)) and [type(f) for f in asked[0][1]] == [int, bool, bool]
    assert asked[2] == ("pre_backward", (3, add_dx, to_pre))
    assert site_ops.kernel2_inputs(bool(linked), bool(post_grad)) == (add_dx, to_pre)


@pytest.mark.parametrize("n,expected", [(1, False), (2, False), (3, False), (4, True), (8, False)])
def test_post_gradient_goes_to_the_pre_where_kernel_2_has_two_warpgroups(n, expected):
    """The 42C path on CUDA where kernel 2 splits all n lanes between two consumer warpgroups (n = 4), the 46C
    path elsewhere, with the reference backend and on the CPU."""
    from types import SimpleNamespace

    from mhc_lab.ops.dispatch import post_gradient_to_pre_for

    cuda_lanes = SimpleNamespace(shape=(16, n, 64), device=torch.device("cuda"))  # no GPU needed to decide
    assert post_gradient_to_pre_for(cuda_lanes, "kernels") is expected
    assert post_gradient_to_pre_for(cuda_lanes, "reference") is False
    assert post_gradient_to_pre_for(torch.empty(16, n, 64), "kernels") is False


def test_ops_gradcheck_with_the_post_gradient_to_pre(monkeypatch):
    x, phi, bias, alpha, _ = _site_inputs((2, 3), 4, 5, seed=7)
    weight = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) / 3
    leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha)]
    _post_gradient_to_pre(monkeypatch, True)
    assert torch.autograd.gradcheck(lambda *a: _site("reference", *a, weight, True), leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "kernels"])
@pytest.mark.parametrize("linked", [False, True])
def test_pre_backward_takes_the_links_gradient_only_from_a_linked_site(monkeypatch, backend, linked):
    # the separate site (mhc_pre then mhc_post) leaves pre_forward's link unused: its backward must get None
    # and run the unlinked kernels, not a zero gradient of the lanes' size to add (same gradients, 8C more bytes)
    from mhc_lab.ops import site_ops

    seen = []
    real = site_ops.pre_backward_impl

    def spy(*args):
        seen.append(args[10] is not None)
        return real(*args)

    monkeypatch.setattr(site_ops, "pre_backward_impl", spy)
    x, phi, bias, alpha, _ = _site_inputs((3,), 4, 8, seed=2, dtype=torch.float32)
    leaves = [t.float().requires_grad_() for t in (x, phi, bias, alpha)]
    out = _site(backend, *leaves, torch.eye(8, dtype=torch.float64), linked)
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert seen == [linked]


def _chain_of_sites(backend, dtype, n, C, device="cpu"):
    """Three layers and their MHCConnections (phi drawn away from its identity init), lanes [2, 3, n, C] and an
    upstream gradient, the same in every process."""
    from mhc_lab.ops import MHCConnection

    torch.manual_seed(1)  # the layers' and connections' initial weights
    layers = [_Layer(C).to(device, dtype) for _ in range(3)]
    connections = [MHCConnection(n, C, backend=backend).to(
        device, dtype if backend == "reference" else torch.float32) for _ in layers]
    with torch.no_grad():
        for c in connections:
            c.phi.normal_(0, 0.3)
    x = torch.randn(2, 3, n, C, dtype=dtype, generator=torch.Generator().manual_seed(2)).to(device)
    upstream = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)
    return layers, connections, x, upstream


def _outputs_and_gradients(run, x, connections, upstream):
    """run(lanes) on a fresh leaf copy of x: its output and the gradients of the lanes and every parameter."""
    params = [p for c in connections for p in c.parameters()]
    leaf = x.clone().requires_grad_()
    out = run(leaf)
    return (out.detach(), *torch.autograd.grad(out, [leaf, *params], upstream))


def _one_by_one(connections, layers):
    """The sites one by one (each MHCConnection around its layer, projecting for itself): a function of lanes."""
    def run(h):
        for c, layer in zip(connections, layers):
            h = c(h, layer)
        return h

    return run


def _spy_on_steps(monkeypatch, seen: list) -> None:
    """modules.post_then_pre, each step it chooses recording ("post then pre", backend, next backend, project)
    in seen whenever it runs."""
    from mhc_lab.ops import modules

    real_step_for = modules.post_then_pre

    def step_for(x, *chosen):
        real_step = real_step_for(x, *chosen)

        def step(*args):
            seen.append(("post then pre", *chosen))
            return real_step(*args)

        return step

    monkeypatch.setattr(modules, "post_then_pre", step_for)


def _chained_against_unchained(monkeypatch, backend, dtype, n, C, device="cpu"):
    """run_sites against sites that each project for themselves: the largest relative difference over the
    output and every gradient; asserts that the first pre projected for itself and every post for the next pre."""
    from mhc_lab.ops import modules

    layers, connections, x, upstream = _chain_of_sites(backend, dtype, n, C, device)
    seen = []
    real_pre = modules.run_pre_forward

    def pre(*args, **options):
        seen.append(("pre", len(args) > 5 and args[5] is not None))
        return real_pre(*args, **options)

    want = _outputs_and_gradients(_one_by_one(connections, layers), x, connections, upstream)
    monkeypatch.setattr(modules, "run_pre_forward", pre)
    _spy_on_steps(monkeypatch, seen)
    got = _outputs_and_gradients(lambda h: modules.run_sites(h, connections, layers), x, connections, upstream)
    step = ("post then pre", backend, backend, True)
    assert seen == [("pre", False), step, step]
    return max(_relmax(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("kernels", torch.float32, 1e-5),
                                               ("kernels", torch.bfloat16, 1e-6)])
@pytest.mark.parametrize("n,C", [(4, 8), (2, 5), (1, 3), (3, 4)])
def test_chained_sites_match_unchained_sites(monkeypatch, backend, dtype, tol, n, C):
    """run_sites: each post projects its lanes for the next pre (kernels/post_project.py); same values and
    gradients as sites that each project for themselves; every pre but the first takes its partial_in."""
    assert _chained_against_unchained(monkeypatch, backend, dtype, n, C) < tol


def test_a_chain_of_mixed_backends_hands_each_pre_its_own_backend(monkeypatch):
    """run_sites over connections of different backends: each step from a post to the next pre runs the post on
    its site's backend and the pre on the next site's, unprojected where the two differ; values and gradients as
    the sites one by one."""
    from mhc_lab.ops import modules

    layers, connections, x, upstream = _chain_of_sites("kernels", torch.float32, 2, 8)
    connections[1].backend = "reference"
    steps = []
    want = _outputs_and_gradients(_one_by_one(connections, layers), x, connections, upstream)
    _spy_on_steps(monkeypatch, steps)
    got = _outputs_and_gradients(lambda h: modules.run_sites(h, connections, layers), x, connections, upstream)
    assert steps == [("post then pre", "kernels", "reference", False),
                     ("post then pre", "reference", "kernels", False)]
    assert max(_relmax(a, b) for a, b in zip(got, want)) < 1e-5


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA kernels run only there")
@pytest.mark.parametrize("n,C", [(4, 4096), (4, 136), (2, 40), (8, 16), (1, 1000), (3, 1000)])
def test_cuda_chained_sites_match_unchained_sites(monkeypatch, n, C):
    """The same on CUDA with bf16 lanes: the fused post + projection and the pre's own projection sum in other
    orders, so the coefficients differ by float32 rounding and the lanes by at most about one bf16 rounding."""
    assert _chained_against_unchained(monkeypatch, "kernels", torch.bfloat16, n, C, device="cuda") < 2e-2


def test_chained_partials_have_their_own_split_count():
    """On CUDA a chained post projects into CHAIN_SPLITS partial sums and the pre's own projection pass into
    PROJECTION_SPLITS; the pre takes partial_in with the chained count. Elsewhere both are 1."""
    from types import SimpleNamespace

    from mhc_lab.kernels.pre_split import PROJECTION_SPLITS
    from mhc_lab.ops.dispatch import CHAIN_SPLITS, partial_splits
    from mhc_lab.ops.site_ops import pre_forward

    cuda_lanes = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 64))
    assert partial_splits("kernels", cuda_lanes, chained=True) == CHAIN_SPLITS
    assert partial_splits("kernels", cuda_lanes) == PROJECTION_SPLITS
    cpu = torch.zeros(3, 4, 8)
    assert partial_splits("kernels", cpu, chained=True) == partial_splits("kernels", cpu) == 1
    with pytest.raises(InputError, match=r"partial_in: expected shape \(1, 3, 25\)"):
        pre_forward(cpu, torch.zeros(24, 32), torch.zeros(24), torch.ones(3), "kernels", torch.zeros(4, 3, 25))


def test_chained_sites_on_cuda_need_widths_of_16_byte_rows():
    """On CUDA a post projects for the next pre where C is a multiple of 8 (the fused kernel's 16-byte row
    copies); with the reference backend and on the CPU always."""
    from types import SimpleNamespace

    from mhc_lab.ops.dispatch import fused_projection_applies

    cuda_lanes = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 64))
    odd_width = SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 4, 60))
    assert fused_projection_applies("kernels", cuda_lanes)
    assert not fused_projection_applies("kernels", odd_width)
    assert fused_projection_applies("reference", odd_width)
    assert fused_projection_applies("kernels", torch.zeros(3, 4, 60))


def test_pre_forward_refuses_a_partial_of_the_wrong_shape():
    from mhc_lab.ops.site_ops import pre_forward

    x, phi, bias, alpha, _ = (t.float() for t in _site_inputs((5,), 4, 8))
    with pytest.raises(InputError, match=r"partial_in: expected shape \(1, 5, 25\)"):
        pre_forward(x, phi, bias, alpha, "kernels", torch.zeros(1, 4, 25))


def test_ops_register_the_custom_ops_and_export_the_public_api():
    """Importing mhc_lab.ops registers torch.ops.mhc_lab.*; the public names come from mhc_lab.ops itself."""
    import mhc_lab.ops as ops

    for name in ("pre_forward", "pre_backward", "post_forward", "post_backward", "post_forward_linked"):
        assert hasattr(torch.ops.mhc_lab, name), name
    for name in ("mhc_pre", "mhc_post", "mhc_site", "mhc_site_chained", "run_sites", "MHCConnection",
                 "MHCResidualStream", "resolve_backend", "kernels_apply", "BACKENDS", "PreOutputs",
                 "mhc_post_fused", "mhc_pre_fused"):
        assert name in ops.__all__ and hasattr(ops, name), name


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("kernels", torch.float32)])
@pytest.mark.parametrize("next_phi", [False, True])
def test_linked_post_never_reads_the_values_of_link(backend, dtype, next_phi):
    """link only carries the lanes' gradient from the post back to the pre: pre_forward hands out an unfilled
    view for it, so the linked post's outputs must not depend on its values (NaN or zero, the same results)."""
    from mhc_lab.ops.site_ops import post_forward_linked, pre_forward

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


class _Layer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def _stream(recompute_block, backend="reference", layers=6, n=4, width=16):
    from mhc_lab.ops import MHCResidualStream

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
    from mhc_lab.ops import MHCResidualStream

    class InPlace(torch.nn.Module):
        def forward(self, h):
            y = torch.tanh(h)
            return y.mul_(0.5)

    stream = MHCResidualStream([InPlace(), InPlace()], 2, 8, recompute_block=2)
    with pytest.raises(InputError, match=r"modifies a tensor in place \(aten.mul_"):
        stream(torch.randn(3, 8, requires_grad=True))


def test_ops_keep_float32_coefficients_under_autocast():
    from mhc_lab.ops import mhc_pre as op_pre

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


class _OpsSeen(TorchDispatchMode):
    """A dispatch mode that records the ops it sees and runs them unchanged."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend,dtype,device", [
    ("reference", torch.float64, "cpu"), ("kernels", torch.float32, "cpu"), ("kernels", torch.bfloat16, "cpu"),
    *(pytest.param(backend, dtype, "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: the CUDA kernels run only there"))
      for backend, dtype in (("kernels", torch.bfloat16), ("reference", torch.float64)))])
def test_eager_path_and_custom_ops_give_the_same_bits(backend, dtype, device):
    """Called eagerly the sites run their implementations through autograd.Functions; under a dispatch mode
    (and torch.compile, torch.export) as torch.ops.mhc_lab.* custom ops. Both give the same outputs and
    gradients, bit for bit, on a chain of three linked sites and a separate site, and the mode sees every op of
    the site, forward and backward, as one op. (On CUDA the ops' kernels are native.cpp's, which hand the
    reference backend to site_ops' implementations.)"""
    from mhc_lab.ops import mhc_post as op_post, mhc_pre as op_pre
    from mhc_lab.ops.site_ops import as_ops

    def run():
        torch.manual_seed(0)
        stream = _stream(None, backend, layers=3).to(device)
        stream.to(torch.float64) if dtype == torch.float64 else stream.layers.to(dtype)  # phi stays float32
        h = torch.randn(2, 5, 16, dtype=dtype, device=device, requires_grad=True)
        out = stream(h)
        x, phi, bias, alpha, f = _site_inputs((3,), 4, 16, seed=4)
        leaves = [x.to(device, dtype).requires_grad_()] + [
            t.to(device, stream.connections[0].phi.dtype).requires_grad_() for t in (phi, bias, alpha)]
        y, post, res = op_pre(*leaves, backend=backend)
        separate = op_post(leaves[0], torch.tanh(y), post, res, backend=backend)
        (out.square().sum() + separate.square().sum()).backward()
        return [out, separate, h.grad, *(p.grad for p in stream.parameters()), *(t.grad for t in leaves)]

    assert not as_ops()
    eager = run()
    seen = _OpsSeen()
    with seen:
        assert as_ops()
        traced = run()
    names = {str(op) for op in seen.ops if getattr(op, "namespace", None) == "mhc_lab"}
    assert names == {f"mhc_lab.{op}.default" for op in ("pre_forward", "post_forward_linked", "post_forward",
                                                        "pre_backward", "post_backward")}, names
    for a, b in zip(eager, traced, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_compiled_stream_traces_once_for_every_step(monkeypatch, backend):
    """torch.compile takes a training loop's stream whole: one graph (no break at the sites' ops), and the
    steps after the first run it without compiling again, also where the process has not run a site before (the
    backend each site runs is decided in the first trace). The kernels backend's sites are the mhc_lab custom
    ops in that graph; the reference backend's are its PyTorch math, traced (no op of ours, no value check)."""
    from torch._dynamo.utils import counters

    from mhc_lab.ops import dispatch

    monkeypatch.setattr(dispatch, "_RESOLVED", {})  # as in a fresh process
    stream = _stream(None, backend, layers=3)
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    run = torch.compile(stream, backend=record)
    for step in range(3):
        stream.zero_grad(set_to_none=True)
        h = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        run(h).square().sum().backward()
        assert h.grad is not None and all(p.grad is not None for p in stream.parameters())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"] and not counters["recompiles"], (dict(counters["graph_break"]),
                                                                       dict(counters["recompiles"]))
    ours = {str(node.target) for gm in graphs for node in gm.graph.nodes
            if getattr(node.target, "namespace", None) == "mhc_lab"}
    if backend == "kernels":
        assert ours == {"mhc_lab.pre_forward.default", "mhc_lab.post_forward_linked.default"}, ours
    else:
        assert not ours and any("sigmoid" in str(node.target) for gm in graphs for node in gm.graph.nodes), ours


def test_ops_refuse_bad_input_clearly():
    from mhc_lab.ops import MHCConnection, MHCResidualStream, mhc_post as op_post, mhc_pre as op_pre

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


def test_ops_name_transposed_lanes():
    """Lanes passed as [..., C, n] to the ops: the error names x (phi's n^2+2n rows say n), not phi."""
    from mhc_lab.ops import MHCConnection, mhc_pre as op_pre, mhc_site as op_site, run_sites

    x, phi, bias, alpha, _ = _site_inputs((3,), 4, 8)
    swapped = x.transpose(-2, -1)
    message = (r"^mhc_pre: x: expected lanes \[\.\.\., n, C\] with n = 4 \(phi has n\^2\+2n = 24 rows\); "
               r"got \[\.\.\., C, n\]\? x has shape \(3, 8, 4\)")
    for backend in ("auto", "reference", "kernels"):
        with pytest.raises(InputError, match=message):
            op_pre(swapped, phi, bias, alpha, backend=backend)
    with pytest.raises(InputError, match=r"^mhc_site: x: expected lanes \[\.\.\., n, C\] with n = 4"):
        op_site(swapped.float(), phi.float(), bias.float(), alpha.float(), torch.tanh, backend="kernels")
    with pytest.raises(InputError, match=r"x: expected lanes \[\.\.\., n, C\] with n = 2 \(phi has n\^2\+2n = 8 rows\)"):
        x2, phi2, bias2, alpha2, _ = _site_inputs((5,), 2, 33)
        op_pre(x2.transpose(-2, -1), phi2, bias2, alpha2)
    with pytest.raises(InputError, match=r"^phi: |^mhc_pre: phi: expected shape \(24, 32\)"):
        op_pre(x, phi[:, :8], bias, alpha)  # phi wrong in both layouts: still phi's error
    with pytest.raises(InputError, match=r"expected n = 4 lanes in dim -2 .*lanes \[\.\.\., C, n\]\?"):
        MHCConnection(4, 8)(swapped.float(), torch.tanh)
    with pytest.raises(InputError, match=r"expected n = 4 lanes in dim -2 .*lanes \[\.\.\., C, n\]\?"):
        run_sites(swapped.float(), [MHCConnection(4, 8)], [torch.tanh])
    y, _, _ = op_pre(x, phi, bias, alpha)  # the right layout still runs
    assert y.shape == (3, 8)


# ------------------------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA backward kernels run only there")


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129)])
def test_cuda_spread_coefficient_kernels_match_the_fused_one(n, C, tokens):
    """Kernel 1 as the ops run it where n is a power of two (dpre_program, then a token over n R threads) against
    the fused kernel 1 (one kernel, a thread per token, as other n run it): the same math, dH_pre and the spread
    lines summed in another order, each group of the gradients (pre, post, res) on its own scale; and the
    spread kernels' bias and alpha gradients against the float64 truth of the same bf16 inputs."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_coefficients import coefficients_kernel, fused_coefficients_program
    from mhc_lab.kernels.pre_backward_operands import coef_width, gemm_depth

    x, phi, bias, alpha, _ = _site_inputs((tokens,), n, C, seed=tokens, device="cuda")
    x = x.to(torch.bfloat16)
    dy, dpost, dres, _ = _upstream((tokens,), n, C, seed=5, device="cuda")
    dy = dy.to(torch.bfloat16)
    m = n * n + 2 * n
    flat = x.double().reshape(tokens, n * C)
    partial = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], -1).float()[None].repeat(4, 1, 1) / 4
    pre = mhc_coefficients(x.double(), phi, bias, alpha).pre.float().contiguous()
    kernels = {"fused": compile_program(fused_coefficients_program(n, C, "bfloat16", "cuda", splits=4), "cuda"),
               "spread": coefficients_kernel(n, C, "bfloat16", "cuda", splits=4)}
    outs = {}
    for name, coefficients in kernels.items():
        f32 = dict(dtype=torch.float32, device="cuda")
        dpre, dtok, dmix = (torch.full((tokens, k), float("nan"), **f32) for k in (n, m + 4, m))
        dsplit = torch.full((tokens, 3, 2 * gemm_depth(n)), float("nan"), dtype=torch.bfloat16, device="cuda")
        coef = torch.full((tokens, coef_width(n)), float("nan"), **f32)
        coefficients(x, dy, partial, bias.float(), alpha.float(), dpost.float(), dres.float(), pre, dpre, dtok, dmix,
                     dsplit, coef)
        outs[name] = [dpre, dtok[:, :m], dmix, dtok[:, m:], dsplit, coef]  # dtok: dlogit, then extra
    groups = {"pre": slice(0, n), "post": slice(n, 2 * n), "res": slice(2 * n, m)}
    if n == 1:  # one lane's 1 x 1 Sinkhorn is constant: its gradient is zero up to rounding
        del groups["res"]
    for what, a, b in zip(("dpre", "dlogit", "dmix", "extra", "dsplit", "coef"), outs["spread"], outs["fused"]):
        if what in ("dlogit", "dmix"):
            for group, cols in groups.items():
                assert _relmax(a[:, cols], b[:, cols]) < 1e-4, (what, group)
        else:
            assert _relmax(a, b) < (1e-2 if what == "dsplit" else 1e-4), what
    want = pre_backward(*(t.double() for t in (x, phi, bias, alpha, dy, dpost, dres)))
    for group, cols in groups.items():
        assert _relmax(outs["spread"][1][:, cols].double().sum(0), want.bias[cols]) < 1e-4, group
    assert _relmax(outs["spread"][3][:, :3].double().sum(0), want.alpha) < 1e-4


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


CUDA_SITE_CASES = [(4, 4096, 300), (4, 136, 1), (2, 40, 33), (8, 8, 65), (1, 1000, 129), (3, 1000, 129)]


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", CUDA_SITE_CASES)
def test_cuda_backward_matches_reference_and_repeats_bitwise(n, C, tokens):
    """Separate and linked sites as the ops run them (kernel 1 spread or fused by n; at n = 4 the linked site
    hands g to kernel 2, elsewhere the post's dx)."""
    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)
    runs = [_cuda_site_grads(x, phi, bias, alpha, weight, g, linked) for linked in (False, True, True)]
    for site, got in (("separate", runs[0]), ("linked", runs[1])):
        _assert_site_grads_close(got, want, site)
    _assert_site_grads_repeat(runs[1], runs[2])


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", CUDA_SITE_CASES)
def test_cuda_linked_site_on_its_other_path_matches_float64(monkeypatch, n, C, tokens):
    """The linked site on the path its n does not take by default: at n = 4 the post's dx added by kernel 2,
    elsewhere the post's backward without dx and kernel 2 adding H_res^T g from g itself. bf16 tolerance of
    float64, deterministic."""
    from mhc_lab.ops.dispatch import post_gradient_to_pre_for

    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)
    other = not post_gradient_to_pre_for(x, "kernels")
    _post_gradient_to_pre(monkeypatch, other)
    runs = [_cuda_site_grads(x, phi, bias, alpha, weight, g, True) for _ in range(2)]
    _assert_site_grads_close(runs[0], want, "linked, g to the pre" if other else "linked, the post's dx")
    _assert_site_grads_repeat(*runs)


def _lane_operands(tokens, n, C, seed):
    """Random operands of kernel 2 on CUDA as kernel 1 lays them out (dmix split into bf16 hi and lo), and the
    float64 dmix they stand for."""
    from mhc_lab.kernels.pre_backward_operands import coef_width, gemm_depth

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
@pytest.mark.parametrize("extra", ["none", "add_dx", "post_grad"])
@pytest.mark.parametrize("n,C,tokens", CUDA_SITE_CASES)
def test_cuda_lane_kernel_matches_float64(n, C, tokens, extra):
    """Kernel 2 alone against float64 sums of the operands it is given: dx = dmix phi_j + H_pre[j] dy + 2 ds x_j
    (+ dx_post, or + sum_i H_res[i, j] g_i), dphi = dmix^T x; outputs poisoned first."""
    from mhc_lab.kernels.pre_backward import pre_backward_kernels
    from mhc_lab.kernels.pre_backward_lanes import dphi_from_partial
    from mhc_lab.kernels.pre_backward_operands import gemm_depth

    x, phi, _, _, _ = _site_inputs((tokens,), n, C, seed=tokens + 7, device="cuda")
    x = x.to(torch.bfloat16)
    dy, _, _, g = _upstream((tokens,), n, C, seed=11, device="cuda")
    dy, g = dy.to(torch.bfloat16), g.to(torch.bfloat16)
    res = torch.rand(tokens, n, n, device="cuda")
    dsplit, coef, dmix = _lane_operands(tokens, n, C, seed=tokens)
    phi32 = phi.float()
    want = _kernel2_dx_truth(x, dy, coef, dmix, phi32)
    want = want + {"none": 0, "add_dx": g.double(),
                   "post_grad": torch.einsum("tij,tic->tjc", res.double(), g.double())}[extra]
    more = {"none": [], "add_dx": [g], "post_grad": [g, res]}[extra]
    _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=4, add_dx=extra == "add_dx",
                                    post_grad=extra == "post_grad", lane_splits=2)
    dx = torch.full_like(x, float("nan"))
    partial = torch.full((2, 2 * gemm_depth(n), n * C), float("nan"), device="cuda")
    lanes(x, dy, dsplit, coef, phi32, *more, dx, partial)
    assert _relmax(dx, want) < 1e-2
    assert _relmax(dphi_from_partial(partial, n), dmix.cuda().t() @ x.double().reshape(tokens, n * C)) < 1e-4


@needs_cuda
@pytest.mark.parametrize("n,C,tokens,splits", [(1, 1000, 1, 1), (2, 40, 4097, 3), (4, 300, 16385, 2),
                                               (4, 64, 5000, 1), (8, 8, 1023, 5)])
def test_cuda_parameter_sums_kernel_matches_float64_and_repeats_bitwise(n, C, tokens, splits):
    """The pre backward's sums kernel: dphi over kernel 2's splits and both dmix halves (the padding rows between
    them poisoned with NaN, never read), dtok over the tokens (counts not a multiple of its 1024 x 4 rows per
    round, one token, dphi entries not a multiple of its 1024 per CTA); twice, the same bits."""
    from mhc_lab.kernels.pre_backward_operands import EXTRA, gemm_depth
    from mhc_lab.kernels.pre_backward_sums import pre_backward_sums_kernel
    from mhc_lab.reference.mhc import mixes_width

    M, KH = mixes_width(n), gemm_depth(n)
    gen = torch.Generator().manual_seed(tokens)
    partial = torch.full((splits, 2 * KH, n * C), float("nan"))
    partial[:, :M] = torch.randn(splits, M, n * C, generator=gen)
    partial[:, KH:KH + M] = torch.randn(splits, M, n * C, generator=gen) * 1e-3
    dtok = torch.randn(tokens, M + EXTRA, generator=gen) + 0.5
    want_dphi = partial[:, :M].double().sum(0) + partial[:, KH:KH + M].double().sum(0)
    kernel = pre_backward_sums_kernel(n, C, splits, "cuda")
    runs = []
    for _ in range(2):
        dphi = torch.full((M, n * C), float("nan"), device="cuda")
        dtok_sum = torch.full((M + EXTRA,), float("nan"), device="cuda")
        kernel(partial.cuda(), dtok.cuda(), dphi, dtok_sum)
        runs.append((dphi, dtok_sum))
    assert _relmax(runs[0][0], want_dphi.cuda()) < 1e-6
    assert _relmax(runs[0][1], dtok.double().sum(0).cuda()) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ----------------------------------------------------------------- the course and the benchmarks' commands


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_lab07_pass_table_is_the_bytes_model(n):
    """Lab 07's named passes of a site move what the library's byte model ("mhc_minimal") says, per direction."""
    from mhc_lab.measure import bytes_model
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
    from mhc_lab.bench.warm import commands

    lines = commands((2560, 4096))
    assert {line[0] for line in lines} == {"training", "forward"} and len(lines) == 4
    for line in lines:
        assert importlib.import_module(SUITES[line[0]]).main(line[1:]) == 1, line


def test_warm_runs_each_selected_test_in_a_process_of_its_own():
    """bench warm --tests: one pytest command line per selected test (here the CUDA tests of the fused post +
    projection, collected whether or not this machine would skip them)."""
    from mhc_lab.bench.warm import selected_test_commands

    lines = selected_test_commands("cuda_post_project")
    ids = [line[-1] for line in lines]
    assert len(ids) == len(set(ids)) >= 6
    assert all(i.startswith("tests/test_kernels_forward.py::test_cuda_post_project_") for i in ids)
    assert any(i.startswith("tests/test_kernels_forward.py::test_cuda_post_project_matches_float64[") for i in ids)
    assert all(line[:2] == ["-m", "pytest"] and "addopts=" in line for line in lines)


def test_warm_reports_the_end_of_a_failed_log(tmp_path):
    """A failed process's reason comes back in bench warm's own output: the last lines of its log."""
    from mhc_lab.bench.warm import failure_report

    log = tmp_path / "07-test.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)) + "\nE   AssertionError: ('linked', 'x', 0.5)\n")
    report = failure_report(str(log), lines=3).splitlines()
    assert report == ["    | line 98", "    | line 99", "    | E   AssertionError: ('linked', 'x', 0.5)"]
    (tmp_path / "empty.log").write_text("")
    assert failure_report(str(tmp_path / "empty.log")) == "    | (empty log)"


@pytest.mark.parametrize("flag", ["--graph-rounds", "--block-rounds"])
def test_training_benchmark_refuses_fewer_than_one_round(capsys, flag):
    from mhc_lab.bench.training import main

    with pytest.raises(SystemExit):
        main(["--parts", "site", flag, "0"])
    assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


@needs_cuda
def test_cuda_eager_site_runs_the_native_ops_and_autograd():
    """Called eagerly, a CUDA site's ops and their backward are native.cpp's (C++ autograd nodes in the graph, no
    Python autograd.Function of site_ops), on a chained pair of sites (a Pre, the Joint of the first post and the
    second pre, a Post) and a separate pre and post."""
    from mhc_lab.ops import MHCConnection, mhc_post as op_post, mhc_pre as op_pre, run_sites

    torch.manual_seed(0)
    connections = [MHCConnection(4, 64, backend="kernels").cuda() for _ in range(2)]
    h = torch.randn(5, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = run_sites(h, connections, [torch.tanh, torch.tanh])
    y, post, res = op_pre(out, connections[0].phi, connections[0].bias, connections[0].alpha, backend="kernels")
    last = op_post(out, y, post, res, backend="kernels")
    names, stack, seen = [], [last.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    native = sorted(name.rstrip(">").rsplit("::", 1)[1] for name in names if "mhc_native::" in name)
    assert native == ["Joint", "Post", "Post", "Pre", "Pre"] and not any("_Eager" in name for name in names), names
    last.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for c in connections for p in c.parameters())


@needs_cuda
def test_cuda_compiled_stream_runs_the_registered_cuda_kernels(monkeypatch):
    """Under torch.compile the CUDA sites are torch.ops.mhc_lab.* whose CUDA kernels native.cpp registered: no
    call reaches site_ops' Python implementations (whose CUDA branch only loads native.cpp), one graph without
    breaks, and the outputs and gradients of three linked sites those of the eager C++ path (the same site kernels;
    Inductor's layers round alike only to bf16)."""
    from torch._dynamo.utils import counters

    from mhc_lab.ops import native, site_ops

    native.extension()
    monkeypatch.setattr(site_ops, "_first_native_call", lambda op, *args: pytest.fail(f"{op} reached Python"))
    runs = {}
    for compiled in (True, False):  # compiled first: its first trace finds the caches a fresh process has
        stream = _stream(None, "kernels", layers=3).cuda()
        stream.layers.to(torch.bfloat16)
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(stream, fullgraph=True) if compiled else stream
        for _ in range(2 if compiled else 1):  # a second compiled step compiles nothing again
            stream.zero_grad(set_to_none=True)
            h = torch.randn(2, 5, 16, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(1)).requires_grad_()
            out = run(h)
            out.float().square().sum().backward()
        if compiled:
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
            assert not counters["recompiles"], dict(counters["recompiles"])
        runs[compiled] = [out, h.grad, *(p.grad for p in stream.parameters())]
    for a, b in zip(runs[False], runs[True], strict=True):
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-2


@needs_cuda
@pytest.mark.parametrize("n,C", [(4, 136), (2, 40), (8, 16), (1, 1000), (2, 36)])
def test_cuda_native_chain_keeps_the_lanes_leading_dims(n, C):
    """Three chained sites on lanes [2, 37, n, C] through the kernels: native.cpp's ops take and give the lanes'
    leading dims (no view, reshape or expand in the graph: only the C++ nodes, a pre, joints and a post, and the
    layers') and match the same chain with the reference backend in float64, output and every gradient (at
    C = 36 the posts do not project for the next pre: rows of 72 bytes). The
    tolerance is bf16's: 2e-2 relative in norm, or twice the error of the reference backend's own chain in bf16
    where that is larger (a parameter's gradient sums 74 tokens' terms that largely cancel: at n = 1 the bf16
    reference misses the pre bias's by 9%)."""
    from mhc_lab.ops import MHCConnection, run_sites

    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, 37, n, C, generator=gen)
    weights = [torch.rand(C, generator=gen) + 0.5 for _ in range(3)]
    g = torch.randn(2, 37, n, C, generator=gen)
    runs, names = {}, set()
    for backend, dtype in (("kernels", torch.bfloat16), ("reference", torch.float64), ("reference", torch.bfloat16)):
        connections = [MHCConnection(n, C, backend=backend).to("cuda", dtype) for _ in weights]
        with torch.no_grad():
            for i, c in enumerate(connections):
                c.phi.copy_(torch.randn(c.phi.shape, generator=torch.Generator().manual_seed(7 + i)) / (n * C) ** 0.5)
        layers = [lambda y, w=w.to("cuda", dtype): torch.tanh(y * w) for w in weights]
        leaf = x.to("cuda", torch.bfloat16).to(dtype).requires_grad_()
        out = run_sites(leaf, connections, layers)
        if backend == "kernels":
            stack, seen = [out.grad_fn], set()
            while stack:
                node = stack.pop()
                if node is not None and node not in seen:
                    seen.add(node)
                    names.add(node.name())
                    stack.extend(next_node for next_node, _ in node.next_functions)
        params = [p for c in connections for p in c.parameters()]
        runs[backend, dtype] = (out, *torch.autograd.grad(out, [leaf, *params], g.to("cuda", dtype)))
    assert names == {"torch::autograd::CppNode<mhc_native::Pre>", "torch::autograd::CppNode<mhc_native::Joint>",
                     "torch::autograd::CppNode<mhc_native::Post>", "TanhBackward0", "MulBackward0",
                     "torch::autograd::AccumulateGrad"}, names
    truth, bf16 = runs["reference", torch.float64], runs["reference", torch.bfloat16]
    for i, (got, want, yardstick) in enumerate(zip(runs["kernels", torch.bfloat16], truth, bf16)):
        assert got.shape == want.shape, i
        error, noise = (float((a.double() - want).norm() / want.norm()) for a in (got, yardstick))
        assert error < max(2e-2, 2 * noise), (i, error, noise)


def test_native_ops_refuse_lanes_off_the_gpu():
    """The C++ ops build on a machine without a GPU too, and refuse lanes that are not bfloat16 CUDA tensors by
    name."""
    from mhc_lab.ops import native

    ext = native.extension()
    plan = ext.Plan()
    plan.n, plan.C = 4, 8
    x, phi, bias, alpha, f = _site_inputs((3,), 4, 8)
    with pytest.raises(RuntimeError, match=r"pre_forward: x: expected bfloat16 lanes \[\.\.\., n, C\]"):
        ext.pre_forward(plan, x.float(), phi, bias, alpha, None)
    with pytest.raises(RuntimeError, match=r"post_forward: x: expected bfloat16 lanes"):
        ext.post_forward(plan, x.bfloat16(), f.bfloat16(), torch.ones(3, 4), torch.ones(3, 4, 4), None)


def test_a_chains_native_step_hands_the_joint_its_arguments_in_order(monkeypatch):
    """site_ops.post_then_pre's native step calls native.cpp's joint with the four plans, project and the eight
    tensors as its binding takes them: on CPU lanes it gets through the binding to the post's refusal by name."""
    from mhc_lab.ops import native, site_ops

    plan = native.extension().Plan()
    plan.n, plan.C = 4, 8
    monkeypatch.setattr(site_ops, "_native", lambda x, backend: True)
    monkeypatch.setattr(site_ops, "_plan", lambda x, op, *flags: (plan, plan))
    x, phi, bias, alpha, f = _site_inputs((3,), 4, 8)
    x, f = x.bfloat16(), f.bfloat16()
    step = site_ops.post_then_pre(x, "kernels", "kernels", True)
    with pytest.raises(RuntimeError, match=r"post_forward: x: expected bfloat16 lanes \[\.\.\., n, C\] on a CUDA"):
        step(x, x, f, torch.ones(3, 4), torch.ones(3, 4, 4), phi, bias, alpha)


class _LanesOnAGpu:
    """Stands for bf16 lanes [T, n, C] on GPU 0 where the plans ask only for their shape and device (without a
    GPU, dispatch takes the default build's facts, sm_90)."""

    def __init__(self, *shape):
        self.shape, self.device, self.dtype = shape, torch.device("cuda", 0), torch.bfloat16


@needs_nvcc
def test_native_plans_hold_the_kernels_each_site_op_launches(monkeypatch):
    """Which compiled kernels each C++ op launches, chosen per configuration for a Hopper GPU (built here with
    nvcc, no GPU needed): the pre's projection only where the previous post did not project, kernel 2 for the
    pre's link, the fused post + projection for a chain, the post's backward without dx where the pre's kernel 2
    forms H_res^T g."""
    from mhc_lab.kernels.pre_split import PROJECTION_SPLITS
    from mhc_lab.ops import site_ops
    from mhc_lab.ops.dispatch import CHAIN_SPLITS

    monkeypatch.setattr(site_ops, "_PLANS", {})
    monkeypatch.setattr(site_ops, "lane_splits", lambda n, C, device, add_dx, post_grad: 3)
    x = _LanesOnAGpu(8, 4, 64)
    forward, backward = site_ops._plan(x, "pre", False, True, True)
    assert forward.splits == PROJECTION_SPLITS and all(getattr(forward, k) for k in ("phi_split", "project",
                                                                                      "coefficients", "mix"))
    assert (backward.add_dx, backward.post_grad, backward.lane_splits, backward.splits) == (False, True, 3,
                                                                                             PROJECTION_SPLITS)
    assert backward.k1_reduce and backward.k1_tokens and not backward.k1_fused and backward.k2  # n = 4: spread
    chained, alone = site_ops._plan(x, "pre", True, False, False)
    assert chained.splits == CHAIN_SPLITS and not chained.phi_split and not chained.project and chained.mix
    assert (alone.add_dx, alone.post_grad, alone.splits) == (False, False, CHAIN_SPLITS) and alone.k2 != backward.k2
    post, post_backward = site_ops._plan(x, "post", True, True, True)
    assert post.post_project and post.phi_split and not post.post and post.splits == CHAIN_SPLITS
    assert post_backward.post_backward and not post_backward.lanes_grad
    post, post_backward = site_ops._plan(x, "post", False, False, False)
    assert post.post and not post.post_project and post_backward.lanes_grad
    assert site_ops._plan(x, "post", False, False, False)[0] is post  # read back, not chosen again
    assert site_ops._plan(_LanesOnAGpu(2, 8, 4, 64), "post", False, False, False)[0] is post  # any leading dims
    x3 = _LanesOnAGpu(8, 3, 64)
    fused = site_ops._plan(x3, "pre_backward", PROJECTION_SPLITS, True, False)
    assert fused.k1_fused and not fused.k1_reduce and fused.add_dx and not fused.post_grad
