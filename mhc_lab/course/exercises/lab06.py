"""Lab 06 exercises: the fused mHC forward. The post kernel and the layer input as tile programs for TileLang's C
target, the coefficient logits with the RMS norm after the projection, the bytes of each plan, phi's traffic.

The kernel checks compile the learner's factory for target "c" and run it on random inputs of awkward shapes
(token counts 1, 7, 33 that are not multiples of the tile; odd widths C; n = 1, 2, 4, 8), every output poisoned
with NaN and followed by NaN guard rows, against the float64 reference of mhc_lab.reference.
"""

from __future__ import annotations

import math

import tilelang.language as T
import torch

from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, expect_number, randn, register
from mhc_lab.course.tile_checks import compile_learner_program
from mhc_lab.kernels._target import compile_program
from mhc_lab.course.forward_lab import (
    PLANS,
    logits_norm_first,
    phi_bytes_per_token,
    site_lane_bytes,
)
from mhc_lab.reference import mhc_post, mhc_pre
from mhc_lab.reference.mhc import mixes_width

_TAIL = ("This looks like the usual mistake: forgetting the tail. When the token count is not a multiple of "
         "block_tokens the last tile hangs over the end")


# TileLang guards every access to a tensor of dynamic shape by itself, unless told not to: compiled that way a
# program without its own tail guard still runs right, and a GPU program built without the guards would not.
_AS_WRITTEN = {"tl.disable_safe_memory_legalize": True}


def _compile_as_written(answer, args: tuple, case: str):
    """The learner's program compiled exactly as written, without TileLang's own bounds guards, so that a missing
    tail guard writes past the last token (call compile_learner_program first: it explains a failing build)."""
    program = call(answer, *args, case=case)
    if getattr(type(program), "_mhc_lab_remote", False):
        return program._session.apply("mhc_lab.kernels._target.compile_program", program, "c", _AS_WRITTEN)
    return compile_program(program, "c", _AS_WRITTEN)


def _extra(tokens: int, block_tokens: int) -> int:
    """Guard rows after every tensor: room for a grid of `tokens` instances of block_tokens tokens (a wrong grid)."""
    return tokens * block_tokens + block_tokens + 8


