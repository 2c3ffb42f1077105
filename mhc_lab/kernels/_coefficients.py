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


def mixes_width(n: int) -> int:
    return n * n + 2 * n


def coefficient_macro(n: int, width: int, *, iterations: int = 20, eps: float = 1e-6, rms_eps: float = 1e-6):
    """A T.macro ``coefficients(mix, alpha, bias, pre, post, comb)`` over thread-local arrays.

    mix: [n^2 + 2n + 1] raw x.phi^T then sum(x^2); pre, post: [n]; comb: [n * n], row-major, comb[i * n + j],
    left *untransposed* (H_res[i, j] = comb[j * n + i]).
    """
    m = mixes_width(n)
    k = n * width
    rows = list(range(n))

    @T.macro
    def coefficients(mix, alpha, bias, pre, post, comb):
        r = T.rsqrt(mix[m] / T.float32(k) + T.float32(rms_eps))
        a_pre = alpha[0] * r
        a_post = alpha[1] * r
        a_res = alpha[2] * r
        for i in T.unroll(n):
            pre[i] = T.sigmoid(a_pre * mix[i] + bias[i]) + T.float32(eps)
            post[i] = T.float32(2.0) * T.sigmoid(a_post * mix[n + i] + bias[n + i])
        for q in T.unroll(n * n):
            comb[q] = a_res * mix[2 * n + q] + bias[2 * n + q]
        # softmax over each row, + eps
        for i in T.unroll(n):
            row_max = comb[i * n]
            for j in rows[1:]:
                row_max = T.max(row_max, comb[i * n + j])
            for j in T.unroll(n):
                comb[i * n + j] = T.exp(comb[i * n + j] - row_max)
            inv = T.float32(1.0) / sum([comb[i * n + j] for j in rows])
            for j in T.unroll(n):
                comb[i * n + j] = comb[i * n + j] * inv + T.float32(eps)
        # one column normalisation, then (t - 1) rounds of rows and columns
        for j in T.unroll(n):
            inv = T.float32(1.0) / (sum([comb[i * n + j] for i in rows]) + T.float32(eps))
            for i in T.unroll(n):
                comb[i * n + j] = comb[i * n + j] * inv
        for _ in T.serial(iterations - 1):
            for i in T.unroll(n):
                inv = T.float32(1.0) / (sum([comb[i * n + j] for j in rows]) + T.float32(eps))
                for j in T.unroll(n):
                    comb[i * n + j] = comb[i * n + j] * inv
            for j in T.unroll(n):
                inv = T.float32(1.0) / (sum([comb[i * n + j] for i in rows]) + T.float32(eps))
                for i in T.unroll(n):
                    comb[i * n + j] = comb[i * n + j] * inv

    return coefficients
