"""What every recording in mhc_lab/recorded holds: one schema per recording, every key documented.

A recording is ``{"name", "environment", "command", "results"}``: the environment tags of the run
(mhc_lab.measure.timing.environment_tags), the command that regenerates the whole file, and the results. The
forward and training recordings are made of sections, one per part of their benchmark (``--parts``); a run of
some parts replaces those sections only, and every section carries the environment and the command of the
run that made it. The benchmarks write these files (mhc_lab.bench), the labs read them (mhc_lab.course),
tests/test_recordings.py checks every file against its schema.

A schema is built from the helpers below; ``validate(value, spec)`` lists what does not match (missing or
unknown keys, wrong types), ``describe(spec)`` prints the documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Spec:
    kind: str  # "number", "integer", "text", "flag", "object", "table", "list", "any"
    doc: str
    fields: dict = field(default_factory=dict)  # object: key -> (Spec, required)
    values: "Spec | None" = None  # table: the spec of every value; list: of every item
    keys: tuple | None = None  # table: the keys it may have (None: any)
    nullable: bool = False


def number(doc: str, nullable: bool = False) -> Spec:
    return Spec("number", doc, nullable=nullable)


def integer(doc: str, nullable: bool = False) -> Spec:
    return Spec("integer", doc, nullable=nullable)


def text(doc: str, nullable: bool = False) -> Spec:
    return Spec("text", doc, nullable=nullable)


def flag(doc: str) -> Spec:
    return Spec("flag", doc)


def obj(doc: str, required: dict, optional: dict | None = None) -> Spec:
    """An object with these keys and no others: required ones must be there, optional ones may."""
    fields = {k: (v, True) for k, v in required.items()}
    fields.update({k: (v, False) for k, v in (optional or {}).items()})
    return Spec("object", doc, fields=fields)


def table(doc: str, values: Spec, keys: tuple | None = None, nullable: bool = False) -> Spec:
    """An object keyed by names (implementations, kernels, ...), every value of one spec; keys: those allowed."""
    return Spec("table", doc, values=values, keys=keys, nullable=nullable)


def array(doc: str, items: Spec) -> Spec:
    return Spec("list", doc, values=items)


def validate(value, spec: Spec, path: str = "") -> list[str]:
    """Every way ``value`` departs from ``spec``, one line each with its path (an empty list: it matches)."""
    where = path or "(top)"
    if value is None:
        return [] if spec.nullable or spec.kind == "any" else [f"{where}: expected {spec.kind}, got null"]
    if spec.kind == "any":
        return []
    if spec.kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{where}: expected a number, got {type(value).__name__}"]
    if spec.kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{where}: expected an integer, got {type(value).__name__}"]
    if spec.kind == "text":
        return [] if isinstance(value, str) else [f"{where}: expected text, got {type(value).__name__}"]
    if spec.kind == "flag":
        return [] if isinstance(value, bool) else [f"{where}: expected true or false, got {type(value).__name__}"]
    if spec.kind == "list":
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in validate(item, spec.values, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where}: expected an object, got {type(value).__name__}"]
    errors = []
    if spec.kind == "table":
        for k, v in value.items():
            if spec.keys is not None and k not in spec.keys:
                errors.append(f"{where}: unknown key {k!r} (expected among {', '.join(spec.keys)})")
            errors += validate(v, spec.values, f"{path}.{k}" if path else k)
        return errors
    for k, (sub, required) in spec.fields.items():
        if k in value:
            errors += validate(value[k], sub, f"{path}.{k}" if path else k)
        elif required:
            errors.append(f"{where}: missing key {k!r}")
    errors += [f"{where}: unknown key {k!r}" for k in value if k not in spec.fields]
    return errors


def describe(spec: Spec, name: str = "", indent: int = 0) -> str:
    """The spec as indented text: each key, its type, whether it is optional, and what it holds."""
    pad = "  " * indent
    kind = spec.kind + (" or null" if spec.nullable else "")
    lines = [f"{pad}{name + ': ' if name else ''}{kind}. {spec.doc}"]
    if spec.kind == "object":
        for k, (sub, required) in spec.fields.items():
            lines.append(describe(sub, k + ("" if required else " (optional)"), indent + 1))
    elif spec.kind in ("table", "list") and spec.values is not None:
        label = "each item" if spec.kind == "list" else (
            "each of " + ", ".join(spec.keys) if spec.keys else "each value")
        lines.append(describe(spec.values, label, indent + 1))
    return "\n".join(lines)


# ---- the parts every recording shares ------------------------------------------------------------------------

ENVIRONMENT = obj(
    "Where and when the measurement ran (mhc_lab.measure.environment_tags).",
    required={
        "date": text("UTC date of the run, YYYY-MM-DD."),
        "python": text("Python version."),
        "torch": text("torch version."),
        "cpu": text("The CPU's architecture or name."),
        "cpu_threads": integer("torch's CPU threads."),
        "tilelang": text("TileLang version (null where it could not load).", nullable=True),
        "triton": text("Triton version (null where it is not installed).", nullable=True),
        "gpu": text("The CUDA GPU's name (null on a CPU).", nullable=True),
    },
    optional={
        "gpu_memory_gib": number("The GPU's memory, GiB."),
        "sm_count": integer("The GPU's streaming multiprocessors."),
        "cuda": text("CUDA version torch was built with."),
        "driver": text("NVIDIA driver version (nvidia-smi; null where it cannot be read).", nullable=True),
    },
)


def _section(doc: str, required: dict, optional: dict | None = None) -> Spec:
    """A section of a recording made of parts: its own environment and command, then its data."""
    return obj(doc, required={
        "environment": ENVIRONMENT,
        "command": text("The exact command that made this section."),
        **required,
    }, optional={"partial": flag("Present (true) while the run that writes this section has not finished."),
                 **(optional or {})})


MS = number("Milliseconds.")
SITE_SETUP = {
    "timer": text("The timer: triton.testing.do_bench's median with the L2 flushed between runs, or CUDA events."),
    "n": integer("Lanes."),
    "dtype": text("The lanes' dtype (the coefficients are float32)."),
    "sinkhorn_iterations": integer("Sinkhorn rounds of the coefficients (DeepSeek-V4: 20)."),
    "post_mult": number("H_post's multiplier (2)."),
    "copy_gbps": number("Device-to-device copy of 2 GiB in the same run, GB/s counting bytes read + written."),
}
RATIOS = obj("A ratio per round, and its median, least and most.", required={
    "ratios": array("One ratio per interleaved round.", number("Ratio.")),
    "median": number("Median of the ratios."),
    "least": number("Least ratio."),
    "most": number("Largest ratio."),
})
OVERHEAD = obj("A kind's time over the plain residual's, in percent, round by round.", required={
    "median": number("Median over the rounds, percent."),
    "least": number("Least, percent."),
    "most": number("Largest, percent."),
})


# ---- memory-wall (lab 04) -----------------------------------------------------------------------------------

MEMORY_WALL_ROW = obj("One (layer, mode, pass) at one shape.", required={
    "layer": text("residual, hc or mhc (mhc_lab.models.naive_layers)."),
    "label": text("The layer's name as the lab prints it."),
    "mode": text("eager or compiled (torch.compile)."),
    "pass": text("forward or forward+backward."),
    "tokens": integer("Tokens."), "n": integer("Lanes (1 for the residual)."), "C": integer("Width."),
    "dtype": text("The lanes' dtype."),
    "median_s": number("Median seconds per call."), "min_s": number("Least seconds per call."),
    "repeat": integer("Timed calls."),
    "launches": integer("CUDA kernels per call in the profiler (operations on a CPU).", nullable=True),
    "counted_bytes": integer("Bytes the bytes model counts for the call (mHC Table 2, unfused)."),
    "gbs": number("counted_bytes over median_s, GB/s."),
    "fraction_of_copy": number("gbs over the run's copy bandwidth."),
}, optional={
    "minimal_bytes": integer("Bytes the fewest-bytes fused site would move for the same call (HC and mHC)."),
    "traced_ops": integer("Operations that compute, traced on the forward."),
    "traced_bytes": integer("Bytes those operations read and write."),
    "syncs": integer("Host-device synchronisations in the forward."),
    "compile_s": number("Seconds torch.compile took (compiled rows)."),
})
MEMORY_WALL = obj("The memory-wall benchmark (mhc_lab.bench.memory_wall).", required={
    "config": obj("What was measured and how.", required={
        "tokens": integer("Tokens."), "n": integer("Lanes."),
        "widths": array("Widths C measured.", integer("C.")),
        "dtype": text("The lanes' dtype."), "layer_function": text("The layer F between pre and post."),
        "sinkhorn": text("The Sinkhorn variant and rounds."), "coefficients": text("The coefficients' dtype."),
        "timer": text("The timer."), "counted_bytes": text("How the bytes are counted."),
        "launches": text("How launches are counted."),
    }),
    "copy_bandwidth_gbs": number("Device-to-device copy bandwidth of the run, GB/s (read + written)."),
    "roof": obj("The machine's roof (mhc_lab.measure.roofline.measure_roof).", required={
        "device": text("Device name."), "bandwidth_gbs": number("Copy bandwidth, GB/s."),
        "matmul_tflops": number("Measured matmul rate, TFLOP/s."), "matmul_dtype": text("The matmul's dtype."),
    }),
    "rows": array("One row per layer, mode, pass and width.", MEMORY_WALL_ROW),
})


# ---- tilelang (lab 05) --------------------------------------------------------------------------------------

_TILELANG_TIMED = {
    "impl": text("The implementation: torch copy_, eager (x + f), eager (8 kernels), torch rms_norm, tilelang."),
    "shape": array("[rows, columns].", integer("Size.")),
    "dtype": text("dtype."),
    "counted_bytes": integer("Least bytes the kernel moves."),
    "median_s": number("Median seconds."), "min_s": number("Least seconds."), "repeat": integer("Timed calls."),
    "gbs": number("counted_bytes over median_s, GB/s."),
    "fraction_of_copy": number("gbs over the run's torch copy (null where no copy was timed).", nullable=True),
}
TILELANG_ROW = obj("The best of each implementation of a kernel.", required={
    "kernel": text("copy, residual_add or rmsnorm."), **_TILELANG_TIMED,
}, optional={
    "config": array("The tile shape of the fastest TileLang build.", integer("Tile size.")),
    "relative_error": number("Relative error against the reference."),
    "eager_bytes": integer("Bytes the eager RMSNorm moves, pass by pass."),
})
TILELANG_CONFIG = obj("One tile shape of a TileLang kernel: checked, then timed where it was right.", required={
    "kernel": text("copy, residual_add or rmsnorm."),
    "config": array("The tile shape (rows, columns, threads on a GPU).", integer("Size.")),
    "ok": flag("Whether its output matched the reference."),
}, optional={
    "relative_error": number("Relative error against the reference."),
    "error": text("Why it failed to build or run."),
    **_TILELANG_TIMED,
})
TILELANG = obj("The TileLang benchmark (mhc_lab.bench.tilelang).", required={
    "device": text("Device name."),
    "copy_gbs": number("torch copy_ of the residual-add-sized tensor, GB/s: the run's roof."),
    "rows": array("Each kernel's implementations, the fastest TileLang tile shape among them.", TILELANG_ROW),
    "variants": array("Every TileLang tile shape tried, one entry each.", TILELANG_CONFIG),
    "eps": number("RMSNorm's epsilon."),
    "torch_threads": integer("torch's CPU threads during the run."),
})


# ---- forward (lab 06) ---------------------------------------------------------------------------------------

FORWARD_IMPLEMENTATIONS = ("tilekernels", "ours", "ours_chained")
FORWARD_REFERENCE = ("eager", "compile")
FORWARD_KERNELS = ("post", "pre", "pre.phi_split", "pre.project", "pre.apply", "chained.apply",
                   "chained.post_project")
_FORWARD_SHAPE = {
    "tokens": integer("Tokens."), "C": integer("Width."), "n": integer("Lanes."),
    "min_bytes": integer("Least bytes a site's forward moves: 14 C bf16 elements per token at n = 4."),
}
FORWARD_SITES = _section("Our site, TileKernels' and our kernels alone, per shape (part 'sites').", required={
    **SITE_SETUP,
    "shapes": array("One entry per shape.", obj("One shape.", required={
        **_FORWARD_SHAPE,
        "time_ms": table("A whole site (pre + post, F = identity) per implementation: tilekernels (DeepSeek's "
                         "TileKernels, inference path), ours (our pre projects for itself: phi split, projection, "
                         "apply; then the post), ours_chained (a site inside a stack: the apply pass on the "
                         "previous post's projection, then the post fused with the next site's projection).",
                         MS, FORWARD_IMPLEMENTATIONS),
        "rel_err": table("Each site's relative error against the float32 reference.", number("Relative error."),
                         FORWARD_IMPLEMENTATIONS),
        "kernel_ms": table("Our kernels alone: post; pre (the whole pre: phi split, projection, apply) and its "
                           "three parts; chained.apply (the apply pass on a handed projection) and "
                           "chained.post_project (the post fused with the next projection).", MS, FORWARD_KERNELS),
        "kernel_rel_err": obj("Our kernels' relative errors against the float32 reference.", required={}, optional={
            "pre": table("The pre's outputs.", number("Relative error."), ("layer_input", "pre", "post", "res")),
            "post": number("The post's new lanes."),
            "chained.partial": number("The fused post's projection partial sums (projection and norm apart, the "
                                      "larger)."),
        }),
        "errors": table("Why an implementation or kernel has no time (a failure, or a baseline not installed).",
                        text("The reason.")),
    })),
}, optional={
    "l2_read_gbps": number("Repeated reads of a 24 MB buffer, GB/s: the ceiling of on-chip re-reads."),
})
FORWARD_REFERENCE_SECTION = _section(
    "The reference code eager and under torch.compile, per shape (part 'reference': minutes of compiling, and "
    "independent of our kernels).", required={
        **SITE_SETUP,
        "shapes": array("One entry per shape.", obj("One shape.", required={
            **_FORWARD_SHAPE,
            "time_ms": table("A whole site: eager (mhc_lab.reference, eager PyTorch), compile (torch.compile of "
                             "it).", MS, FORWARD_REFERENCE),
            "rel_err": table("Relative error against the eager float32 reference.", number("Relative error."),
                             FORWARD_REFERENCE),
            "errors": table("Why an implementation has no time.", text("The reason.")),
        })),
    })
FORWARD = obj("The forward benchmark (mhc_lab.bench.forward), one section per part.", required={},
              optional={"sites": FORWARD_SITES, "reference": FORWARD_REFERENCE_SECTION})


# ---- training (lab 07) --------------------------------------------------------------------------------------

SITE_IMPLEMENTATIONS = ("ours_separate", "ours_linked", "ours_chained", "tilekernels", "compiled", "eager")
SITE_BYTES = ("least", "ours_separate", "ours_linked", "ours_chained")
TRAINING_SITE = _section("One site's forward + backward per shape (part 'site').", required={
    **SITE_SETUP,
    "shapes": array("One entry per shape.", obj("One shape.", required={
        "tokens": integer("Tokens."), "C": integer("Width."), "n": integer("Lanes."),
        "elements_per_token": table("Lane-wide elements per token, forward + backward, units of C "
                                    "(mhc_lab.measure.bytes_model): the least any design moves, and ours as "
                                    "separate ops, as a linked site and as chained sites.", integer("Elements."),
                                    SITE_BYTES),
        "bytes": table("The same, in bytes for the shape.", integer("Bytes."), SITE_BYTES),
        "launched_ms": table("Forward + backward launched op by op from Python, per implementation: ours_separate "
                             "(mhc_pre, then mhc_post), ours_linked (mhc_site), ours_chained (mhc_site_chained "
                             "inside a stack), tilekernels, compiled (torch.compile of the reference), eager.",
                             MS, SITE_IMPLEMENTATIONS),
        "graph_ms": table("The same captured once as a CUDA graph and replayed: the GPU's time alone.", MS,
                          SITE_IMPLEMENTATIONS),
        "graph_rounds_ms": table("The graphs timed again in interleaved rounds, each implementation in turn.",
                                 array("One time per round.", MS), SITE_IMPLEMENTATIONS),
        "rel_err": table("Relative errors of the gradients against the float32 reference.",
                         table("Per gradient.", number("Relative error."), ("x", "phi", "bias", "alpha")),
                         SITE_IMPLEMENTATIONS),
        "errors": table("Why an implementation or its graph has no time (key: the implementation, or it and "
                        "'.graph').", text("The reason.")),
    }, optional={
        "chained_vs_tilekernels_graph_rounds": RATIOS,
    })),
})
BLOCK_KINDS = ("residual", "copy_floor", "mhc_ours", "mhc_ours_recompute", "mhc_tilekernels", "mhc_compiled")
_BLOCK_TIMING = {
    "rounds_ms": table("Each kind's step in interleaved rounds, every kind once per round.",
                       array("One time per round.", MS), BLOCK_KINDS),
    "overhead_pct": table("Each kind's time over the plain residual's, round by round.", OVERHEAD, BLOCK_KINDS),
}
TRAINING_BLOCK = _section("A transformer block's forward + backward per width (part 'block').", required={
    "timer": SITE_SETUP["timer"], "n": SITE_SETUP["n"], "dtype": SITE_SETUP["dtype"],
    "copy_gbps": SITE_SETUP["copy_gbps"],
    "widths": array("One entry per width.", obj("One width.", required={
        "C": integer("Width."), "tokens": integer("Tokens per step."), "batch": integer("Sequences."),
        "seq": integer("Tokens per sequence."), "heads": integer("Attention heads (C / 128)."),
        "peak_gib": table("Peak memory above the inputs of a launched step, GiB.", number("GiB."), BLOCK_KINDS),
        "launched": obj("Steps launched op by op: residual (plain), copy_floor (the plain block plus copies of "
                        "the bytes our chained sites move beyond it), mhc_ours (our chained sites), "
                        "mhc_ours_recompute (the same, mHC ops recomputed in backward), mhc_tilekernels, "
                        "mhc_compiled (torch.compile of the reference).", required=_BLOCK_TIMING),
        "errors": table("Why a kind has no time (key: the kind, or it and '.graph').", text("The reason.")),
    }, optional={
        "graph": obj("Each step captured as a CUDA graph and replayed: the GPU's time alone.",
                     required=_BLOCK_TIMING, optional={
                         "rel_diff": table("After the timing, the replay's input gradient against the launched "
                                           "step's (relative); a graph above 1e-2 is refused.",
                                           number("Relative difference."), BLOCK_KINDS)}),
    })),
})
KERNEL_STEP = obj("One step profiled kernel by kernel (torch.profiler over 5 steps).", required={
    "wall_ms": number("Wall time per step, launched, ms."),
    "kernel_ms": number("GPU time of all its kernels per step, ms."),
    "idle_ms": number("wall_ms less kernel_ms: the GPU waiting for the host or between kernels."),
    "launches": number("Kernels per step."),
    "kernels": table("Per kernel name: its GPU time and launches per step.", obj("One kernel.", required={
        "ms": number("GPU ms per step."), "launches": number("Launches per step.")})),
})
COMPARISON = obj("Two steps' kernels side by side (bench.kernels.compare_kernel_times).", required={
    "base_ms": number("All of the first's kernels, ms."), "other_ms": number("All of the second's, ms."),
    "shared_base_ms": number("The kernels both launch, in the first, ms."),
    "shared_other_ms": number("The same kernels in the second, ms."),
    "only_base_ms": number("Kernels only the first launches, ms."),
    "only_other_ms": number("Kernels only the second launches, ms."),
    "largest_differences": array("The shared kernels whose time differs most.", obj("One kernel.", required={
        "kernel": text("Name."), "ms": number("Second less first, ms."), "base_ms": number("In the first, ms."),
        "other_ms": number("In the second, ms.")})),
    "largest_own": array("The second's own kernels, longest first.", obj("One kernel.", required={
        "kernel": text("Name."), "ms": number("ms.")})),
})
TRAINING_BLOCK_KERNELS = _section("Where a block's extra time goes, per width and kind (part 'block_kernels').",
                                  required={
    "copy_gbps": SITE_SETUP["copy_gbps"],
    "widths": array("One entry per width and kind.", obj("One width and kind.", required={
        "C": integer("Width."), "tokens": integer("Tokens per step."),
        "kind": text("The block beside the plain one: mhc_ours (our chained sites) or copy_floor."),
        "residual_block": KERNEL_STEP,
        "kind_block": KERNEL_STEP,
        "kind_without_layers": KERNEL_STEP,
        "comparison": COMPARISON,
        "own_against_alone": COMPARISON,
    })),
})
HOST_EVENT = obj("One host event under torch.profiler.", required={
    "us": number("Microseconds per step inside the event, nested events included."),
    "own_us": number("Microseconds per step in the event itself, nested events excluded."),
    "calls": number("Calls per step."),
    "event": text("The event: an ATen op, an autograd node, a CUDA runtime or driver call, a C++ op of native.cpp "
                  "(mhc_lab_native::*) or one of its kernels' launches (mhc_lab launch: *)."),
})
HOST_EVENTS = obj("Where the host's time goes by torch.profiler's events, per step (the profiler's own cost "
                  "included).", required={
    "by_own_time": array("The events with the most own time per step, the most first.", HOST_EVENT),
    "native": array("native.cpp's ops and launches, the most time first.", HOST_EVENT),
})
TRAINING_HOST = _section("What the host costs per site in a chain at a small shape (part 'host').", required={
    "site": obj("A chain of sites (run_sites, identity layers), forward + backward, every figure per site.",
                required={
        "tokens": integer("Tokens."), "C": integer("Width."), "sites": integer("Sites in the chain."),
        "launched_ms": number("Wall time per site, launched op by op, ms."),
        "graph_ms": number("Wall time per site in a replay of the chain's CUDA graph, ms."),
        "kernel_ms": number("GPU time of its kernels per site, ms."),
        "kernels_per_site": number("Kernels per site."),
        "host_us_by_function": array("The Python functions with the most own time per site (cProfile).",
                                     obj("One function.", required={
                                         "us": number("Own microseconds per site."),
                                         "calls": number("Calls per site."), "function": text("Where.")})),
        "host_us_by_event": HOST_EVENTS,
    }),
})
_PATH_KEYS = "'<path>.<what>': path hopper or portable, what linked_forward, linked or chained"
TRAINING_PORTABLE = _section("One site with the Hopper programs and with the portable ones (part 'portable').",
                             required={
    "timer": text("How the times were taken."), "n": integer("Lanes."), "dtype": text("The lanes' dtype."),
    "copy_gbps": number("Device-to-device copy bandwidth, GB/s."),
    "shapes": array("One entry per shape.", obj("Both paths at one shape.", required={
        "tokens": integer("Tokens."), "C": integer("Width."), "n": integer("Lanes."),
        "graph_ms": table(f"Median CUDA-graph replay time per round, ms; keys {_PATH_KEYS}.", number("ms.")),
        "graph_rounds_ms": table("Each one's replay time in every interleaved round, ms.",
                                 array("ms per round.", number("ms."))),
        "rel_err": table("Gradients against the float32 reference (not for linked_forward).",
                         table("Relative error per gradient (x, phi, bias, alpha).", number("Relative error."))),
        "errors": table("Why one is missing.", text("The error.")),
    })),
})
STACK_KINDS = ("residual", "mhc_kernels", "mhc_reference", "mhc_tilekernels")
# the first three under torch.compile: "<kind>_compiled" (default mode), "<kind>_reduce_overhead"
STACK_COMPILE_MODES = {"compiled": "default", "reduce_overhead": "reduce-overhead"}
STACK_COMPILED_KINDS = tuple(f"{kind}_{suffix}" for kind in STACK_KINDS[:3] for suffix in STACK_COMPILE_MODES)
STACK_ALL_KINDS = STACK_KINDS + STACK_COMPILED_KINDS
STACK_MHC_KINDS = tuple(k for k in STACK_ALL_KINDS if not k.startswith("residual"))
_STACK_KINDS_DOC = ("residual (the plain residual), mhc_kernels (MHCResidualStream, the fused kernels), "
                    "mhc_reference (MHCResidualStream, the reference backend), mhc_tilekernels (DeepSeek's "
                    "TileKernels mhc_pre and mhc_post around the same layers with the same parameters); "
                    "<kind>_compiled and <kind>_reduce_overhead: the first three under torch.compile, in the default "
                    "mode and in mode 'reduce-overhead' (no CUDA graph of ours is taken of those)")
HOST_FUNCTION = obj("One Python function (cProfile).", required={
    "us": number("Own microseconds per step (in the function itself, not in what it calls)."),
    "cumulative_us": number("Microseconds per step in the function and what it calls."),
    "calls": number("Calls per step."),
    "function": text("Where: path:line(function), or the name of a built-in."),
})
def _stack_host_profile(kind: str) -> Spec:
    return obj(f"Where the fused stream's ({kind}) host time goes, over steps_per_timing steps. cProfile follows "
               "the autograd engine's device thread, where the backward's Python runs, on Python 3.12 and later; "
               "on earlier Pythons that time is run_backward's own.", required={
                   "steps": integer("Steps timed and profiled."),
                   "forward_ms": number("Wall time per step of the forward with the loss, launched, ms."),
                   "backward_ms": number("Wall time per step of the backward call, launched, ms."),
                   "profiled_ms": number("Wall time per step under cProfile, ms (its own cost included)."),
                   "own_us": number("The profiled functions' own time per step in all, microseconds."),
                   "by_own_time": array("The functions with the most own time per step, the most first.",
                                        HOST_FUNCTION),
                   "by_cumulative_time": array("The functions with the most cumulative time per step, the most "
                                               "first.", HOST_FUNCTION),
               }, optional={"events": HOST_EVENTS})


TRAINING_STACK = _section(
    "A stack of pre-norm MLP layers trained one step at a time, as a user's loop does, per shape (part 'stack').",
    required={
        "timer": text("The timer of the CUDA graphs' replays: triton.testing.do_bench's median with the L2 flushed "
                      "between runs, or CUDA events."),
        "launched_timer": text("The timer of the launched steps: wall clock per step, the GPU synchronised at both "
                               "ends, after warm-up steps."),
        "loss": text("The step's scalar loss, whose backward the step runs."),
        "n": integer("Lanes of the mHC kinds."), "dtype": text("The weights' and activations' dtype."),
        "copy_gbps": SITE_SETUP["copy_gbps"],
        "shapes": array("One entry per shape.", obj("Every kind at one shape.", required={
            "tokens": integer("Tokens per step (one sequence)."), "C": integer("Width."),
            "n": integer("Lanes of the mHC kinds."), "layers": integer("Sub-layers (mHC sites) in the stack."),
            "hidden": integer("Width of the MLP's hidden layer (4C)."),
            "steps_per_timing": table("Steps in each launched timing of a kind: about 300 ms of steps, 5 to 200.",
                                      integer("Steps."), STACK_ALL_KINDS),
            "launched_ms": table(f"Median over the rounds of the step launched op by op from Python, ms, per kind: "
                                 f"{_STACK_KINDS_DOC}.", MS, STACK_ALL_KINDS),
            "launched_rounds_ms": table("The launched step in interleaved rounds, every kind once per round.",
                                        array("One time per round.", MS), STACK_ALL_KINDS),
            "gpu_ms": table("GPU time of the step's kernels per step (torch.profiler, the sum of their durations).",
                            MS, STACK_ALL_KINDS),
            "kernels_per_step": table("Kernels (and copies) per step in the profiler.", number("Kernels."),
                                      STACK_ALL_KINDS),
            "kernels": table("Per kind, its kernels by name (the first 160 characters).",
                             table("Per kernel name.", obj("One kernel.", required={
                                 "ms": number("GPU ms per step."), "launches": number("Launches per step.")})),
                             STACK_ALL_KINDS),
            "graph_ms": table("Median over the rounds of the step captured once as a CUDA graph and replayed: the "
                              "GPU's time alone, ms.", MS, STACK_ALL_KINDS),
            "graph_rounds_ms": table("The replays in interleaved rounds, every kind once per round.",
                                     array("One time per round.", MS), STACK_ALL_KINDS),
            "graph_rel_diff": table("After the replays' timing, the replay's input gradient against the launched "
                                    "step's (relative); a graph above 1e-2 is refused.",
                                    number("Relative difference."), STACK_ALL_KINDS),
            "over_residual": obj("Each mHC kind's figures over its plain residual's (the plain residual compiled "
                                 "the same way where it was measured, else the eager one).", required={
                "launched": table("Launched step, ratio per round.", RATIOS, STACK_MHC_KINDS),
                "graph": table("CUDA graph, ratio per round.", RATIOS, STACK_MHC_KINDS),
                "gpu": table("GPU time of the kernels, ratio.", number("Ratio."), STACK_MHC_KINDS),
                "kernels": table("Kernels per step, ratio.", number("Ratio."), STACK_MHC_KINDS),
            }),
            "per_site_over_residual": table(
                "What each mHC kind adds to the plain residual's step per site: its figure less the residual's, "
                "over the layers.", obj("One kind.", required={
                    "launched_ms": number("Launched ms per site."), "gpu_ms": number("GPU ms per site."),
                    "kernels": number("Kernels per site."),
                }, optional={"graph_ms": number("CUDA-graph ms per site (where both graphs were timed).")}),
                STACK_MHC_KINDS),
            "errors": table("Why a kind, its graph or its host profile has no figures (key: the kind, or it and "
                            "'.graph' or '.host').", text("The reason.")),
        }, optional={
            # a run of part 'stack' replaces the shapes it measures and keeps the others: each says what made it
            "environment": ENVIRONMENT,
            "command": text("The command that measured this shape."),
            "first_step_s": table("Each kind's first step, s: the kernels' build where not cached, and a compiled "
                                  "kind's compilation.", number("Seconds."), STACK_ALL_KINDS),
            "dynamo": obj("torch.compile's counters over the compiled kinds of this shape.", required={
                "graph_breaks": integer("Graph breaks."), "recompiles": integer("Recompilations."),
                "unique_graphs": integer("Graphs compiled (one per compiled kind when nothing breaks)."),
            }),
            "host": _stack_host_profile("mhc_kernels"),
            "host_compiled": _stack_host_profile("mhc_kernels_compiled, where measured"),
        })),
    })
DEEPSEEK_V4_KINDS = ("unpatched", "patched")
DEEPSEEK_V4_PASSES = ("step", "forward", "forward_no_grad")
_DEEPSEEK_V4_PASSES_DOC = ("step (the gradients dropped, the forward with the loss, its backward), forward (the "
                           "forward with the loss, autograd recording, no backward), forward_no_grad (the forward "
                           "with the loss under torch.no_grad)")


def _per_kind_and_pass(doc: str, value: Spec, nullable: bool = False) -> Spec:
    return table(doc, table("Per pass.", value, DEEPSEEK_V4_PASSES), DEEPSEEK_V4_KINDS, nullable=nullable)


TRAINING_DEEPSEEK_V4 = _section(
    "One training step of a small random DeepSeek-V4 from transformers, unpatched and with its mHC sites run by "
    "mhc_lab.ops (use_mhc_lab), per shape (part 'deepseek_v4').", required={
        "timer": text("How each pass was timed: per call, launched from Python, the GPU synchronised after it."),
        "loss": text("The loss the step backpropagates."),
        "device": text("cuda or cpu."),
        "backend": text("use_mhc_lab's backend (auto: the fused kernels on CUDA with bfloat16 lanes, the reference "
                        "elsewhere)."),
        "transformers": text("transformers' version."),
        "shapes": array("One entry per shape.", obj("Both kinds at one shape.", required={
            "tokens": integer("Tokens per step (one sequence)."), "hidden": integer("The model's width C."),
            "layers": integer("Decoder layers (two mHC sites each)."), "n": integer("Lanes (hc_mult)."),
            "dtype": text("The model's dtype (bfloat16 on CUDA, float32 on a CPU; the HyperConnection parameters "
                          "and norms stay float32)."),
            "config": obj("The DeepSeek-V4 config's fields that set the model's shape and work "
                          "(mhc_lab.bench.deepseek_v4.model_config).", required={
                **{key: integer(doc) for key, doc in (
                    ("vocab_size", "Vocabulary."), ("hidden_size", "Width."), ("num_hidden_layers", "Layers."),
                    ("hc_mult", "Lanes."), ("num_attention_heads", "Query heads."), ("head_dim", "Head width."),
                    ("q_lora_rank", "Rank of the query's low-rank projection."),
                    ("o_groups", "Groups of the grouped output projection."),
                    ("o_lora_rank", "Rank per group of the output projection."),
                    ("sliding_window", "Tokens of the sliding window."),
                    ("index_n_heads", "Heads of the compressed sparse attention's indexer."),
                    ("index_head_dim", "Width of the indexer's heads."),
                    ("index_topk", "Compressed entries the indexer keeps per query."),
                    ("n_routed_experts", "Routed experts per MoE."),
                    ("num_experts_per_tok", "Routed experts per token."),
                    ("n_shared_experts", "Shared experts per MoE."),
                    ("moe_intermediate_size", "Width of each expert's hidden layer."))},
                "compress_rates": table("Compression rate per compressed attention kind.", integer("Rate.")),
                "layer_types": array("Each layer's attention kind.", text("Kind.")),
                "mlp_layer_types": array("Each layer's MoE kind (hash_moe or moe).", text("Kind.")),
            }),
            "parameters": integer("The model's parameters."),
            "rounds": integer("Interleaved rounds of the timings."),
            "steps_per_timing": integer("Calls per timing of a pass (their median is the round's time)."),
            "first_step_s": table("Each kind's first step, s (the fused kernels' build where not cached).",
                                  number("Seconds."), DEEPSEEK_V4_KINDS),
            "loss": obj("The losses of each kind's first step, on the same weights and tokens.", required={}, optional={
                "unpatched": number("transformers' own layers."), "patched": number("Under use_mhc_lab."),
                "difference": number("patched less unpatched."),
                "rel_difference": number("|patched - unpatched| / |unpatched|."),
            }),
            "time_ms": _per_kind_and_pass(f"Median over the rounds, ms, per kind (unpatched: transformers' own "
                                          f"layers; patched: under use_mhc_lab) and pass: {_DEEPSEEK_V4_PASSES_DOC}.",
                                          MS),
            "rounds_ms": _per_kind_and_pass("Each round's time, ms (every kind and pass once per round).",
                                            array("One time per round.", MS)),
            "patched_over_unpatched": table("The patched time over the unpatched one, round by round, per pass.",
                                            RATIOS, DEEPSEEK_V4_PASSES),
            "peak_memory_mib": _per_kind_and_pass("Peak memory allocated while the pass ran, MiB (the model's weights "
                                                  "included; torch.cuda.max_memory_allocated); null on a CPU.",
                                                  number("MiB."), nullable=True),
            "allocated_before_mib": _per_kind_and_pass("Memory allocated when the pass began, MiB (the weights, the "
                                                       "gradients dropped); null on a CPU.",
                                                       number("MiB."), nullable=True),
            "peak_memory_note": text("Why there is no peak memory (null where there is).", nullable=True),
            "errors": table("Why a kind has no figures.", text("The reason."), DEEPSEEK_V4_KINDS),
        }, optional={
            "grad_rel_diff": number("Every parameter's gradient after the first step as one vector: |patched - "
                                    "unpatched| / |unpatched|."),
            "worst_grad": obj("The parameter whose gradient differs most, relatively.", required={
                "parameter": text("Its name."), "rel_diff": number("|patched - unpatched| / |unpatched| of it."),
            }),
        })),
    })
PEERS = ("ours", "tilekernels", "liger", "transformer_engine")
PEER_PASSES = ("forward", "forward_backward")
_PER_PASS = lambda doc, value: table(doc, value, PEER_PASSES)  # noqa: E731
TRAINING_PEERS = _section("One site beside the fused implementations of other libraries (part 'peers').", required={
    **SITE_SETUP,
    "versions": table("Each peer's installed package version (null where it is not installed).",
                      text("Version.", nullable=True), PEERS[1:]),
    "shapes": array("One entry per shape.", obj("One shape, the same numbers for every implementation.", required={
        "tokens": integer("Tokens."), "C": integer("Width."), "n": integer("Lanes."),
        "least_bytes": _PER_PASS("Bytes the fewest-bytes plan of a site moves (bytes_model's mhc_minimal).",
                                 integer("Bytes.")),
        "rel_err": table("Relative errors against the float64 site: the output and each gradient, in our "
                         "convention.", table("Per tensor.", number("Relative error.")), PEERS),
        "launched_ms": table("Launched op by op from Python.", _PER_PASS("Per pass.", MS), PEERS),
        "graph_ms": table("Captured once as a CUDA graph and replayed: the GPU's time alone.",
                          _PER_PASS("Per pass.", MS), PEERS),
        "graph_rounds_ms": table("The graphs again in interleaved rounds.",
                                 _PER_PASS("Per pass.", array("One time per round.", MS)), PEERS),
        "copy_floor_share": table("least_bytes over the graph's time, as a share of copy_gbps.",
                                  _PER_PASS("Per pass.", number("Share (1: at the copy floor).")), PEERS),
        "notes": table("How each implementation was called: layout, dtypes, what stands in for what.",
                       text("Note."), PEERS),
        "errors": table("Why an implementation has no figures.", text("The reason."), PEERS),
    })),
})
TRAINING = obj("The training benchmark (mhc_lab.bench.training), one section per part.", required={}, optional={
    "site": TRAINING_SITE, "block": TRAINING_BLOCK, "block_kernels": TRAINING_BLOCK_KERNELS, "host": TRAINING_HOST,
    "portable": TRAINING_PORTABLE, "stack": TRAINING_STACK, "peers": TRAINING_PEERS,
    "deepseek_v4": TRAINING_DEEPSEEK_V4,
})


# ---- the course run in full mode --------------------------------------------------------------------------------

# ---- the recordings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordingSchema:
    name: str
    command: str  # the command that regenerates the whole recording
    results: Spec
    sections: tuple = ()  # the parts of a recording made of sections, in order


SCHEMAS = {s.name: s for s in (
    RecordingSchema("memory_wall_h200", "python -m mhc_lab.bench memory-wall --out mhc_lab/recorded", MEMORY_WALL),
    RecordingSchema("tilelang_h200", "python -m mhc_lab.bench tilelang --out mhc_lab/recorded", TILELANG),
    RecordingSchema("forward_h200", "python -m mhc_lab.bench forward", FORWARD, ("sites", "reference")),
    RecordingSchema("training_h200", "python -m mhc_lab.bench training", TRAINING,
                    ("site", "block", "block_kernels", "host", "portable", "stack", "peers", "deepseek_v4")),
)}


def recording_spec(schema: RecordingSchema) -> Spec:
    """The whole file's spec: name, environment, command, results."""
    return obj(f"The recording {schema.name}.", required={
        "name": text(f"The recording's name: {schema.name}."),
        "environment": ENVIRONMENT,
        "command": text("The command that regenerates the whole recording."),
        "results": schema.results,
    })


def validate_recording(recording: dict, name: str | None = None) -> list[str]:
    """What departs from the schema of the recording named ``name`` (or recording["name"])."""
    name = name or recording.get("name")
    if name not in SCHEMAS:
        return [f"no schema for a recording named {name!r}; known: {', '.join(SCHEMAS)}"]
    errors = validate(recording, recording_spec(SCHEMAS[name]))
    if recording.get("name") != name:
        errors.append(f"name: expected {name!r}, got {recording.get('name')!r}")
    return errors
