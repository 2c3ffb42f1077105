"""The per-token coefficient math of the pre kernels, written once for every target.

One thread (GPU) or one loop iteration (C target) owns one token: its n^2 + 2n raw projections and its sum of
squares arrive in a local array ``mix`` and leave as H_pre, H_post and the Sinkhorn-normalised H_res, in
float32, in the DeepSeek-V4 convention of ``mhc_lab.reference`` (paper arXiv 2512.24880, Eqs. 14-19):

    r      = rsqrt(sum(x^2) / (n C) + rms_eps)          # the RMSNorm, applied after the matmul (Eq. 15)
    pre_i  = sigmoid(alpha_0 r mix_i + b_i) + eps
    post_i = 2 sigmoid(alpha_1 r mix_{n+i} + b_{n+i})
    comb   = softmax_rows(alpha_2 r mix_res + b_res) + eps;  columns / (sum + eps)
             then (t - 1) x [rows / (sum + eps); columns / (sum + eps)];   H_res = comb^T

Divisions are a reciprocal and a multiply (one rounding more than the reference's division: well inside
float32 tolerance).
"""


from types import SimpleNamespace
from typing import NamedTuple

import tilelang.language as T


TOKEN_THREADS = 128  # threads (= tokens) per CTA of the kernels that run one token's coefficients per thread


def mixes_width(n: int) -> int:
    return n * n + 2 * n


def _sinkhorn_macros(n: int, eps: float):
    """The DeepSeek-V4 Sinkhorn's pieces on a thread-local comb [n * n] (row-major), shared by the forward
    and the backward: the row softmax of the logits, a column step and a row step. A step divides by the
    column (row) sums + eps (a reciprocal, then multiplications); given an array ``kept`` it also keeps the n
    sums + eps at ``kept[step * n:]``."""
    rows = list(range(n))

    @T.macro
    def softmax_rows(comb, a_res, mix, bias):
        for q in T.unroll(n * n):
            comb[q] = a_res * mix[2 * n + q] + bias[2 * n + q]
        for i in T.unroll(n):
            row_max = comb[i * n]
            for j in rows[1:]:
                row_max = T.max(row_max, comb[i * n + j])
            for j in T.unroll(n):
                comb[i * n + j] = T.exp(comb[i * n + j] - row_max)
            total = T.float32(1.0) / sum([comb[i * n + j] for j in rows])
            for j in T.unroll(n):
                comb[i * n + j] = comb[i * n + j] * total

    @T.macro
    def normalise(comb, kept, step, at):
        """One Sinkhorn step over the n lines of comb; at(line, k) is the flat index of a line's k-th entry."""
        for a in T.unroll(n):
            total = sum([comb[at(a, b)] for b in rows]) + T.float32(eps)
            scale = T.float32(1.0) / total
            if kept is not None:
                kept[step * n + a] = total
            for b in T.unroll(n):
                comb[at(a, b)] = comb[at(a, b)] * scale

    def column_step(comb, kept, step):
        normalise(comb, kept, step, lambda j, i: i * n + j)

    def row_step(comb, kept, step):
        normalise(comb, kept, step, lambda i, j: i * n + j)

    return softmax_rows, column_step, row_step


def store_coefficients_macro(n: int):
    """A T.macro ``store(tok, pre_l, post_l, comb, pre_out, post_out, res_out)``: one token's H_pre, H_post and
    H_res from a thread's local arrays to the outputs (H_res[i, j] = comb[j, i]: comb is kept transposed)."""

    @T.macro
    def store(tok, pre_l, post_l, comb, pre_out, post_out, res_out):
        for i in T.unroll(n):
            pre_out[tok, i] = pre_l[i]
            post_out[tok, i] = post_l[i]
            for j in T.unroll(n):
                res_out[tok, i, j] = comb[j * n + i]

    return store


def partial_sum_macro(n: int, splits: int):
    """A T.macro ``gather(partial, tok, mix)``: mix[q] = sum over the splits of partial[s, tok, q] (the raw
    projections and the sum of squares, in a fixed order), from partial [splits, T, n^2+2n+1]."""
    M = mixes_width(n)

    @T.macro
    def gather(partial, tok, mix):
        for q in T.unroll(M + 1):
            mix[q] = partial[0, tok, q]
        for s in T.serial(splits - 1):
            for q in T.unroll(M + 1):
                mix[q] = mix[q] + partial[s + 1, tok, q]

    return gather


