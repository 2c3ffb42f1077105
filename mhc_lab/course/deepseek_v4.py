"""Lab 08, section 7 (mHC in transformers' DeepSeek-V4): a tiny random DeepSeek-V4, its HyperConnection modules in
our terms, the model run by mhc_lab.ops (mhc_lab.integrations.transformers.use_mhc_lab) against itself as
transformers runs it, and one training step of both timed.

    TRANSFORMERS, INSTALL                      transformers' version (None where DeepSeek-V4 does not import) and
                                               how to install it
    tiny_model(seed)                           the benchmark's CPU model (float32) and one sequence of token ids
    describe(model)                            its layers and what each HyperConnection's parameters are to us
    hyper_connection_outputs(fn, base, scale, x)
                                               exercise 8.6: what a HyperConnection returns, (post, comb,
                                               collapsed), through our reference
    hyper_connection(n, C, generator)          a HyperConnection module with random parameters (8.6's checks)
    run_step(model, ids), comparison_table(...) logits, loss and every gradient; unpatched against use_mhc_lab
    bfloat16_table(seed)                       the same in bfloat16, each against the same weights in float32
    time_steps(...), timing_table(shape)       on a GPU: the benchmark's step, forward and memory of both kinds
    timing_note(recorded)                      elsewhere: what timing needs, and the H200's recording where present
"""

from __future__ import annotations

import copy
import math

import torch

from mhc_lab.bench.deepseek_v4 import (
    CPU_SHAPES,
    KINDS,
    LAYERS,
    PASSES,
    bench_deepseek_v4,
    gradient_gap,
    model_config,
    random_model,
    require_transformers,
    token_ids,
)
from mhc_lab.course import step_time
from mhc_lab.integrations.transformers import use_mhc_lab
from mhc_lab.reference import mhc_coefficients, mhc_pre

INSTALL = "pip install 'mhc-lab[transformers]'"
TINY = (*CPU_SHAPES[0], LAYERS)  # tokens, width, layers: the benchmark's model on a CPU

# Imported here, with the lab's checks, rather than inside exercise 8.6's check: transformers takes seconds to
# import, and the grader runs each check under a time limit.
try:
    TRANSFORMERS = require_transformers()
except ImportError:
    TRANSFORMERS = None


def not_installed() -> str:
    return (f"transformers with DeepSeek-V4 is not installed here, so this section skips its cells; install the "
            f"optional extra to run it: {INSTALL}")


# ---- the model ------------------------------------------------------------------------------------------------


def tiny_model(seed: int = 0):
    """(model, token ids): a tiny random DeepseekV4ForCausalLM in float32 on the CPU (the benchmark's CPU shape:
    4 layers of width 64, n = 4 lanes) and one sequence of 32 token ids; (None, None) without transformers."""
    if TRANSFORMERS is None:
        return None, None
    tokens, hidden, layers = TINY
    config = model_config(hidden, layers, tokens)
    return random_model(config, seed=seed), token_ids(config, tokens, seed=seed)


def describe(model) -> str:
    """The model's decoder layers (attention and MoE kinds, the two HyperConnections each) and the map from a
    HyperConnection's parameters to our site's."""
    if model is None:
        return not_installed()
    config = model.config
    n, C = config.hc_mult, config.hidden_size
    hc = model.model.layers[0].attn_hc
    lines = [f"{type(model).__name__}: {config.num_hidden_layers} decoder layers, n = {n} lanes of C = {C}, "
             f"{sum(p.numel() for p in model.parameters()):,} parameters"]
    for i, (attention, moe) in enumerate(zip(config.layer_types, config.mlp_layer_types)):
        lines.append(f"  layer {i}: attn_hc around {attention}, ffn_hc around {moe}")
    lines += [
        "Each HyperConnection (attn_hc, ffn_hc), in our terms:",
        f"  fn    {list(hc.fn.shape)} = phi: rows 0-{n - 1} pre, {n}-{2 * n - 1} post, {2 * n}-{n * n + 2 * n - 1} res",
        f"  base  {list(hc.base.shape)} = bias, the same order",
        f"  scale {list(hc.scale.shape)} = alpha: pre, post, res",
        f"  its forward returns post [batch, tokens, {n}] = H_post, comb [batch, tokens, {n}, {n}] = H_res "
        f"transposed,",
        f"  and the layer input collapsed [batch, tokens, {C}] = H_pre x",
    ]
    return "\n".join(lines)


