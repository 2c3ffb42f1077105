# Kernel 2 of the pre backward: the gradients of one mHC site's lanes and of phi.
#
#   dx[t, j, c] = H_pre[j] dy[c] + sum_q dmix[q] phi[q, jC + c] + 2 ds x[t, j, c]
#                 (+ in a linked site the post's gradient of the same lanes: dx_post as it is, or H_res^T g from
#                 the post's output gradient g, so the two are summed here and not by autograd in another pass)
#   dphi[q, k]  = sum_t dmix[t, q] x_flat[t, k]     (per token split, summed afterwards in a fixed order)
#
# Bytes per token (bf16, n = 4): reads x and dy (5C; + 4C of dx_post or g in a linked site), writes dx (4C).
# phi is read from L2 once per CTA, each dphi partial written once per split. FLOPs: 2 (n^2 + 2n) nC twice
# (dmix phi and dmix^T x) on tensor cores, dmix and phi split into bf16 hi + lo (pre_backward_operands.py).
#
# Hopper (sm_90): a CTA owns a block of columns of up to four lanes (lane_tiling) for a range of token tiles. phi's
# columns are split into bf16 hi/lo once per CTA. Every operand of the token loop arrives by TMA copies, so the loop
# is pipelined by a producer warpgroup. One or two consumer warpgroups (two where a CTA holds four lanes: each takes
# two, so two warps per scheduler hide each other's latencies) run per token tile and lane two dx products and one
# dphi product; each lane's dx products are issued before the previous lane's epilogue, so the tensor cores work
# while the CUDA cores finish the other lane. dx leaves through shared memory by one TMA store per tile (whole rows:
# the L2 took the register stores as half-sector writes); the tiles only the epilogue reads get the GEMM tiles'
# swizzle, which leaves their reads free of bank conflicts. The dphi accumulators stay in registers until the end.
# With g (post_grad, all n lanes per CTA) each warpgroup writes every term of dx but the products into its lanes'
# accumulators before issuing them, so after each wait the epilogue only converts and stores.
#
# Portable (every other architecture from sm_80 on; _portable_body): the same operand tiles and products, copied
# by T.copy (cp.async on sm_80 to sm_89) and multiplied by synchronous T.gemm (mma.sync there), lane after lane
# through one dx accumulator, dx stored from registers, within the 99 KB of shared memory the smallest of those
# GPUs gives a block. Its token loop is pipelined in chunks of a static trip count: TileLang's cp.async pipeline
# of a loop whose trip count is only known at run time emits a wait it cannot compile.
"""pre backward, kernel 2: the lanes' and phi's gradients (CUDA tensor cores or TileLang's C target)."""


import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import (
    PORTABLE_SMEM_LIMIT,
    SMEM_LIMIT,
    check_lanes_and_width,
    check_target_dtype,
    is_hopper,
)
from mhc_lab.kernels.pre_backward_operands import EXTRA, coef_width, gemm_depth

BLOCK_TOKENS = 64  # tokens per tile of kernel 2's token loop on CUDA (the warpgroup MMA's M)
PORTABLE_CHUNK = 4  # token tiles per pipelined loop of the portable program
THREADS = 128  # threads per consumer warpgroup


def _check(name: str, n: int, C: int, dtype: str, target: str) -> str:
    check_lanes_and_width(name, n, C, max_lanes=8)
    return check_target_dtype(name, dtype, target, ("bfloat16",))


def _present(*buffers) -> list:
    """The buffers given, lists of buffers flattened, Nones left out (a macro's conditional operands)."""
    out = []
    for b in buffers:
        out += [c for c in b if c is not None] if isinstance(b, list) else [] if b is None else [b]
    return out


def _lane_dx_c(x, dy, pre, dmix, dtok, phi, tok, j, col, M: int, C: int):
    """dx of lane j at one token and column, float32 (C target): the projection's term
    sum_q dmix[q] phi[q, jC + col], H_pre[j] dy and the norm's 2 ds x; without the post's gradient."""
    return sum([dmix[tok, q] * phi[q, j * C + col] for q in range(M)],
               pre[tok, j] * T.cast(dy[tok, col], "float32")
               + T.float32(2) * dtok[tok, M + 3] * T.cast(x[tok, j, col], "float32"))