def coefficient_macro(n: int, width: int, *, iterations: int = 20, eps: float = 1e-6, rms_eps: float = 1e-6):
    """A T.macro ``coefficients(mix, alpha, bias, pre, post, comb)`` over thread-local arrays.

    mix: [n^2 + 2n + 1] raw x.phi^T then sum(x^2); pre, post: [n]; comb: [n * n], row-major, comb[i * n + j],
    left *untransposed* (H_res[i, j] = comb[j * n + i]).
    """
    m = mixes_width(n)
    k = n * width
    softmax_rows, column_step, row_step = _sinkhorn_macros(n, eps)

    @T.macro
    def coefficients(mix, alpha, bias, pre, post, comb):
        r = T.rsqrt(mix[m] / T.float32(k) + T.float32(rms_eps))
        a_pre = alpha[0] * r
        a_post = alpha[1] * r
        a_res = alpha[2] * r
        for i in T.unroll(n):
            pre[i] = T.sigmoid(a_pre * mix[i] + bias[i]) + T.float32(eps)
            post[i] = T.float32(2.0) * T.sigmoid(a_post * mix[n + i] + bias[n + i])
        softmax_rows(comb, a_res, mix, bias)
        for q in T.unroll(n * n):
            comb[q] = comb[q] + T.float32(eps)
        # one column normalisation, then (t - 1) rounds of rows and columns
        column_step(comb, None, 0)
        for _ in T.serial(iterations - 1):
            row_step(comb, None, 0)
            column_step(comb, None, 0)

    return coefficients


def sinkhorn_steps(iterations: int) -> int:
    """Normalisation steps of the DeepSeek-V4 Sinkhorn: one column step, then (t - 1) row + column pairs."""
    return 2 * iterations - 1


def coefficient_backward_macro(n: int, width: int, *, iterations: int = 20, eps: float = 1e-6,
                               rms_eps: float = 1e-6):
    """A T.macro ``coefficients_backward(mix, alpha, bias, dpre, dpost, dres, comb, dcomb, kept, dlogit, dmix,
    extra)``: the backward of ``coefficient_macro`` for one token, all in thread-local arrays.

    In: mix [n^2+2n+1] (raw projections, then sum(x^2)), dpre, dpost [n], dres [n*n] with dres[i*n+j] the
    gradient of H_res[i, j]. Scratch: comb, dcomb [n*n], kept [sinkhorn_steps(t) * n].
    Out: dlogit [n^2+2n] (the gradient of each pre-activation, which is also the bias gradient), dmix
    [n^2+2n] (the gradient of each raw projection: dlogit * alpha_k * r), extra [4] = the three alpha
    gradients and the gradient of sum(x^2).

    The Sinkhorn backward recomputes the forward on chip and keeps only each step's n line sums (t = 20,
    n = 4: 156 floats), never the intermediate matrices. A row step Q = P / s with s = rowsum(P) + eps has
    the backward dP = (dQ - rowsum(dQ * Q)) / s, which needs Q (the state after the step) and s; the state
    before the step is recovered as P = Q * s. The reciprocal 1 / s is taken again from the kept sum, once
    per line and off the serial chain; the undo is a multiplication (a division per entry took 10% longer on
    the H200, kernel notes).
    """
    m = mixes_width(n)
    k = n * width
    rows = list(range(n))
    groups = [list(range(n)), list(range(n, 2 * n)), list(range(2 * n, m))]
    softmax_rows, column_step, row_step = _sinkhorn_macros(n, eps)

    @T.macro
    def normalise_backward(comb, dcomb, kept, step, at):
        """The backward of one step: dP = (dQ - <dQ, Q>_line) / s, then P = Q * s."""
        for a in T.unroll(n):
            dot = sum([dcomb[at(a, b)] * comb[at(a, b)] for b in rows])
            scale = T.float32(1.0) / kept[step * n + a]
            for b in T.unroll(n):
                dcomb[at(a, b)] = (dcomb[at(a, b)] - dot) * scale
                comb[at(a, b)] = comb[at(a, b)] * kept[step * n + a]

    def column_step_backward(comb, dcomb, kept, step):
        normalise_backward(comb, dcomb, kept, step, lambda j, i: i * n + j)

    def row_step_backward(comb, dcomb, kept, step):
        normalise_backward(comb, dcomb, kept, step, lambda i, j: i * n + j)

    @T.macro
    def coefficients_backward(mix, alpha, bias, dpre, dpost, dres, comb, dcomb, kept, dlogit, dmix, extra):
        r = T.rsqrt(mix[m] / T.float32(k) + T.float32(rms_eps))
        a_pre = alpha[0] * r
        a_post = alpha[1] * r
        a_res = alpha[2] * r
        for i in T.unroll(n):
            s_pre = T.sigmoid(a_pre * mix[i] + bias[i])
            dlogit[i] = dpre[i] * s_pre * (T.float32(1.0) - s_pre)
            s_post = T.sigmoid(a_post * mix[n + i] + bias[n + i])
            dlogit[n + i] = dpost[i] * T.float32(2.0) * s_post * (T.float32(1.0) - s_post)
        # Sinkhorn forward again, keeping the sums of every step
        softmax_rows(comb, a_res, mix, bias)
        for q in T.unroll(n * n):
            comb[q] = comb[q] + T.float32(eps)
        column_step(comb, kept, 0)
        for it in T.serial(iterations - 1):
            row_step(comb, kept, 2 * it + 1)
            column_step(comb, kept, 2 * it + 2)
        # comb holds H_res transposed: the gradient of comb[i * n + j] is dres[j * n + i]
        for i in T.unroll(n):
            for j in T.unroll(n):
                dcomb[i * n + j] = dres[j * n + i]
        for it in T.serial(iterations - 1):
            back = iterations - 2 - it
            column_step_backward(comb, dcomb, kept, 2 * back + 2)
            row_step_backward(comb, dcomb, kept, 2 * back + 1)
        column_step_backward(comb, dcomb, kept, 0)
        # softmax backward, on the softmax recomputed exactly (not the reconstructed comb - eps)
        softmax_rows(comb, a_res, mix, bias)
        for i in T.unroll(n):
            dot = sum([dcomb[i * n + j] * comb[i * n + j] for j in rows])
            for j in T.unroll(n):
                dlogit[2 * n + i * n + j] = comb[i * n + j] * (dcomb[i * n + j] - dot)
        # pre-activation z = alpha_k r mix + b: gradients of mix, alpha and r; then of sum(x^2)
        sums = [sum([dlogit[q] * mix[q] for q in group]) for group in groups]
        for q in T.unroll(m):
            dmix[q] = dlogit[q] * T.if_then_else(q < n, a_pre, T.if_then_else(q < 2 * n, a_post, a_res))
        extra[0] = sums[0] * r
        extra[1] = sums[1] * r
        extra[2] = sums[2] * r
        d_r = alpha[0] * sums[0] + alpha[1] * sums[1] + alpha[2] * sums[2]
        extra[3] = d_r * T.float32(-0.5) * r * r * r / T.float32(k)

    return coefficients_backward