def hyper_connection_outputs(fn, base, scale, x):
    """Exercise 8.6. What DeepSeek-V4's HyperConnection with parameters fn, base, scale returns for lanes x
    [batch, tokens, n, C], (post, comb, collapsed), through our reference: phi, bias, alpha are fn, base, scale as
    they stand (rows and entries [pre, post, res]), and comb is H_res transposed (the layer applies comb^T)."""
    pre, post, res = mhc_coefficients(x, fn, base, scale)
    return post, res.transpose(-1, -2), mhc_pre(x, pre)


def hyper_connection(n: int, C: int, generator: torch.Generator, spread: float = 1.0):
    """transformers' DeepseekV4HyperConnection for n lanes of width C, float32, its parameters drawn from
    ``generator``: fn ~ N(0, (spread / sqrt(nC))^2), base ~ N(0, spread^2), scale 0.6, 1.3 and 1.9 in a random
    order (three distinct entries, so that reading them in another order shows)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    module = DeepseekV4HyperConnection(DeepseekV4Config(hidden_size=C, hc_mult=n))
    with torch.no_grad():
        module.fn.copy_(torch.randn(module.fn.shape, generator=generator) * spread / math.sqrt(n * C))
        module.base.copy_(torch.randn(module.base.shape, generator=generator) * spread)
        module.scale.copy_(torch.tensor([0.6, 1.3, 1.9])[torch.randperm(3, generator=generator)])
    return module


# ---- unpatched against use_mhc_lab ------------------------------------------------------------------------------


def run_step(model, ids) -> dict:
    """One forward and backward with the labels: {"logits", "loss", "grads": {name: gradient}}, in float64."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"logits": out.logits.detach().double(), "loss": out.loss.detach().double(), "grads": grads}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (norms)."""
    size = b.norm().item()
    return (a - b).norm().item() / size if size else (0.0 if torch.equal(a, b) else math.inf)


def differences(other: dict, base: dict) -> dict:
    """How far one step is from another: logits (the largest entry's difference over the largest |logit|), loss
    (relative), every gradient as one vector (relative), and each parameter's own (the largest, and where)."""
    logits = ((other["logits"] - base["logits"]).abs().max() / base["logits"].abs().max()).item()
    every, worst, worst_rel = gradient_gap(other["grads"], base["grads"])
    return {"logits": logits, "loss": _relative(other["loss"], base["loss"]), "gradients": len(base["grads"]),
            "same_parameters": set(other["grads"]) == set(base["grads"]), "all_gradients": every,
            "worst_gradient": worst, "gradient": worst_rel}


def comparison_table(unpatched: dict, patched: dict, restored: dict) -> str:
    """Three run_step results of one model: as transformers runs it, under use_mhc_lab, and restored."""
    d = differences(patched, unpatched)
    same = torch.equal(restored["logits"], unpatched["logits"])
    return "\n".join([
        "float32, use_mhc_lab against transformers' own layers:",
        f"  logits     largest difference {d['logits']:.1e} of the largest |logit|",
        f"  loss       relative difference {d['loss']:.1e}",
        f"  gradients  {d['gradients']} parameters{', the same set' if d['same_parameters'] else ', NOT the same set'};"
        f" all of them as one vector {d['all_gradients']:.1e} apart (relative); one parameter's at most "
        f"{d['gradient']:.1e} ({d['worst_gradient']})",
        f"restored: the logits equal the first step's, bit for bit: {same}",
    ])


