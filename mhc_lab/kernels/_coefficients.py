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


import tilelang.language as T


TOKEN_THREADS = 128  # threads (= tokens) per CTA of the kernels that run one token's coefficients per thread


def mixes_width(n: int) -> int:
    return n * n + 2 * n


def _sinkhorn_macros(n: int, eps: float, sums_at: int | None = None):
    """The DeepSeek-V4 Sinkhorn's pieces on a thread-local comb [n * n] (row-major), shared by the forward
    and the backward: the row softmax of the logits, a column step and a row step. A step divides by the
    column (row) sums + eps; given an array ``inv`` it also keeps the n reciprocals at ``inv[step * n:]``, and
    with ``sums_at`` the n sums + eps themselves at ``inv[sums_at + step * n:]``."""
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
    def normalise(comb, inv, step, at):
        """One Sinkhorn step over the n lines of comb; at(line, k) is the flat index of a line's k-th entry."""
        for a in T.unroll(n):
            total = sum([comb[at(a, b)] for b in rows]) + T.float32(eps)
            scale = T.float32(1.0) / total
            if inv is not None:
                inv[step * n + a] = scale
                if sums_at is not None:
                    inv[sums_at + step * n + a] = total
            for b in T.unroll(n):
                comb[at(a, b)] = comb[at(a, b)] * scale

    def column_step(comb, inv, step):
        normalise(comb, inv, step, lambda j, i: i * n + j)

    def row_step(comb, inv, step):
        normalise(comb, inv, step, lambda i, j: i * n + j)

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
                               rms_eps: float = 1e-6, keep_sums: bool = False):
    """A T.macro ``coefficients_backward(mix, alpha, bias, dpre, dpost, dres, comb, dcomb, inv, dlogit, dmix,
    extra)``: the backward of ``coefficient_macro`` for one token, all in thread-local arrays.

    In: mix [n^2+2n+1] (raw projections, then sum(x^2)), dpre, dpost [n], dres [n*n] with dres[i*n+j] the
    gradient of H_res[i, j]. Scratch: comb, dcomb [n*n], inv [sinkhorn_steps(t) * n], twice that with
    keep_sums.
    Out: dlogit [n^2+2n] (the gradient of each pre-activation, which is also the bias gradient), dmix
    [n^2+2n] (the gradient of each raw projection: dlogit * alpha_k * r), extra [4] = the three alpha
    gradients and the gradient of sum(x^2).

    The Sinkhorn backward recomputes the forward on chip and keeps only each step's n reciprocal sums
    (t = 20, n = 4: 156 floats), never the intermediate matrices. A row step Q = P / (rowsum(P) + eps)
    has the backward dP = (dQ - rowsum(dQ * Q)) / (rowsum(P) + eps), which needs Q (the state after the
    step) and the reciprocal; the state before the step is recovered as P = Q / reciprocal. With keep_sums the
    forward also keeps each step's sums, and P = Q * sum: a multiplication where the default divides (n^2
    IEEE divisions per step in each token's serial chain; the two differ in the last bits).
    """
    m = mixes_width(n)
    k = n * width
    rows = list(range(n))
    groups = [list(range(n)), list(range(n, 2 * n)), list(range(2 * n, m))]

    sums_at = sinkhorn_steps(iterations) * n if keep_sums else None
    softmax_rows, column_step, row_step = _sinkhorn_macros(n, eps, sums_at)

    @T.macro
    def normalise_backward(comb, dcomb, inv, step, at):
        """The backward of one step: dP = (dQ - <dQ, Q>_line) * reciprocal, then P = Q / reciprocal (or
        Q * sum, with keep_sums)."""
        for a in T.unroll(n):
            dot = sum([dcomb[at(a, b)] * comb[at(a, b)] for b in rows])
            for b in T.unroll(n):
                dcomb[at(a, b)] = (dcomb[at(a, b)] - dot) * inv[step * n + a]
                if sums_at is not None:
                    comb[at(a, b)] = comb[at(a, b)] * inv[sums_at + step * n + a]
                else:
                    comb[at(a, b)] = comb[at(a, b)] / inv[step * n + a]

    def column_step_backward(comb, dcomb, inv, step):
        normalise_backward(comb, dcomb, inv, step, lambda j, i: i * n + j)

    def row_step_backward(comb, dcomb, inv, step):
        normalise_backward(comb, dcomb, inv, step, lambda i, j: i * n + j)

    @T.macro
    def coefficients_backward(mix, alpha, bias, dpre, dpost, dres, comb, dcomb, inv, dlogit, dmix, extra):
        r = T.rsqrt(mix[m] / T.float32(k) + T.float32(rms_eps))
        a_pre = alpha[0] * r
        a_post = alpha[1] * r
        a_res = alpha[2] * r
        for i in T.unroll(n):
            s_pre = T.sigmoid(a_pre * mix[i] + bias[i])
            dlogit[i] = dpre[i] * s_pre * (T.float32(1.0) - s_pre)
            s_post = T.sigmoid(a_post * mix[n + i] + bias[n + i])
            dlogit[n + i] = dpost[i] * T.float32(2.0) * s_post * (T.float32(1.0) - s_post)
        # Sinkhorn forward again, keeping the reciprocal sums of every step
        softmax_rows(comb, a_res, mix, bias)
        for q in T.unroll(n * n):
            comb[q] = comb[q] + T.float32(eps)
        column_step(comb, inv, 0)
        for it in T.serial(iterations - 1):
            row_step(comb, inv, 2 * it + 1)
            column_step(comb, inv, 2 * it + 2)
        # comb holds H_res transposed: the gradient of comb[i * n + j] is dres[j * n + i]
        for i in T.unroll(n):
            for j in T.unroll(n):
                dcomb[i * n + j] = dres[j * n + i]
        for it in T.serial(iterations - 1):
            back = iterations - 2 - it
            column_step_backward(comb, dcomb, inv, 2 * back + 2)
            row_step_backward(comb, dcomb, inv, 2 * back + 1)
        column_step_backward(comb, dcomb, inv, 0)
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