class SpreadLayout(NamedTuple):
    """Where one token's coefficient math sits in the spread kernels: ``threads`` (P = n R) threads of one warp,
    ``slots`` (R) row slots per column. Thread g holds column ``column(g)`` of the n x n matrix at rows
    ``row(g, e)`` for e < ``entries`` (n / R), and the pre/post entry ``gate(g, m)`` for m < ``gates`` where it
    is below 2n. A row's butterfly pairs threads across ``row_bits`` (same slot, other columns), a column's
    across ``slot_bits`` (same column, other slots). The index functions take ints or TIR expressions."""

    n: int
    threads: int
    slots: int

    @property
    def entries(self) -> int:
        return self.n // self.slots

    @property
    def gates(self) -> int:
        return (2 * self.n + self.threads - 1) // self.threads

    @property
    def row_bits(self) -> list[int]:
        return [1 << b for b in range(self.n.bit_length() - 1)]

    @property
    def slot_bits(self) -> list[int]:
        return [self.n << b for b in range(self.slots.bit_length() - 1)]

    def column(self, g):
        return g % self.n

    def row(self, g, e):
        return g // self.n + self.slots * e

    def gate(self, g, m):
        return g + self.threads * m


def spread_fits(n: int) -> bool:
    """Whether the spread kernels take n lanes: n a power of two (their butterfly sums); other n run a token
    per thread."""
    return n & (n - 1) == 0


