"""One training step of a small random DeepSeek-V4 from transformers, as transformers runs it and with its mHC sites
run by mhc_lab.ops (part 'deepseek_v4' of the training benchmark, not among its default parts).

The model is transformers' DeepseekV4ForCausalLM built from ``model_config(hidden, layers, tokens)``: n = 4 lanes,
the three attention kinds in turn (sliding window, compressed sparse, heavily compressed), a hash-routed MoE first
and top-k routed ones after it, each with a few small experts (transformers runs its MoE expert by expert, in
eager PyTorch, so the experts are kept few). Its weights are random (seeded); the HyperConnection parameters are
drawn away from their initial values, so that every coefficient path carries gradient. One sequence of
``tokens`` random token ids; the loss is transformers' causal-LM cross entropy (LOSS).

Both kinds (KINDS) run the same model on the same tokens: "unpatched" is transformers' own decoder layer, which
mixes the lanes inline in eager PyTorch; "patched" is the same model under use_mhc_lab(model) (backend "auto":
the fused kernels on CUDA with bfloat16 lanes, the reference elsewhere), restored after each timing. Per kind,
three passes (PASSES):

- step: the gradients set to None, the forward with the loss, its backward: one training step;
- forward: the forward with the loss, autograd recording (the activations the backward would need are kept
  while it runs), no backward;
- forward_no_grad: the forward with the loss under torch.no_grad.

Each pass is timed launched from Python (TIMER), in interleaved rounds (every kind and pass once per round, so
that a drift of the machine reaches all alike): the median over the rounds, and the patched time over the
unpatched one round by round. On CUDA, each pass's peak memory (torch.cuda.max_memory_allocated after
reset_peak_memory_stats, the model's weights included) and what was allocated when it began; on a CPU torch keeps
no such counter and both are null, with the reason. The first step of each kind gives the losses compared (and
builds the fused kernels where they are not cached yet), and every parameter's gradient, compared as one vector.

On a CPU (``--device cpu``, or without CUDA) the part runs in float32 at CPU_SHAPES, a tiny model of seconds.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from mhc_lab.bench.common import N, interleaved_rounds, round_ratios
from mhc_lab.measure import time_fn
from mhc_lab.measure.schemas import DEEPSEEK_V4_KINDS as KINDS
from mhc_lab.measure.schemas import DEEPSEEK_V4_PASSES as PASSES

CUDA_SHAPES = ((4096, 2048),)  # tokens x hidden per step, one sequence: bfloat16 on CUDA
CPU_SHAPES = ((32, 64),)  # a tiny model in float32 on a CPU
LAYERS = 4
ROUNDS = 5
STEPS_PER_TIMING = 5
EXPERTS, EXPERTS_PER_TOKEN = 8, 2
LOSS = "transformers' causal-LM cross entropy of the next token (labels = the input ids)"
TIMER = ("mhc_lab.measure.time_fn: per call, CUDA events around it on the current stream and the GPU synchronised "
         "after it (the host's time included wherever the GPU waits for it), the median of the calls; the wall "
         "clock on a CPU")
NO_PEAK_MEMORY = "the CPU: torch keeps no peak-memory counter there (torch.cuda.max_memory_allocated is CUDA's)"


def require_transformers() -> str:
    """transformers' version where its DeepSeek-V4 imports, else an ImportError that says how to install it."""
    from mhc_lab.integrations.transformers import _deepseek_v4

    _deepseek_v4()
    import transformers

    return transformers.__version__