def _tokens(tokens: int, shape: tuple, block_tokens: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random float32 [tokens, *shape]: a view of a taller tensor, so reading past the last token reads numbers."""
    return randn(tokens + _extra(tokens, block_tokens), *shape, seed=seed, dtype=torch.float32, scale=scale)[:tokens]


def _run(kernel, inputs: list, out_shape: tuple, tokens: int, block_tokens: int, case: str):
    """``kernel(*inputs, out)`` with out poisoned (NaN) and followed by NaN guard rows; returns (out, whether
    anything was written past the last token)."""
    storage = torch.full((tokens + _extra(tokens, block_tokens), *out_shape), float("nan"))
    out = storage[:tokens]
    try:
        kernel(*inputs, out)
    except Exception as error:
        last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        raise CheckFailed(f"{case}: running your compiled program failed: {type(error).__name__}: {last}") from None
    return out, not torch.isnan(storage[tokens:]).all().item()


def _tail_checks(out: torch.Tensor, wrote_past_end: bool, tokens: int, block_tokens: int, case: str):
    """Name the tail mistakes: writing past the end, a grid of tokens // block_tokens, no tile offset."""
    if wrote_past_end:
        raise CheckFailed(f"{case}: your program wrote past token {tokens - 1}, the last one: the tail guard is "
                          "missing. When the token count is not a multiple of block_tokens the last tile hangs over "
                          "the end: guard the tokens with `if t < tokens:` before touching memory.")
    missing = torch.isnan(out.reshape(tokens, -1)).all(dim=1)
    if not missing.any():
        return
    unwritten = missing.nonzero().flatten().tolist()
    floor_tokens = list(range(tokens // block_tokens * block_tokens, tokens))
    if unwritten == floor_tokens:
        which = f"token {tokens - 1} was" if len(floor_tokens) == 1 else f"tokens {floor_tokens[0]}..{tokens - 1} were"
        raise CheckFailed(f"{case}: {which} never written (still NaN). {_TAIL}: the grid needs "
                          "T.ceildiv(tokens, block_tokens) instances, not tokens // block_tokens.")
    if unwritten == list(range(block_tokens, tokens)):
        raise CheckFailed(f"{case}: only tokens 0..{block_tokens - 1} were written: every instance wrote the same "
                          "first tokens. This looks like the usual mistake: forgetting the tile's offset. Instance b "
                          "owns tokens t = b * block_tokens + k, for k in T.serial(block_tokens).")
    instances = -(-tokens // block_tokens)
    if unwritten == list(range(instances, tokens)) and instances > 1:
        raise CheckFailed(f"{case}: only tokens 0..{instances - 1} were written. This looks like the usual mistake: "
                          "one token per instance. Instance b owns block_tokens tokens, b * block_tokens + k for k "
                          "in T.serial(block_tokens).")
    raise CheckFailed(f"{case}: {len(unwritten)} of {tokens} tokens of the output were never written (still NaN), "
                      f"the first is token {unwritten[0]}. Every token t < tokens must be written by one instance.")


# ---- 6.1 the post kernel ---------------------------------------------------------------------------------

_POST_CONFIGS = [(4, 37, 4, (33, 7, 1)), (1, 5, 3, (7, 1)), (2, 33, 2, (7,)), (8, 9, 4, (33, 1))]
_TRANSPOSED = ("H_res transposed. New lane i is sum_j res[t, i, j] x[t, j, c]: the first index of res is the "
               "output lane i, the second the input lane j (you used res[t, j, i]).")
_POST_LANE = ("H_post without its lane index. Lane i gets post[t, i] * f[t, c] once; you used one H_post for "
              "every lane (post[t, j] summed inside the loop over j, or the same entry for all lanes).")


def _post_variant(kind: str):
    def factory(n: int, C: int, block_tokens: int):
        tokens = T.dynamic("tokens")
        grid = tokens // block_tokens if kind == "floor_grid" else T.ceildiv(tokens, block_tokens)

        @T.prim_func
        def post_kernel(x: T.Tensor((tokens, n, C), "float32"), f: T.Tensor((tokens, C), "float32"),
                        post: T.Tensor((tokens, n), "float32"), res: T.Tensor((tokens, n, n), "float32"),
                        out: T.Tensor((tokens, n, C), "float32")):
            with T.Kernel(grid) as b:
                acc = T.alloc_local((1,), "float32")
                for k in T.serial(block_tokens):
                    t = b * block_tokens + k
                    if kind == "no_guard" or t < tokens:
                        for c, i in T.grid(C, n):
                            if kind == "post_in_sum":
                                acc[0] = 0.0
                            else:
                                acc[0] = post[t, i] * f[t, c]
                            for j in T.serial(n):
                                if kind == "transposed":
                                    acc[0] += res[t, j, i] * x[t, j, c]
                                elif kind == "post_in_sum":
                                    acc[0] += res[t, i, j] * x[t, j, c] + post[t, j] * f[t, c]
                                else:
                                    acc[0] += res[t, i, j] * x[t, j, c]
                            out[t, i, c] = acc[0]

        return post_kernel

    factory.__name__ = f"post_{kind}"
    return factory


@register(
    "6.1", "the post kernel",
    hints=[
        "Same frame as lab 05: a grid of T.ceildiv(tokens, block_tokens) instances, instance b owns tokens "
        "t = b * block_tokens + k, guarded by `if t < tokens:`. For each token, each channel c, each output lane i: "
        "one sum over the input lanes j.",
        "Start the sum of lane i from its H_post term, acc[0] = post[t, i] * f[t, c], then add res[t, i, j] * "
        "x[t, j, c] for j in T.serial(n), and store out[t, i, c] = acc[0]. With lanes = T.alloc_local((n,), "
        "\"float32\") and acc = T.alloc_local((1,), \"float32\") inside the kernel, loading x[t, :, c] into lanes "
        "first reads each element of x once.",
        "for k in T.serial(block_tokens): t = b * block_tokens + k; if t < tokens: for c in T.serial(C): "
        "(for j: lanes[j] = x[t, j, c]); for i in T.serial(n): acc[0] = post[t, i] * f[t, c]; "
        "for j in T.serial(n): acc[0] += res[t, i, j] * lanes[j]; out[t, i, c] = acc[0]",
    ],
    library="mhc_lab.course.forward_lab.post_program",
    mistakes=[
        Mistake(_post_variant("transposed"), "H_res transposed"),
        Mistake(_post_variant("post_in_sum"), "H_post without its lane index"),
        Mistake(_post_variant("floor_grid"), "forgetting the tail"),
        Mistake(_post_variant("no_guard"), "the tail guard is missing"),
    ],
)
def _check_post(answer):
    cases = []
    for first, (n, C, bt, token_counts) in enumerate(_POST_CONFIGS):
        kernel = compile_learner_program(answer, (n, C, bt), f"n={n}, C={C}, block_tokens={bt}")
        if first == 0:  # one build without TileLang's own guards: does the program guard its tail itself?
            kernel = _compile_as_written(answer, (n, C, bt), f"n={n}, C={C}, block_tokens={bt}")
        for k, tokens in enumerate(token_counts):
            case = f"tokens={tokens}, n={n}, C={C}, block_tokens={bt}"
            seed = 1000 * n + 10 * C + k
            x, f = _tokens(tokens, (n, C), bt, seed), _tokens(tokens, (C,), bt, seed + 1)
            post, res = _tokens(tokens, (n,), bt, seed + 2), _tokens(tokens, (n, n), bt, seed + 3)
            out, past = _run(kernel, [x, f, post, res], (n, C), tokens, bt, case)
            _tail_checks(out, past, tokens, bt, case)
            x64, f64, post64, res64 = x.double(), f.double(), post.double(), res.double()
            mistakes = {
                _TRANSPOSED: mhc_post(x64, f64, post64, res64.transpose(-1, -2)),
                _POST_LANE: mhc_post(x64, f64, post64.sum(dim=-1, keepdim=True).expand(-1, n), res64),
                _POST_LANE + " ": mhc_post(x64, f64, post64[:, :1].expand(-1, n), res64),
                "the H_post term is missing its coefficient: lane i gets post[t, i] * f[t, c], not f[t, c].":
                    mhc_post(x64, f64, torch.ones_like(post64), res64),
                "the layer output f is missing: lane i gets post[t, i] * f[t, c] added to its mix.":
                    mhc_post(x64, torch.zeros_like(f64), post64, res64),
            }
            assert_close(out, mhc_post(x64, f64, post64, res64).float(), case=case, name="out", mistakes=mistakes)
            cases.append(case)
    return cases


# ---- 6.2 the layer input -----------------------------------------------------------------------------------

_INPUT_CONFIGS = [(4, 37, 4, (33, 7, 1)), (1, 5, 3, (7,)), (8, 9, 2, (7, 1)), (2, 33, 4, (33,))]


def _input_variant(kind: str):
    def factory(n: int, C: int, block_tokens: int):
        tokens = T.dynamic("tokens")
        grid = tokens // block_tokens if kind == "floor_grid" else T.ceildiv(tokens, block_tokens)

        @T.prim_func
        def layer_input(x: T.Tensor((tokens, n, C), "float32"), pre: T.Tensor((tokens, n), "float32"),
                        y: T.Tensor((tokens, C), "float32")):
            with T.Kernel(grid) as b:
                acc = T.alloc_local((1,), "float32")
                for k in T.serial(block_tokens):
                    t = b * block_tokens + k
                    if kind == "no_guard" or t < tokens:
                        for c in T.serial(C):
                            acc[0] = 0.0
                            for j in T.serial(n):
                                if kind == "unweighted":
                                    acc[0] += x[t, j, c]
                                elif kind == "instance":
                                    acc[0] += pre[b, j] * x[t, j, c]
                                else:
                                    acc[0] += pre[t, j] * x[t, j, c]
                            y[t, c] = acc[0]

        return layer_input

    factory.__name__ = f"layer_input_{kind}"
    return factory


@register(
    "6.2", "the layer input H_pre x",
    hints=[
        "The frame of 6.1 again (grid, tile offset, tail guard); per token and channel one weighted sum over the "
        "n lanes, written once to y[t, c].",
        "Reset the running sum for every channel: acc[0] = 0.0, then acc[0] += pre[t, j] * x[t, j, c] for j in "
        "T.serial(n), then y[t, c] = acc[0]. The weights belong to token t.",
        "for k in T.serial(block_tokens): t = b * block_tokens + k; if t < tokens: for c in T.serial(C): "
        "acc[0] = 0.0; for j in T.serial(n): acc[0] += pre[t, j] * x[t, j, c]; y[t, c] = acc[0]",
    ],
    library="mhc_lab.course.forward_lab.layer_input_program",
    mistakes=[
        Mistake(_input_variant("unweighted"), "without the weights H_pre"),
        Mistake(_input_variant("instance"), "instance index b"),
        Mistake(_input_variant("floor_grid"), "forgetting the tail"),
        Mistake(_input_variant("no_guard"), "the tail guard is missing"),
    ],
)
def _check_layer_input(answer):
    cases = []
    for first, (n, C, bt, token_counts) in enumerate(_INPUT_CONFIGS):
        kernel = compile_learner_program(answer, (n, C, bt), f"n={n}, C={C}, block_tokens={bt}")
        if first == 0:  # as in 6.1: the tail guard is the program's own
            kernel = _compile_as_written(answer, (n, C, bt), f"n={n}, C={C}, block_tokens={bt}")
        for k, tokens in enumerate(token_counts):
            case = f"tokens={tokens}, n={n}, C={C}, block_tokens={bt}"
            seed = 2000 * n + 10 * C + k
            x, pre = _tokens(tokens, (n, C), bt, seed), _tokens(tokens, (n,), bt, seed + 1)
            y, past = _run(kernel, [x, pre], (C,), tokens, bt, case)
            _tail_checks(y, past, tokens, bt, case)
            x64, pre64 = x.double(), pre.double()
            instance_pre = pre64[torch.arange(tokens) // bt]
            mistakes = {
                "the lanes were summed without the weights H_pre: y[t, c] = sum_j pre[t, j] x[t, j, c].":
                    x64.sum(dim=1),
                "the lanes were averaged; the layer input weighs them with H_pre: sum_j pre[t, j] x[t, j, c].":
                    x64.mean(dim=1),
                "H_pre was read with the instance index b instead of the token t: use pre[t, j].":
                    mhc_pre(x64, instance_pre),
            }
            assert_close(y, mhc_pre(x64, pre64).float(), case=case, name="y", mistakes=mistakes)
            cases.append(case)
    return cases


# ---- 6.3 the logits with the norm after the projection --------------------------------------------------


def _gates(alpha, n):
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])


def _logits_kind(kind: str):
    def logits(x, phi, bias, alpha, rms_eps=1e-6):
        n, C = x.shape[-2:]
        flat = x.reshape(*x.shape[:-2], n * C)
        mixes = flat @ phi.t()
        sum_sq = flat.pow(2).sum(dim=-1, keepdim=True)
        r = torch.sqrt(sum_sq / (n * C) + rms_eps)
        g = _gates(alpha, n)
        if kind == "times_rms":
            return g * mixes * r + bias
        if kind == "bias_scaled":
            return (g * mixes + bias) / r
        if kind == "lane_width":
            return g * mixes / torch.sqrt(sum_sq / C + rms_eps) + bias
        if kind == "no_alpha":
            return mixes / r + bias
        if kind == "all_tokens":
            return g * mixes / torch.sqrt(flat.pow(2).mean() + rms_eps) + bias
        raise ValueError(kind)

    logits.__name__ = f"logits_{kind}"
    return logits


_LOGIT_MISTAKES = {
    "times_rms": "you multiplied by the RMS r instead of dividing by it: the norm scales by 1 / r (Eq. 16).",
    "bias_scaled": "the bias b was scaled by 1 / r too. Eq. 16 scales only alpha * mixes; b is added after.",
    "lane_width": "the mean of the squares was taken over C; the row is the whole flattened stream, n * C wide "
                  "(Eq. 15: r = ||x|| / sqrt(nC)).",
    "no_alpha": "the gates alpha are missing: alpha[0] scales the n pre logits, alpha[1] the n post logits, "
                "alpha[2] the n^2 res logits.",
    "all_tokens": "one norm for all tokens: the RMS is per token, a mean over that token's n * C values only.",
}
_LOGIT_CASES = [((7,), 4, 33), ((1,), 1, 5), ((33,), 2, 37), ((7,), 8, 9), ((2, 3), 4, 16)]


@register(
    "6.3", "the logits with the norm after the projection",
    hints=[
        "Flatten each token's lanes to one row of n * C values. One walk over the raw row gives both the "
        "projection mixes = flat @ phi.t() (Eq. 14) and the sum of squares (Eq. 15).",
        "r = sqrt(mean of the squares over the n * C values + rms_eps), one number per token (keepdim=True). "
        "Then Eq. 16: alpha * mixes / r + bias, with alpha[0] on the first n outputs, alpha[1] on the next n, "
        "alpha[2] on the last n^2.",
        "flat = x.reshape(*x.shape[:-2], n * C); mixes = flat @ phi.t(); r = torch.sqrt(flat.pow(2).mean(-1, "
        "keepdim=True) + rms_eps); gates = torch.cat([alpha[0].expand(n), alpha[1].expand(n), "
        "alpha[2].expand(n * n)]); return gates * mixes / r + bias",
    ],
    library="mhc_lab.course.forward_lab.logits_norm_after",
    mistakes=[
        Mistake(_logits_kind("times_rms"), "multiplied by the RMS"),
        Mistake(_logits_kind("bias_scaled"), "bias b was scaled"),
        Mistake(_logits_kind("lane_width"), "n * C wide"),
        Mistake(_logits_kind("no_alpha"), "gates alpha are missing"),
        Mistake(_logits_kind("all_tokens"), "one norm for all tokens"),
    ],
)
def _check_logits(answer):
    cases = []
    for k, (lead, n, C) in enumerate(_LOGIT_CASES):
        case = f"x of shape {(*lead, n, C)}"
        m = mixes_width(n)
        # tokens of very different sizes, so that the norm matters
        x = randn(*lead, n, C, seed=600 + k) * torch.exp(randn(*lead, 1, 1, seed=700 + k)) * 3.0
        phi = randn(m, n * C, seed=800 + k) / (n * C) ** 0.5
        bias, alpha = randn(m, seed=900 + k) * 0.5, randn(3, seed=950 + k).abs() + 0.5
        # the expected values come from the other order: the norm first, as the reference computes it (Eq. 7);
        # they and the mistakes are computed before the learner's function runs
        expected = logits_norm_first(x, phi, bias, alpha)
        mistakes = {text: _logits_kind(kind)(x, phi, bias, alpha) for kind, text in _LOGIT_MISTAKES.items()}
        got = call(answer, x, phi, bias, alpha, case=case)
        assert_close(got, expected, case=case, name="logits", mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 6.4 bytes of each plan --------------------------------------------------------------------------------


def _bytes_split_once(n, C, plan, itemsize=2):
    return site_lane_bytes(n, C, "one_pass" if plan == "split" else plan, itemsize)


def _bytes_one_short(n, C, plan, itemsize=2):
    return site_lane_bytes(n, C, plan, itemsize) - (C * itemsize if plan != "unfused" else 0)


def _bytes_elements(n, C, plan, itemsize=2):
    return site_lane_bytes(n, C, plan, 1)


@register(
    "6.4", "bytes per token of each plan",
    hints=[
        "Count lane-wide tensors only (x, the layer input y, the layer output f, the new lanes), each element "
        "itemsize bytes. one_pass: pre reads x (n C) and writes y (C); post reads x and f ((n + 1) C) and writes "
        "the new lanes (n C).",
        "split: the pre side walks x twice (once for the coefficients, once for H_pre x), so it reads n C more "
        "than one_pass. unfused: lab 04's Table 2 rows, (8n + 2) C elements.",
        "one_pass: (3n + 2) C itemsize; split: (4n + 2) C itemsize; unfused: (8n + 2) C itemsize.",
    ],
    library="mhc_lab.course.forward_lab.site_lane_bytes",
    mistakes=[
        Mistake(_bytes_split_once, "reads x twice"),
        Mistake(_bytes_one_short, "one C short"),
        Mistake(_bytes_elements, "elements, not bytes"),
    ],
)
def _check_plan_bytes(answer):
    cases = []
    for n, C, itemsize in [(4, 4096, 2), (1, 37, 2), (8, 7, 4), (2, 1, 2)]:
        for plan in PLANS:
            case = f"plan={plan!r}, n={n}, C={C}, itemsize={itemsize}"
            got = call(answer, n, C, plan, itemsize, case=case)
            want = site_lane_bytes(n, C, plan, itemsize)
            explain = ""
            try:
                value = float(got)
                if plan == "split" and value == site_lane_bytes(n, C, "one_pass", itemsize):
                    explain = ("That is the one-pass count. This looks like the usual mistake: the split plan reads "
                               "x twice (projection pass, then the H_pre x pass): n C more.")
                elif value == want - C * itemsize:
                    explain = ("You are one C short: count the layer output f that post reads and the layer input y "
                               "that pre writes, C elements each.")
                elif itemsize > 1 and value == want / itemsize:
                    explain = f"You counted elements, not bytes: multiply by itemsize ({itemsize})."
            except (TypeError, ValueError):
                pass
            expect_number(got, want, case=case, name="bytes per token", explain=explain)
            cases.append(case)
    return cases


# ---- 6.5 phi's traffic per token ---------------------------------------------------------------------------


@register(
    "6.5", "phi's bytes per token",
    hints=[
        "phi has n^2 + 2n rows (pre, post, res) of n C float32 values: 4 (n^2 + 2n) n C bytes.",
        "A tile of tile_tokens tokens reads phi once and shares it: each token's part is phi's bytes divided by "
        "tile_tokens.",
        "4 * (n * n + 2 * n) * n * C / tile_tokens",
    ],
    library="mhc_lab.course.forward_lab.phi_bytes_per_token",
    mistakes=[
        Mistake(lambda n, C, tile_tokens: 4 * (n * n + 2 * n) * n * C, "once per tile"),
        Mistake(lambda n, C, tile_tokens: 4 * n * n * n * C / tile_tokens, "n^2 + 2n rows"),
        Mistake(lambda n, C, tile_tokens: 2 * (n * n + 2 * n) * n * C / tile_tokens, "float32"),
        Mistake(lambda n, C, tile_tokens: 4 * (n * n + 2 * n) * n * C // tile_tokens, "integer division"),
    ],
)
def _check_phi_bytes(answer):
    cases = []
    for n, C, tile in [(4, 4096, 7), (4, 4096, 256), (1, 37, 1), (8, 7168, 64), (2, 5, 3)]:
        case = f"n={n}, C={C}, tile_tokens={tile}"
        got = call(answer, n, C, tile, case=case)
        want = phi_bytes_per_token(n, C, tile)
        explain = ""
        try:
            value = float(got)
            if tile > 1 and abs(value - want * tile) <= 1e-9 * want * tile:
                explain = "That is all of phi for every token: a tile reads phi once per tile and shares it."
            elif abs(value - 4 * n**3 * C / tile) <= 1e-9 * want:
                explain = "You counted only the n^2 res rows: phi has n^2 + 2n rows (pre, post and res)."
            elif abs(value - want / 2) <= 1e-9 * want:
                explain = "phi is float32, 4 bytes per entry (the GPU kernels take it as two bf16 halves: 4 too)."
            elif value == math.floor(want) != want:
                explain = (f"That is {want:,.3f} rounded down: integer division (// or int()). A token's share of phi "
                           "is a fraction of a byte when tile_tokens does not divide phi's bytes: divide with /.")
        except (TypeError, ValueError):
            pass
        expect_number(got, want, case=case, name="phi bytes per token", explain=explain)
        cases.append(case)
    return cases