def spread_layout(n: int) -> SpreadLayout:
    """The spread coefficient math's layout: a token's n x n matrix over n R threads of one warp, R = min(n,
    32 // n) row slots per column, so that each thread holds n // R entries of one column (one at n <= 4, two
    at n = 8). n must be a power of two (spread_fits)."""
    if not spread_fits(n):
        raise ValueError(f"spread coefficients: expected n a power of two (1, 2, 4, 8), got n = {n}")
    rows = min(n, 32 // n)
    return SpreadLayout(n, n * rows, rows)


def spread_coefficient_macros(n: int, width: int, splits: int, *, iterations: int = 20, eps: float = 1e-6,
                              rms_eps: float = 1e-6):
    """The coefficient math of one token spread over P = n R threads of a warp (``spread_layout``): the
    forward of ``coefficient_macro`` and the backward of ``coefficient_backward_macro``, their sums in
    butterfly order. Returns a namespace with ``coefficients`` and ``backward`` (T.macros), ``scratch()`` (the
    thread-local arrays they take) and ``kept_count`` (the backward's caller allocates ``kept`` [kept_count,
    threads] float32 in shared memory).

    Thread g of a token's group holds column j = g % n, rows i = g // n + R e (e < n // R) of the matrix, and
    the pre and post entries q = g + P m (q < 2n). A line's sum is a butterfly of warp shuffles: a row's over
    the bits of j (xor 1 .. n/2), a column's over the bits of the row slot (xor n .. nR/2) after the thread's
    own rows. In the backward every Sinkhorn step keeps only its sums (one per line the thread holds), the
    steps unrolled, in shared memory at kept[step's offset, tx] (conflict-free; in registers they took about
    100 per thread and the per-token kernel 30% longer on the H200); it takes each reciprocal again from its
    sum and undoes a step by multiplying with the sum. All threads of a warp must run a macro (clamp the
    token, guard the stores).

    ``coefficients(tok, g, partial, bias, alpha, mx, c, line, pp, red)`` leaves c[e] = comb[i, j] (H_res[j, i])
    and pp[m] = H_pre[q] (q < n) or H_post[q - n] (n <= q < 2n).
    ``backward(tok, g, tx, partial, bias, alpha, dpre, dpost, dres, mx, c, dc, line, kept, pp, red)``, dpre
    [.., n] the token's dH_pre at row tok, leaves dc[e] the logit gradient of entry (i, j), pp[m] that of
    pre/post entry q, red[0:3] the three group sums of dlogit * mix, red[3] = r, and mx (the token's raw
    projections of these entries; mx[E + M2] its sum of squares). Writing them out is the caller's.
    """
    m = mixes_width(n)
    k = n * width
    layout = spread_layout(n)
    E, M2 = layout.entries, layout.gates  # matrix entries and pre/post entries per thread
    row_bits, slot_bits = layout.row_bits, layout.slot_bits  # xor offsets over j, over the row slot
    all_bits = row_bits + slot_bits
    row, column, gate = layout.row, layout.column, layout.gate
    steps = ["column"] + ["row", "column"] * (iterations - 1)
    offsets, at = [], 0
    for kind in steps:
        offsets.append(at)
        at += E if kind == "row" else 1
    kept_count = at
    entries = list(range(E))
    pps = list(range(M2))

    def scratch():
        """mx [E + M2 + 1], c, dc, line [E], pp [M2], red [4], all float32 locals."""
        sizes = (E + M2 + 1, E, E, E, M2, 4)
        return tuple(T.alloc_local((size,), "float32") for size in sizes)

    @T.macro
    def butterfly_sum(buf, idx, bits):
        for o in bits:
            buf[idx] = buf[idx] + T.shfl_xor(buf[idx], o)

    @T.macro
    def butterfly_max(buf, idx, bits):
        for o in bits:
            buf[idx] = T.max(buf[idx], T.shfl_xor(buf[idx], o))

    @T.macro
    def gather(partial, tok, q, dst, idx):
        dst[idx] = partial[0, tok, q]
        for s in T.serial(splits - 1):
            dst[idx] = dst[idx] + partial[s + 1, tok, q]

    @T.macro
    def load_token(tok, g, partial, mx, red):
        """The thread's raw projections and the token's sum of squares from the partials; red[3] = r."""
        for e in entries:
            gather(partial, tok, 2 * n + row(g, e) * n + column(g), mx, e)
        for p in pps:
            gather(partial, tok, T.min(gate(g, p), 2 * n - 1), mx, E + p)
        gather(partial, tok, m, mx, E + M2)
        red[3] = T.rsqrt(mx[E + M2] / T.float32(k) + T.float32(rms_eps))

    @T.macro
    def softmax_rows(g, a_res, bias, mx, c, line):
        for e in entries:
            c[e] = a_res * mx[e] + bias[2 * n + row(g, e) * n + column(g)]
            line[e] = c[e]
            butterfly_max(line, e, row_bits)
            c[e] = T.exp(c[e] - line[e])
            line[e] = c[e]
            butterfly_sum(line, e, row_bits)
            c[e] = c[e] * (T.float32(1.0) / line[e])

    @T.macro
    def sinkhorn(g, tx, a_res, bias, mx, c, line, kept):
        """The row softmax + eps and the 2t - 1 steps; with kept, each step's sums + eps kept there."""
        softmax_rows(g, a_res, bias, mx, c, line)
        for e in entries:
            c[e] = c[e] + T.float32(eps)
        for kind, off in zip(steps, offsets):
            if kind == "column":
                line[0] = sum([c[e] for e in entries])
                butterfly_sum(line, 0, slot_bits)
                line[0] = line[0] + T.float32(eps)
                if kept is not None:
                    kept[off, tx] = line[0]
                for e in entries:
                    c[e] = c[e] * (T.float32(1.0) / line[0])
            else:
                for e in entries:
                    line[e] = c[e]
                    butterfly_sum(line, e, row_bits)
                    line[e] = line[e] + T.float32(eps)
                    if kept is not None:
                        kept[off + e, tx] = line[e]
                    c[e] = c[e] * (T.float32(1.0) / line[e])

    @T.macro
    def coefficients(tok, g, partial, bias, alpha, mx, c, line, pp, red):
        load_token(tok, g, partial, mx, red)
        r = red[3]
        for p in pps:
            q = gate(g, p)
            z = T.if_then_else(q < n, alpha[0] * r, alpha[1] * r) * mx[E + p] + bias[T.min(q, 2 * n - 1)]
            pp[p] = T.if_then_else(q < n, T.sigmoid(z) + T.float32(eps), T.float32(2.0) * T.sigmoid(z))
        sinkhorn(g, 0, alpha[2] * r, bias, mx, c, line, None)

    @T.macro
    def backward(tok, g, tx, partial, bias, alpha, dpre, dpost, dres, mx, c, dc, line, kept, pp, red):
        load_token(tok, g, partial, mx, red)
        r = red[3]
        a_pre = alpha[0] * r
        a_post = alpha[1] * r
        a_res = alpha[2] * r
        # the pre and post entries: sigmoid backward
        for p in pps:
            q = gate(g, p)
            qc = T.min(q, 2 * n - 1)
            s = T.sigmoid(T.if_then_else(q < n, a_pre, a_post) * mx[E + p] + bias[qc])
            up = T.if_then_else(q < n, dpre[tok, T.min(q, n - 1)],
                                T.float32(2.0) * dpost[tok, T.max(qc - n, 0)])
            pp[p] = T.if_then_else(q < 2 * n, up * s * (T.float32(1.0) - s), T.float32(0))
        # Sinkhorn forward again, keeping each step's sums + eps
        sinkhorn(g, tx, a_res, bias, mx, c, line, kept)
        # comb holds H_res transposed: the gradient of comb[i, j] is dres[j, i]
        for e in entries:
            dc[e] = dres[tok, column(g), row(g, e)]
        for kind, off in zip(reversed(steps), reversed(offsets)):
            if kind == "column":
                line[0] = sum([dc[e] * c[e] for e in entries])
                butterfly_sum(line, 0, slot_bits)
                for e in entries:
                    dc[e] = (dc[e] - line[0]) * (T.float32(1.0) / kept[off, tx])
                    c[e] = c[e] * kept[off, tx]
            else:
                for e in entries:
                    line[e] = dc[e] * c[e]
                    butterfly_sum(line, e, row_bits)
                    dc[e] = (dc[e] - line[e]) * (T.float32(1.0) / kept[off + e, tx])
                    c[e] = c[e] * kept[off + e, tx]
        # softmax backward, on the softmax recomputed exactly
        softmax_rows(g, a_res, bias, mx, c, line)
        for e in entries:
            line[e] = dc[e] * c[e]
            butterfly_sum(line, e, row_bits)
            dc[e] = c[e] * (dc[e] - line[e])
        # the three groups' sums of dlogit * mix over the token's threads
        red[0] = sum([T.if_then_else(gate(g, p) < n, pp[p] * mx[E + p], T.float32(0)) for p in pps])
        red[1] = sum([T.if_then_else(gate(g, p) >= n, pp[p] * mx[E + p], T.float32(0)) for p in pps])
        red[2] = sum([dc[e] * mx[e] for e in entries])
        for i in [0, 1, 2]:
            butterfly_sum(red, i, all_bits)

    return SimpleNamespace(coefficients=coefficients, backward=backward, scratch=scratch, kept_count=kept_count)