def pre_backward_lanes_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                               add_dx: bool = False, post_grad: bool = False, splits: int = 1,
                               hopper: bool | None = None):
    """Kernel 2. Arguments, C target: x [T, n, C], dy [T, C], pre [T, n] f32, dmix [T, n^2+2n] f32,
    dtok [T, n^2+2n+4] f32 (its last column ds), phi [n^2+2n, nC] f32; CUDA: x, dy, dsplit and coef (kernel 1's
    CUDA outputs), phi.
    Then (add_dx) dx_post [T, n, C], the linked post's gradient of the lanes, added to dx in the same pass, or
    (post_grad) the linked post's output gradient g [T, n, C] and its res [T, n, n] f32, of which H_res^T g is
    added (so the post's backward need not write dx; each CTA then holds all n lanes, since each lane's dx takes
    every lane of g); then the outputs dx [T, n, C] and dphi_partial: [1, n^2+2n, nC] f32 on the C target
    (dphi itself), on CUDA [splits, 2 gemm_depth(n), nC] (pre_backward_sums sums it). ``splits``: the CUDA
    grid's token splits (lane_splits_for).

    CUDA, two programs of the same arithmetic and arguments; ``hopper`` picks one (by default the Hopper program
    on sm_90, the portable one on every other architecture, is_hopper):
    - Hopper: the lanes, columns and consumer warpgroups of lane_tiling, the deepest pipeline that fits shared
      memory (lane_stages), dx through shared memory and TMA stores where C is a multiple of 8 (TMA's rows start
      on 16 bytes), else stored from registers. With dx_post each warpgroup reads the tile's dy once into
      float32 registers for all its lanes.
    - portable (sm_80 and later, and sm_90 when asked for): the same tiles of operands, copied by T.copy
      (cp.async before Hopper), the products by synchronous T.gemm (mma.sync before Hopper), one lane after
      another into one dx accumulator, dx stored from registers; the lanes, columns and stages of
      portable_lane_tiling, within the shared memory every GPU from sm_80 on gives a block."""
    t = _check("pre backward (lanes)", n, C, dtype, target)
    if add_dx and post_grad:
        raise ValueError("pre backward (lanes): add_dx (the post's dx) and post_grad (the post's g, whose H_res^T g "
                         "this kernel computes) are two ways to the same term; got both")
    M = mixes_width(n)
    K = n * C
    NT = T.dynamic("T")
    S = splits
    lanes = list(range(n))

    if t == "c":
        BCc = 8

        @T.macro
        def body(x, dy, pre, dmix, dtok, phi, dx_post, g, res, dx, dphi_partial):
            with T.Kernel(T.ceildiv(C, BCc)) as bc:
                acc = T.alloc_local((1,), "float32")
                for cc in T.serial(BCc):
                    col = bc * BCc + cc
                    if col < C:
                        for j in T.serial(n):
                            for tok in T.serial(NT):
                                v = _lane_dx_c(x, dy, pre, dmix, dtok, phi, tok, j, col, M, C)
                                if dx_post is not None:
                                    v = v + T.cast(dx_post[tok, j, col], "float32")
                                if g is not None:
                                    v = v + sum([res[tok, i, j] * T.cast(g[tok, i, col], "float32") for i in lanes])
                                dx[tok, j, col] = T.cast(v, dtype)
                            for q in T.serial(M):
                                acc[0] = T.float32(0)
                                for tok in T.serial(NT):
                                    acc[0] += dmix[tok, q] * T.cast(x[tok, j, col], "float32")
                                dphi_partial[0, q, j * C + col] = acc[0]

        if add_dx:

            @T.prim_func
            def lanes_backward_c_add(
                x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
                dmix: T.Tensor((NT, M), "float32"), dtok: T.Tensor((NT, M + EXTRA), "float32"),
                phi: T.Tensor((M, K), "float32"), dx_post: T.Tensor((NT, n, C), dtype),
                dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
            ):
                body(x, dy, pre, dmix, dtok, phi, dx_post, None, None, dx, dphi_partial)

            return lanes_backward_c_add

        if post_grad:

            @T.prim_func
            def lanes_backward_c_post_grad(
                x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
                dmix: T.Tensor((NT, M), "float32"), dtok: T.Tensor((NT, M + EXTRA), "float32"),
                phi: T.Tensor((M, K), "float32"), g: T.Tensor((NT, n, C), dtype), res: T.Tensor((NT, n, n), "float32"),
                dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
            ):
                body(x, dy, pre, dmix, dtok, phi, None, g, res, dx, dphi_partial)

            return lanes_backward_c_post_grad

        @T.prim_func
        def lanes_backward_c(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
            dmix: T.Tensor((NT, M), "float32"), dtok: T.Tensor((NT, M + EXTRA), "float32"),
            phi: T.Tensor((M, K), "float32"),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
        ):
            body(x, dy, pre, dmix, dtok, phi, None, None, None, dx, dphi_partial)

        return lanes_backward_c

    if not (is_hopper(t) if hopper is None else hopper):
        return _cuda_entry(_portable_body(n, C, dtype, add_dx, post_grad, NT, S), n, C, dtype, NT, S, add_dx,
                           post_grad)
    stage_dx = C % 8 == 0  # dx by TMA stores, whose rows must start on 16 bytes
    dy_once = add_dx  # with dx_post: dy read once per warpgroup for all its lanes
    into_acc = post_grad  # with g: every term of dx but the products written into the accumulators first
    KH = gemm_depth(n)
    K2 = 2 * KH
    BT = BLOCK_TOKENS
    threads = THREADS
    LG, BC, CG = lane_tiling(n, add_dx, post_grad)
    group = list(range(LG))
    # each consumer warpgroup's lanes (all of them in one group)
    group_lanes = [group[k * (LG // CG) : (k + 1) * (LG // CG)] for k in range(CG)]
    stages = lane_stages(n, LG, BC, add_dx, post_grad, stage_dx)
    CP = coef_width(n)
    smem = lanes_shared_bytes(n, LG, BC, stages, add_dx, post_grad, stage_dx)
    if smem > SMEM_LIMIT:
        raise ValueError(f"pre backward (lanes): {LG} lanes x {BC} columns x {BT} tokens in {stages} stages "
                         f"{'with dx_post ' if add_dx else 'with g ' if post_grad else ''}need {smem} bytes of "
                         f"shared memory, more than the {SMEM_LIMIT} a CTA may use")

    ASYNC = {"wg_wait": -1}  # issue the GEMM without waiting for it (T.wait_wgmma waits)
    split_phi, copy_tile = _tile_macros(n, C, dtype, LG, BC)

    @T.macro
    def dx_gemms(a_dx, a_l0, phi_j, acc, annotations, onto_acc=False):
        # hi (phi_hi + phi_lo), then lo phi_hi over the KH rows of K that are not zero; onto_acc: added to what
        # acc holds
        if onto_acc:
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, annotations=annotations)
        elif CG > 1:  # the first product overwrites the accumulator (wgmma's scale-d 0): a T.clear in a
            # warpgroup's branch made ptxas serialise every wgmma (C7518, "WG.DP in divergent path")
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations=annotations)
        else:
            T.clear(acc)
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, annotations=annotations)
        T.gemm(a_l0, phi_j[0:KH, 0:BC], acc, policy=T.GemmWarpPolicy.FullRow, annotations=annotations)

    def res_t_terms(v, res_s, tt, j, values):
        # v + sum_i H_res[i, j] values[i], added term by term: one FFMA each (as v + sum(...) the sum began with an
        # FMUL and ended with an FADD)
        for i in lanes:
            v = v + res_s[tt, i, j] * values[i]
        return v

    @T.macro
    def dx_epilogue(acc, j, x_j, dys, coef_s, dp_j, dxf, dx_s, dx_tile):
        for tt, c in T.Parallel(BT, BC):
            if into_acc:  # every other term is in the accumulator
                v = acc[tt, c]
            else:
                v = (acc[tt, c] + coef_s[tt, j] * T.cast(dys[tt, c], "float32")
                     + coef_s[tt, n] * T.cast(x_j[tt, c], "float32"))
            if dp_j is not None:  # the post's gradient of the same lanes, read once
                v = v + T.cast(dp_j[tt, c], "float32")
            dxf[tt, c] = T.cast(v, dtype)
        if dx_s is None:
            T.copy(dxf, dx_tile)
        else:  # through shared memory and a TMA store, which writes whole rows
            if T.shuffle_elect(threads):  # this buffer's store from the tile before has read it
                T.tma_store_wait(LG // CG - 1)
            T.copy(dxf, dx_s)
            T.tma_copy(dx_s, dx_tile)

    @T.macro
    def hold_g(g_held, lanes_g, lg, gs, res_s, xs, dy_src, coef_s):
        # with g: the tile's n lanes of g read once, and H_pre[j] dy + 2 ds x_j + H_res^T g formed for each of
        # this warpgroup's lanes in the accumulators given as g_held, before their products are issued
        for tt, c in T.Parallel(BT, BC):
            # bound to names, so each lane of g is read once (a list's items were repeated at every use)
            g0, g1, g2, g3, g4, g5, g6, g7 = [T.cast(gs[i][tt, c], "float32") if i < n else T.float32(0)
                                              for i in range(8)]
            gv = [g0, g1, g2, g3, g4, g5, g6, g7][:n]
            dyv = T.cast(dy_src[tt, c], "float32")
            for k, jj in enumerate(lanes_g):
                j = lg * LG + jj
                rest = coef_s[tt, j] * dyv + coef_s[tt, n] * T.cast(xs[jj][tt, c], "float32")
                g_held[k][tt, c] = res_t_terms(rest, res_s, tt, j, gv)

    @T.macro
    def overlapped_lanes(lanes_g, t0, lg, c0, dy_src, dxf, accs, acc_phi, keep, a_dx, a_l0, a_hl, phi_s, xs, coef_s,
                         dps, gs, res_s, dx_stage, dx):
        # one consumer warpgroup's lanes: each lane's dx GEMMs issued before the previous lane's epilogue, its
        # dphi GEMM after it, none waited for at its issue
        later = 2  # wgmma groups one lane's dx GEMMs commit
        if into_acc:  # every term but the products in the lanes' accumulators, before any of them is issued
            hold_g([accs[jj] for jj in lanes_g], lanes_g, lg, gs, res_s, xs, dy_src, coef_s)
        dx_gemms(a_dx, a_l0, phi_s[lanes_g[0]], accs[lanes_g[0]], ASYNC, into_acc)
        for i, jj in enumerate(lanes_g):
            if i + 1 < len(lanes_g):
                dx_gemms(a_dx, a_l0, phi_s[lanes_g[i + 1]], accs[lanes_g[i + 1]], ASYNC, into_acc)
                T.wait_wgmma(later)
            else:
                T.wait_wgmma(0)
            T.warpgroup_fence_operand(accs[jj], num_regs=BT * BC // threads)  # one thread's share
            dx_epilogue(accs[jj], lg * LG + jj, xs[jj], dy_src, coef_s, dps[jj], dxf, dx_stage[jj],
                        dx[t0 : t0 + BT, lg * LG + jj, c0 : c0 + BC])
            T.gemm(a_hl, xs[jj], acc_phi[jj], transpose_A=True, annotations=ASYNC)
        T.wait_wgmma(0)
        # the staged operands' last use: after the wait, so the stage is released only then
        gemm_operands = [a_dx, a_hl] + [xs[jj] for jj in lanes_g] + [a_l0]
        keep[0] = sum([T.cast(b[0, 0], "float32") for b in gemm_operands], T.float32(0))

    @T.macro
    def hold_dy(dy_held, dys):
        # with dx_post: the tile's dy read once into registers for all the lanes that use it
        if dy_once:
            for tt, c in T.Parallel(BT, BC):
                dy_held[tt, c] = T.cast(dys[tt, c], "float32")

    @T.macro
    def group_work(k, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, operands):
        # consumer group k's share of a tile: its dy held once (with dx_post), then its lanes, overlapped
        hold_dy(dy_helds[k], dys)
        overlapped_lanes(group_lanes[k], t0, lg, c0, _present(dy_helds[k], dys)[0], dxfs[k], accs, acc_phi, keep,
                         *operands)

    @T.macro
    def lanes_tail(lanes_g, lg, c0, s, acc_phi, dphi_partial):
        if stage_dx:
            if T.shuffle_elect(threads):  # the last stores have read their buffers
                T.tma_store_wait(0)
        for jj in lanes_g:
            j = lg * LG + jj
            for k, c in T.Parallel(K2, BC):
                if c0 + c < C:
                    dphi_partial[s, k, j * C + c0 + c] = acc_phi[jj][k, c]

    @T.macro
    def body(x, dy, dsplit, coef, phi, dx_post, g, res, dx, dphi_partial):
        with T.Kernel(T.ceildiv(C, BC), n // LG, S, threads=threads * CG) as (bc, lg, s):
            phi_s = [T.alloc_shared((K2, BC), "bfloat16") for _ in group]  # [phi_hi; phi_lo]
            a_dx = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_hi]
            a_l0 = T.alloc_shared((BT, KH), "bfloat16")  # [dmix_lo | 0], its upper half (zeros) left out
            a_hl = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_lo]
            xs = [T.alloc_shared((BT, BC), dtype) for _ in group]
            dys = T.alloc_shared((BT, BC), dtype)
            coef_s = T.alloc_shared((BT, CP), "float32")  # H_pre per lane, then 2 ds
            acc = T.alloc_fragment((BT, BC), "float32")
            accs = [acc] + [T.alloc_fragment((BT, BC), "float32") for _ in group[1:]]  # a dx accumulator per lane
            # with two consumer warpgroups each has its own dx and held dy fragments: a fragment is bound to the
            # threads that first use it, and one shared by both branches lost the second warpgroup's work
            dxfs = [T.alloc_fragment((BT, BC), dtype) for _ in range(CG)]
            # the post's dx tiles, one per lane (None without add_dx)
            dps = [T.alloc_shared((BT, BC), dtype) if dx_post is not None else None for _ in group]
            gs = [T.alloc_shared((BT, BC), dtype) for _ in lanes] if g is not None else None
            res_s = T.alloc_shared((BT, n, n), "float32") if g is not None else None
            acc_phi = [T.alloc_fragment((K2, BC), "float32") for _ in group]
            keep = T.alloc_local((1,), "float32")
            dx_stage = [T.alloc_shared((BT, BC), dtype) if stage_dx else None for _ in group]
            # dy read once into registers for all the lanes of a warpgroup (the epilogue's dy is
            # _present(dy_held, dys)[0]: dy_held where it exists, else the shared tile)
            dy_helds = [T.alloc_fragment((BT, BC), "float32") if dy_once else None for _ in range(CG)]
            tx = T.get_thread_binding()  # the consumer warpgroup: tx < 128 is the first (consumer numbering)
            # the epilogue's tiles that no GEMM reads, in the GEMM tiles' swizzle
            T.annotate_layout({b: make_swizzled_layout(b) for b in _present(dys, gs, dps)})
            c0 = bc * BC
            tiles = T.ceildiv(T.ceildiv(NT, BT), S)
            for jj in group:
                # this CTA's columns of phi, split into bf16 hi (rows 0..KH) and lo (rows KH..2KH) once
                split_phi(phi, phi_s[jj], lg * LG + jj, c0)
                if CG == 1:
                    T.clear(acc_phi[jj])
            if CG > 1:
                if tx < 128:
                    for jj in group_lanes[0]:
                        T.clear(acc_phi[jj])
                else:
                    for jj in group_lanes[1]:
                        T.clear(acc_phi[jj])
            for tb in T.Pipelined(tiles, num_stages=stages):
                t0 = (s * tiles + tb) * BT
                # operands arrive by copies only (zero-filled past the last token), so the pipeline may
                # prefetch the next tile while this one computes
                copy_tile(t0, lg * LG, c0, x, dy, dsplit, coef, dx_post, g, res, a_dx, a_l0, a_hl, coef_s, xs, dps, gs,
                          res_s, dys)
                operands = (a_dx, a_l0, a_hl, phi_s, xs, coef_s, dps, gs, res_s, dx_stage, dx)
                if CG > 1:  # each consumer warpgroup its own lanes, held dy and dx fragments
                    if tx < 128:
                        group_work(0, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, operands)
                    else:
                        group_work(1, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, operands)
                else:
                    group_work(0, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, operands)
            if CG > 1:
                if tx < 128:
                    lanes_tail(group_lanes[0], lg, c0, s, acc_phi, dphi_partial)
                else:
                    lanes_tail(group_lanes[1], lg, c0, s, acc_phi, dphi_partial)
            else:
                lanes_tail(group, lg, c0, s, acc_phi, dphi_partial)

    return _cuda_entry(body, n, C, dtype, NT, S, add_dx, post_grad)


def _portable_body(n: int, C: int, dtype: str, add_dx: bool, post_grad: bool, NT, S: int):
    """Kernel 2's portable CUDA body (pre_backward_lanes_program): per CTA the LG lanes and BC columns of
    portable_lane_tiling for a range of token tiles, in a pipeline of its stages. Per tile and lane: dx's two
    products into one accumulator (with g, onto every other term of dx written there first), the epilogue,
    dx stored from registers, then the lane's dphi product; each product waited for where it is issued."""
    KH = gemm_depth(n)
    K2, BT, CP = 2 * KH, BLOCK_TOKENS, coef_width(n)
    LG, BC, stages = portable_lane_tiling(n, add_dx, post_grad)
    lanes, group = list(range(n)), list(range(LG))
    split_phi, copy_tile = _tile_macros(n, C, dtype, LG, BC)

    @T.macro
    def body(x, dy, dsplit, coef, phi, dx_post, g, res, dx, dphi_partial):
        with T.Kernel(T.ceildiv(C, BC), n // LG, S, threads=THREADS) as (bc, lg, s):
            phi_s = [T.alloc_shared((K2, BC), "bfloat16") for _ in group]  # [phi_hi; phi_lo]
            a_dx = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_hi]
            a_l0 = T.alloc_shared((BT, KH), "bfloat16")  # [dmix_lo | 0], its upper half (zeros) left out
            a_hl = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_lo]
            xs = [T.alloc_shared((BT, BC), dtype) for _ in group]
            dys = T.alloc_shared((BT, BC), dtype)
            coef_s = T.alloc_shared((BT, CP), "float32")  # H_pre per lane, then 2 ds
            dps = [T.alloc_shared((BT, BC), dtype) if dx_post is not None else None for _ in group]
            gs = [T.alloc_shared((BT, BC), dtype) for _ in lanes] if g is not None else None
            res_s = T.alloc_shared((BT, n, n), "float32") if g is not None else None
            acc = T.alloc_fragment((BT, BC), "float32")  # one lane's dx at a time
            dxf = T.alloc_fragment((BT, BC), dtype)
            acc_phi = [T.alloc_fragment((K2, BC), "float32") for _ in group]
            c0 = bc * BC
            # each split's token tiles in whole chunks: TileLang pipelines a loop of a static trip count (the
            # tiles past the last token arrive zero-filled and add nothing)
            chunks = T.ceildiv(T.ceildiv(T.ceildiv(NT, BT), S), PORTABLE_CHUNK)
            for jj in group:
                split_phi(phi, phi_s[jj], lg * LG + jj, c0)
                T.clear(acc_phi[jj])
            for ch in T.serial(chunks):
                for tc in T.Pipelined(PORTABLE_CHUNK, num_stages=stages):
                    t0 = ((s * chunks + ch) * PORTABLE_CHUNK + tc) * BT
                    copy_tile(t0, lg * LG, c0, x, dy, dsplit, coef, dx_post, g, res, a_dx, a_l0, a_hl, coef_s, xs, dps,
                              gs, res_s, dys)
                    for jj in group:
                        j = lg * LG + jj
                        if g is not None:  # H_pre[j] dy + 2 ds x_j + H_res^T g first, the products onto them
                            for tt, c in T.Parallel(BT, BC):
                                v = (coef_s[tt, j] * T.cast(dys[tt, c], "float32")
                                     + coef_s[tt, n] * T.cast(xs[jj][tt, c], "float32"))
                                for i in lanes:
                                    v = v + res_s[tt, i, j] * T.cast(gs[i][tt, c], "float32")
                                acc[tt, c] = v
                            T.gemm(a_dx, phi_s[jj], acc, policy=T.GemmWarpPolicy.FullRow)
                        else:
                            T.gemm(a_dx, phi_s[jj], acc, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                        T.gemm(a_l0, phi_s[jj][0:KH, 0:BC], acc, policy=T.GemmWarpPolicy.FullRow)
                        for tt, c in T.Parallel(BT, BC):
                            v = acc[tt, c]
                            if g is None:
                                v = (v + coef_s[tt, j] * T.cast(dys[tt, c], "float32")
                                     + coef_s[tt, n] * T.cast(xs[jj][tt, c], "float32"))
                            if dx_post is not None:
                                v = v + T.cast(dps[jj][tt, c], "float32")
                            dxf[tt, c] = T.cast(v, dtype)
                        T.copy(dxf, dx[t0 : t0 + BT, j, c0 : c0 + BC])
                        T.gemm(a_hl, xs[jj], acc_phi[jj], transpose_A=True)
            for jj in group:
                j = lg * LG + jj
                for k, c in T.Parallel(K2, BC):
                    if c0 + c < C:
                        dphi_partial[s, k, j * C + c0 + c] = acc_phi[jj][k, c]

    return body


def _tile_macros(n: int, C: int, dtype: str, LG: int, BC: int):
    """What both CUDA bodies of kernel 2 do alike, for CTAs of LG lanes and BC columns:
    ``split_phi(phi, phi_j, j, c0)`` writes columns c0.. of lane j's phi into phi_j, split into bf16 hi (rows
    0..KH) and lo (rows KH..2KH), zeros past n^2+2n and past C; ``copy_tile(t0, j0, c0, ...)`` copies one
    token tile's operands into shared memory (zero-filled past the last token)."""
    M, KH = mixes_width(n), gemm_depth(n)
    K2, BT, CP = 2 * KH, BLOCK_TOKENS, coef_width(n)
    lanes, group = list(range(n)), list(range(LG))

    @T.macro
    def split_phi(phi, phi_j, j, c0):
        for k, c in T.Parallel(K2, BC):
            q = k % KH
            v = T.if_then_else((q < M) & (c0 + c < C), phi[q % M, j * C + T.min(c0 + c, C - 1)],
                               T.float32(0))
            hi = T.cast(v, "bfloat16")
            lo = T.cast(v - T.cast(hi, "float32"), "bfloat16")
            phi_j[k, c] = T.if_then_else(k < KH, hi, lo)

    @T.macro
    def copy_tile(t0, j0, c0, x, dy, dsplit, coef, dx_post, g, res, a_dx, a_l0, a_hl, coef_s, xs, dps, gs, res_s,
                  dys):
        T.copy(dsplit[t0 : t0 + BT, 0, 0:K2], a_dx)
        T.copy(dsplit[t0 : t0 + BT, 1, 0:KH], a_l0)
        T.copy(dsplit[t0 : t0 + BT, 2, 0:K2], a_hl)
        T.copy(coef[t0 : t0 + BT, 0:CP], coef_s)
        for jj in group:
            T.copy(x[t0 : t0 + BT, j0 + jj, c0 : c0 + BC], xs[jj])
            if dx_post is not None:
                T.copy(dx_post[t0 : t0 + BT, j0 + jj, c0 : c0 + BC], dps[jj])
        if gs is not None:
            for i in lanes:
                T.copy(g[t0 : t0 + BT, i, c0 : c0 + BC], gs[i])
            T.copy(res[t0 : t0 + BT, 0:n, 0:n], res_s)
        T.copy(dy[t0 : t0 + BT, c0 : c0 + BC], dys)

    return split_phi, copy_tile


def _cuda_entry(body, n: int, C: int, dtype: str, NT, S: int, add_dx: bool, post_grad: bool):
    """Kernel 2's CUDA entry point around a body (the Hopper or the portable one): the same arguments either way,
    x, dy, dsplit, coef, phi, then (add_dx) dx_post or (post_grad) g and res, then dx and dphi_partial."""
    M = mixes_width(n)
    K = n * C
    K2 = 2 * gemm_depth(n)
    CP = coef_width(n)

    if add_dx:

        @T.prim_func
        def lanes_backward_cuda_add(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
            coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
            dx_post: T.Tensor((NT, n, C), dtype),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
        ):
            body(x, dy, dsplit, coef, phi, dx_post, None, None, dx, dphi_partial)

        return lanes_backward_cuda_add

    if post_grad:

        @T.prim_func
        def lanes_backward_cuda_post_grad(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
            coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
            g: T.Tensor((NT, n, C), dtype), res: T.Tensor((NT, n, n), "float32"),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
        ):
            body(x, dy, dsplit, coef, phi, None, g, res, dx, dphi_partial)

        return lanes_backward_cuda_post_grad

    @T.prim_func
    def lanes_backward_cuda(
        x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
        coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
        dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
    ):
        body(x, dy, dsplit, coef, phi, None, None, None, dx, dphi_partial)

    return lanes_backward_cuda


def lane_tiling(n: int, add_dx: bool = False, post_grad: bool = False) -> tuple[int, int, int]:
    """(lanes per CTA, columns per CTA, consumer warpgroups) of kernel 2 on CUDA.

    - Without the post's gradient: two lanes per consumer warpgroup (one for odd n) and the most columns (64 or
      32) whose dphi accumulators, 2 lanes x 2 gemm_depth(n) x columns float32, stay within 128 registers per
      thread; two warpgroups of two lanes where n has four lanes and their two stages fit (n = 4, 8), else one
      warpgroup with the most lanes whose stage fits.
    - With dx_post: 32 columns (more CTAs and a deeper pipeline in the same shared memory than 64), and the
      most lanes up to 4 that divide n and fit two stages (else one).
    - With g (post_grad): every lane, since each lane's dx takes all n lanes of g; 32 columns (16 past n = 4,
      to fit).
    Four lanes go to two consumer warpgroups (consumer_groups_for)."""
    if post_grad:
        return n, 32 if n <= 4 else 16, consumer_groups_for(n)
    if add_dx:
        for stages in (2, 1):
            for lanes in (4, 2, 1):
                if n % lanes == 0 and lanes_shared_bytes(n, lanes, 32, stages, True) <= SMEM_LIMIT:
                    return lanes, 32, consumer_groups_for(lanes)
    per_group = 2 if n % 2 == 0 else 1
    columns = 32 if per_group * 2 * gemm_depth(n) * 64 > 128 * 128 else 64
    if (n % (2 * per_group) == 0 and consumer_groups_for(2 * per_group) == 2
            and lanes_shared_bytes(n, 2 * per_group, columns, 2, False) <= SMEM_LIMIT):
        return 2 * per_group, columns, 2
    lanes = per_group
    while lanes > 1 and lanes_shared_bytes(n, lanes, columns, 1, False) > SMEM_LIMIT:
        lanes //= 2
    return lanes, columns, 1


def consumer_groups_for(lanes: int) -> int:
    """Kernel 2's consumer warpgroups for a CTA of `lanes` lanes: two of two lanes each where it has four (two
    warps per scheduler, each hiding the other's epilogue latencies), else one."""
    return 2 if lanes == 4 else 1


def lane_stages(n: int, lanes: int, block_c: int, add_dx: bool, post_grad: bool = False,
                stage_dx: bool = True) -> int:
    """Kernel 2's pipeline depth on CUDA: the most stages whose tiles fit in shared memory, up to 3 with dx_post
    or g (their extra 4C per token gains from the deeper pipeline) and 2 without."""
    for stages in range(3 if add_dx or post_grad else 2, 1, -1):
        if lanes_shared_bytes(n, lanes, block_c, stages, add_dx, post_grad, stage_dx) <= SMEM_LIMIT:
            return stages
    return 1


def lanes_shared_bytes(n: int, lanes: int, block_c: int, stages: int, add_dx: bool, post_grad: bool = False,
                       stage_dx: bool = True) -> int:
    """Shared memory of kernel 2 on CUDA, at most: phi's columns, (stage_dx) each lane's dx tile on its way
    out; per stage the three dmix operands, the coefficients, the lanes' x tiles, the dy tile and (add_dx) the
    lanes' dx_post tiles or (post_grad) the n lanes' g tiles and the tokens' H_res."""
    k2 = 2 * gemm_depth(n)
    tile = BLOCK_TOKENS * block_c * 2
    staged = (3 * BLOCK_TOKENS * k2 * 2 + BLOCK_TOKENS * coef_width(n) * 4
              + (lanes * (2 if add_dx else 1) + 1) * tile)
    if post_grad:
        staged += n * tile + BLOCK_TOKENS * n * n * 4
    staged_dx = lanes * tile if stage_dx else 0
    return lanes * k2 * block_c * 2 + staged_dx + stages * staged


def portable_lane_tiling(n: int, add_dx: bool = False, post_grad: bool = False) -> tuple[int, int, int]:
    """(lanes per CTA, columns per CTA, stages) of kernel 2's portable program: two lanes (one for odd n; with
    g all n, since each lane's dx takes every lane of g), and the deepest pipeline (two stages, else one) with
    the most columns (64, 32, 16) whose dphi accumulators, lanes x 2 gemm_depth(n) x columns float32, take at
    most 96 registers per thread and whose tiles fit PORTABLE_SMEM_LIMIT (portable_shared_bytes)."""
    lanes = n if post_grad else 2 if n % 2 == 0 else 1
    for stages in (2, 1):
        for columns in (64, 32, 16):
            registers = lanes * 2 * gemm_depth(n) * columns // THREADS
            if registers <= 96 and portable_shared_bytes(n, lanes, columns, stages, add_dx,
                                                         post_grad) <= PORTABLE_SMEM_LIMIT:
                return lanes, columns, stages
    least = portable_shared_bytes(n, lanes, 16, 1, add_dx, post_grad)
    raise ValueError(f"pre backward (lanes), portable: n = {n}{' with g' if post_grad else ''} needs {least} bytes "
                     f"of shared memory in its narrowest tiles, more than the {PORTABLE_SMEM_LIMIT} every GPU from "
                     f"sm_80 on gives a block")


def portable_shared_bytes(n: int, lanes: int, block_c: int, stages: int, add_dx: bool = False,
                          post_grad: bool = False) -> int:
    """Shared memory of kernel 2's portable program: phi's columns; per stage the three dmix operands, the
    coefficients, the lanes' x tiles, the dy tile and (add_dx) the lanes' dx_post tiles or (post_grad) the n
    lanes' g tiles and the tokens' H_res."""
    kh = gemm_depth(n)
    tile = BLOCK_TOKENS * block_c * 2
    staged = (BLOCK_TOKENS * 5 * kh * 2 + BLOCK_TOKENS * coef_width(n) * 4
              + (lanes * (2 if add_dx else 1) + 1) * tile)
    if post_grad:
        staged += n * tile + BLOCK_TOKENS * n * n * 4
    return lanes * 2 * kh * block_c * 2 + stages * staged


def lane_splits_for(n: int, C: int, sms: int, *, add_dx: bool = False, post_grad: bool = False) -> int:
    """Token splits S of kernel 2 on CUDA for a GPU with `sms` SMs. Its shared memory holds one CTA per SM, so
    its (column blocks x S) CTAs run in waves of `sms`, and the last wave's empty SMs are lost time. The
    smallest S (up to 32) whose waves are at least 90% full, else the fullest (each split adds a dphi partial
    of 2 gemm_depth(n) x nC floats to write and sum)."""
    lanes, columns, _ = lane_tiling(n, add_dx, post_grad)
    blocks = -(-C // columns) * (n // lanes)

    def fullness(splits: int) -> float:
        ctas = blocks * splits
        return ctas / (sms * -(-ctas // sms))

    candidates = range(1, 33)
    good = [s for s in candidates if fullness(s) >= 0.9]
    return good[0] if good else max(candidates, key=lambda s: (fullness(s), -s))


def dphi_from_partial(partial, n: int):
    """dphi [n^2+2n, nC] from kernel 2's CUDA output [splits, 2 gemm_depth(n), nC] (rows: the dmix_hi part,
    then the dmix_lo part, each padded), summed over splits and halves in torch, reading only the rows that are
    not padding: the sum the pre backward's sums kernel takes on the GPU (pre_backward_sums), as the tests read
    kernel 2's output alone."""
    M, KH = mixes_width(n), gemm_depth(n)
    return partial.unflatten(1, (2, KH))[:, :, :M].sum((0, 1))