def bfloat16_table(seed: int = 0) -> str:
    """The tiny model in bfloat16 (its HyperConnections and norms in float32, as transformers keeps them), one
    step unpatched and one under use_mhc_lab, each against the same bfloat16 weights run in float32."""
    if TRANSFORMERS is None:
        return not_installed()
    tokens, hidden, layers = TINY
    config = model_config(hidden, layers, tokens)
    model, ids = random_model(config, dtype=torch.bfloat16, seed=seed), token_ids(config, tokens, seed=seed)
    truth = run_step(copy.deepcopy(model).float(), ids)
    unpatched = run_step(model, ids)
    with use_mhc_lab(model):
        patched = run_step(model, ids)
    rows = [("unpatched against float32", differences(unpatched, truth)),
            ("use_mhc_lab against float32", differences(patched, truth)),
            ("use_mhc_lab against unpatched", differences(patched, unpatched))]
    lines = [f"bfloat16 (eps {torch.finfo(torch.bfloat16).eps:.1e})    logits    loss      gradients",
             *(f"  {label:30s} {d['logits']:.1e}   {d['loss']:.1e}   {d['all_gradients']:.1e}" for label, d in rows)]
    return "\n".join(lines)


# ---- timing on a GPU --------------------------------------------------------------------------------------------


def time_steps(tokens: int, hidden: int, layers: int = LAYERS, *, rounds: int = 3, steps: int = 3) -> dict:
    """On CUDA: the benchmark's part 'deepseek_v4' at one shape (bfloat16), without its log."""
    return bench_deepseek_v4(tokens, hidden, layers=layers, device="cuda", rounds=rounds, steps=steps,
                             log=lambda line: None)


PASS_LABELS = {"step": "training step", "forward": "forward (autograd recording)",
               "forward_no_grad": "forward (no grad)"}


def timing_table(shape: dict) -> str:
    """One shape of the benchmark's part 'deepseek_v4' (a recording's or time_steps'): each pass's median time
    per kind, ours over transformers' own (median of the rounds' ratios), peak memory."""
    peaks = shape.get("peak_memory_mib") or {}
    lines = [f"{shape['tokens']} tokens x C = {shape['hidden']}, {shape['layers']} layers, n = {shape['n']}, "
             f"{shape['dtype']}, median of {shape['rounds']} rounds",
             f"  {'':30s} {'transformers':>12s} {'use_mhc_lab':>12s} {'ours/theirs':>11s}"
             + ("   peak GiB (theirs / ours)" if peaks else "")]
    for name in PASSES:
        times = [shape["time_ms"].get(kind, {}).get(name) for kind in KINDS]
        ratio = (shape.get("patched_over_unpatched", {}).get(name) or {}).get("median")
        peak = [(peaks.get(kind) or {}).get(name) for kind in KINDS]
        lines.append(f"  {PASS_LABELS[name]:30s} " + " ".join("           -" if t is None else f"{t:9.2f} ms"
                                                             for t in times)
                     + (f" {ratio:10.3f}x" if ratio else " " * 12)
                     + ("" if None in peak else "   " + " / ".join(f"{p / 1024:.2f}" for p in peak)))
    loss = shape.get("loss", {})
    if "difference" in loss:
        lines.append(f"  loss: transformers {loss['unpatched']:.4f}, use_mhc_lab {loss['patched']:.4f} (relative "
                     f"difference {loss['rel_difference']:.1e})")
    for kind, reason in shape.get("errors", {}).items():
        lines.append(f"  {kind}: FAILED {reason}")
    return "\n".join(lines)


def timing_note(recorded: dict | None) -> str:
    """Where this machine cannot time the step (no CUDA GPU, or no transformers): what timing needs, and the
    recording's part 'deepseek_v4' (step_time.load_recorded()) where it holds one."""
    lines = ["Timing needs a CUDA GPU" + ("" if TRANSFORMERS else f" and transformers ({INSTALL})") + ": there this "
             "cell times a training step of both; `python -m mhc_lab.bench training --parts deepseek_v4` records it."]
    part = step_time.section(recorded, "training", "deepseek_v4")
    if not part:
        lines.append(f"mhc_lab/recorded/{step_time.RECORDINGS['training']}.json holds no such part yet.")
        return "\n".join(lines)
    lines.append(step_time.section_label(recorded, "training", "deepseek_v4") + ":")
    lines += [timing_table(shape) for shape in part["shapes"]]
    return "\n".join(lines)