def model_config(hidden: int, layers: int = LAYERS, tokens: int = 4096):
    """A small DeepSeek-V4 config (transformers' DeepseekV4Config) of width ``hidden`` for sequences of ``tokens``:

    - n = 4 lanes (hc_mult), DeepSeek-V4's mHC convention (20 Sinkhorn rounds, eps 1e-6);
    - attention heads of 128 (hidden / 2 below 256) sharing one key-value head, query rank hidden / 4, grouped
      output projection of rank hidden / 8; the layers take the three attention kinds in turn (sliding window of
      128 tokens, at most a quarter of the sequence; compressed sparse at rate 4, its indexer keeping half of the
      compressed entries; heavily compressed at rate 128, 8 for sequences under 1024 tokens);
    - a hash-routed MoE in the first layer and top-k routed ones after it: 8 experts of hidden / 2, 2 per token,
      one shared expert;
    - a vocabulary of 32768 tokens (256 below a width of 256)."""
    from transformers import DeepseekV4Config

    if hidden < 16 or hidden % 16 or layers < 1 or tokens < 8:
        raise ValueError(f"model_config: expected a hidden size that is a multiple of 16, at least one layer and at "
                         f"least 8 tokens, got hidden {hidden}, {layers} layers, {tokens} tokens")
    head_dim = min(128, hidden // 2)
    heads = hidden // head_dim
    attention = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention")
    return DeepseekV4Config(
        vocab_size=32768 if hidden >= 256 else 256, hidden_size=hidden, num_hidden_layers=layers, hc_mult=N,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, q_lora_rank=hidden // 4,
        o_groups=math.gcd(heads, 4), o_lora_rank=hidden // 8, sliding_window=min(128, max(8, tokens // 4)),
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": 128 if tokens >= 1024 else 8},
        index_n_heads=4, index_head_dim=min(64, hidden // 4), index_topk=max(1, tokens // 8),
        layer_types=[attention[i % len(attention)] for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), n_routed_experts=EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=hidden // 2,
        max_position_embeddings=max(256, tokens), use_cache=False)


def random_model(config, *, dtype=torch.float32, device="cpu", seed: int = 0):
    """DeepseekV4ForCausalLM of ``config`` with seeded random weights on ``device`` in train mode: transformers'
    initial weights, then each HyperConnection's fn ~ N(0, 1/nC), base ~ N(0, 1), scale ~ U(0.5, 2) (H_pre, H_post
    and H_res far from uniform, every coefficient path carrying gradient), and a distinct random expert per
    routing slot of the hash router's table (transformers starts it at zeros: every token on expert 0)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)  # built on the CPU, then moved: the same weights on every device
    model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_hc.fn"):
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            elif name.endswith("_hc.base"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("_hc.scale"):
                param.copy_(0.5 + 1.5 * torch.rand(param.shape, generator=generator))
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):
                slots = torch.rand(table.shape[0], config.n_routed_experts, generator=generator).argsort(dim=1)
                table.copy_(slots[:, : table.shape[1]])
    return model.to(device).train()


def token_ids(config, tokens: int, *, device="cpu", seed: int = 0) -> torch.Tensor:
    """One sequence of ``tokens`` random token ids [1, tokens] (seeded)."""
    generator = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, config.vocab_size, (1, tokens), generator=generator).to(device)


def passes(model, ids) -> dict:
    """The three PASSES of ``model`` on ``ids`` as functions; passes(...)["step"]() returns the loss it
    backpropagated."""

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def forward():
        return model(input_ids=ids, labels=ids).loss.detach()

    def forward_no_grad():
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss

    return {"step": step, "forward": forward, "forward_no_grad": forward_no_grad}


class _Kind:
    """Runs a function as one of KINDS: under use_mhc_lab(model) for "patched", restored afterwards."""

    def __init__(self, model, kind: str):
        self.model, self.kind = model, kind

    def __call__(self, fn):
        if self.kind == "unpatched":
            return fn()
        from mhc_lab.integrations.transformers import use_mhc_lab

        with use_mhc_lab(self.model):
            return fn()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_gap(patched: dict, unpatched: dict) -> tuple[float, str, float]:
    """(|patched - unpatched| / |unpatched| over every gradient as one vector, the parameter whose own relative
    difference is largest, that difference), for two {name: gradient} of the same parameters."""
    apart = total = 0.0
    worst, worst_rel = "", 0.0
    for name, g in unpatched.items():
        g = g.double()
        diff = (patched[name].double() - g).norm().item()
        size = g.norm().item()
        apart, total = apart + diff**2, total + size**2
        rel = diff / size if size else (0.0 if diff == 0 else math.inf)
        if rel >= worst_rel:
            worst, worst_rel = name, rel
    return math.sqrt(apart / total) if total else 0.0, worst, worst_rel


def _memory(model, run, fn, device: torch.device) -> tuple[float, float]:
    """(MiB allocated when fn begins, the gradients dropped; peak MiB while it runs) on CUDA."""
    model.zero_grad(set_to_none=True)
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run(fn)
    _synchronize(device)
    return before / 2**20, torch.cuda.max_memory_allocated(device) / 2**20


def bench_deepseek_v4(tokens: int, hidden: int, *, layers: int = LAYERS, device="cuda", rounds: int = ROUNDS,
                      steps: int = STEPS_PER_TIMING, seed: int = 0, log=print) -> dict:
    """Both KINDS of one DeepSeek-V4 model of width ``hidden`` on ``tokens`` tokens (bfloat16 on CUDA, float32 on a
    CPU): the losses and gradients of their first steps, each pass's peak memory (CUDA), and each pass timed in
    ``rounds`` interleaved rounds of ``steps`` calls. A kind that fails is recorded in "errors" with the reason;
    the other is still measured."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(hidden, layers, tokens)
    model = random_model(config, dtype=dtype, device=device, seed=seed)
    ids = token_ids(config, tokens, device=device, seed=seed)
    fns = passes(model, ids)
    out = {"tokens": tokens, "hidden": hidden, "layers": layers, "n": N, "dtype": str(dtype).removeprefix("torch."),
           "config": _config_summary(config), "parameters": sum(p.numel() for p in model.parameters()),
           "rounds": rounds, "steps_per_timing": steps, "first_step_s": {}, "loss": {}, "time_ms": {},
           "rounds_ms": {}, "patched_over_unpatched": {}, "peak_memory_mib": None, "allocated_before_mib": None,
           "peak_memory_note": None, "errors": {}}
    runs, grads = {}, {}
    for kind in KINDS:
        run = _Kind(model, kind)
        try:
            start = time.perf_counter()
            loss = run(fns["step"])
            _synchronize(device)
            out["first_step_s"][kind] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - recorded, the other kind still measured
            out["errors"][kind] = repr(e)[:500]
            log(f"  deepseek_v4 {tokens}x{hidden} {kind:10s} FAILED {repr(e)[:300]}")
            continue
        runs[kind], grads[kind] = run, _gradients(model)
        out["loss"][kind] = loss.float().item()
    model.zero_grad(set_to_none=True)
    if len(grads) == len(KINDS):
        unpatched, patched = out["loss"]["unpatched"], out["loss"]["patched"]
        out["loss"]["difference"] = patched - unpatched
        out["loss"]["rel_difference"] = abs(patched - unpatched) / abs(unpatched)
        gap, worst, worst_rel = gradient_gap(grads["patched"], grads["unpatched"])
        out["grad_rel_diff"], out["worst_grad"] = gap, {"parameter": worst, "rel_diff": worst_rel}
    grads.clear()

    if device.type == "cuda":
        out["peak_memory_mib"], out["allocated_before_mib"] = {}, {}
        for kind, run in runs.items():
            memory = {name: _memory(model, run, fn, device) for name, fn in fns.items()}
            out["allocated_before_mib"][kind] = {name: m[0] for name, m in memory.items()}
            out["peak_memory_mib"][kind] = {name: m[1] for name, m in memory.items()}
    else:
        out["peak_memory_note"] = NO_PEAK_MEMORY

    timed = {f"{kind}.{name}": (run, fn) for kind, run in runs.items() for name, fn in fns.items()}

    def seconds(item):  # (the kind's runner, a pass) -> median seconds per call
        run, fn = item
        return run(lambda: time_fn(fn, warmup=1, repeat=steps, device=device)["median_s"])

    flat = interleaved_rounds(timed, seconds, rounds)
    for key, times in flat.items():
        kind, name = key.split(".")
        out["rounds_ms"].setdefault(kind, {})[name] = times
        out["time_ms"].setdefault(kind, {})[name] = statistics.median(times)
    if len(runs) == len(KINDS):
        out["patched_over_unpatched"] = {name: round_ratios(out["rounds_ms"]["patched"][name],
                                                            out["rounds_ms"]["unpatched"][name]) for name in PASSES}
    model.zero_grad(set_to_none=True)
    _log_table(out, log)
    return out


def _config_summary(config) -> dict:
    """The config's fields that set the model's shape and work."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "hc_mult", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size")
    summary = {key: getattr(config, key) for key in keys}
    summary.update(compress_rates=dict(config.compress_rates), layer_types=list(config.layer_types),
                   mlp_layer_types=list(config.mlp_layer_types))
    return summary


def _log_table(out: dict, log) -> None:
    log(f"  deepseek_v4 {out['tokens']} tokens x {out['hidden']}, {out['layers']} layers, n = {out['n']}, "
        f"{out['dtype']}: median ms over {out['rounds']} rounds, unpatched | patched (patched / unpatched)")
    for name in PASSES:
        times = [out["time_ms"].get(kind, {}).get(name) for kind in KINDS]
        ratio = (out["patched_over_unpatched"].get(name) or {}).get("median")
        peaks = [((out["peak_memory_mib"] or {}).get(kind) or {}).get(name) for kind in KINDS]
        log(f"    {name:16s} " + " | ".join("-" if t is None else f"{t:9.3f}" for t in times)
            + (f" ({ratio:.3f}x)" if ratio else "")
            + ("" if None in peaks else " | peak " + " / ".join(f"{p:.0f}" for p in peaks) + " MiB"))
    loss = out["loss"]
    if "difference" in loss:
        log(f"    loss unpatched {loss['unpatched']:.6f}, patched {loss['patched']:.6f} "
            f"(relative difference {loss['rel_difference']:.2e}); gradients {out['grad_rel_diff']:.2e} apart")
