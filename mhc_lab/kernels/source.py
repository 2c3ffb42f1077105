"""The code TileLang generates for a tile program (C for the CPU, CUDA for a GPU), and ways to read it.

Generating source needs neither a GPU nor a compiler: TileLang lowers the program to C or CUDA text, which is
what a learner reads to see what the tile program became (vector loads, the reduction, the stores to memory).

    src = generated_source(rmsnorm_program(4096, dtype="bfloat16", target="sm_90"), "sm_90")
    print(kernel_text(src))                       # the kernel alone, without the headers
    global_accesses(src)                          # {"read": ["w", "x"], "written": ["y"]}
    lines_matching(src, r"uint4")                 # [(line number, line), ...]
    tma_swizzles(compiled.get_host_source())      # {"x": 3, "dy": 0, ...}: each TMA descriptor's swizzle
"""


import re

from mhc_lab.kernels._target import canonical_target, code_generation, quiet_tilelang


def generated_source(program, target: str = "c") -> str:
    """The C ('c', 'cpu') or CUDA ('sm_90', 'cuda', any 'sm_XY') source TileLang generates for ``program``."""
    import tilelang
    import tvm

    quiet_tilelang()
    t = canonical_target(target)
    if t != "c":
        t = {"kind": "cuda", "arch": t}
    with code_generation(), tvm.target.Target(t):
        artifact = tilelang.lower(program, target=t)
    return artifact.kernel_source


_DEFINITION = re.compile(r"^(?:extern \"C\" __global__ void .*?|int32_t )(\w+)\((?P<params>[^)]*)\)\s*\{", re.M)


def _definition(source: str) -> re.Match:
    found = list(_DEFINITION.finditer(source))
    if not found:
        raise ValueError("no kernel definition found in this source (expected a C or CUDA kernel from TileLang)")
    return found[-1]


def kernel_text(source: str) -> str:
    """The kernel's definition, from its signature to its closing brace (headers and declarations dropped)."""
    start = _definition(source).start()
    return source[start:].rstrip() + "\n"


def pointer_arguments(source: str) -> list[str]:
    """Names of the kernel's pointer arguments: the tensors in global memory (HBM on a GPU, RAM on a CPU)."""
    params = _definition(source).group("params")
    names = []
    for param in params.split(","):
        if "*" in param:
            names.append(param.strip().split()[-1])
    return names


def global_accesses(source: str) -> dict[str, list[str]]:
    """Which global tensors the kernel reads and which it writes (by the statements of its body)."""
    body = kernel_text(source)
    body = body[body.index("{") + 1 :]
    read, written = [], []
    for name in pointer_arguments(source):
        store = re.compile(rf"(?:\b{name}\[[^;=]*\]|\*\(\w+\*\)\({name} \+[^;=]*\))\s*=(?!=)")
        any_use = re.compile(rf"\b{name}\[|\({name} \+")
        stores = len(store.findall(body))
        uses = len(any_use.findall(body))
        if stores:
            written.append(name)
        if uses > stores:
            read.append(name)
    return {"read": sorted(read), "written": sorted(written)}


def lines_matching(source: str, pattern: str) -> list[tuple[int, str]]:
    """(line number within kernel_text, stripped line) for every line of the kernel that matches ``pattern``."""
    regex = re.compile(pattern)
    return [(k + 1, line.strip()) for k, line in enumerate(kernel_text(source).splitlines()) if regex.search(line)]


def excerpt(source: str, pattern: str, limit: int = 3, width: int = 110) -> str:
    """The first ``limit`` kernel lines matching ``pattern``, numbered, cut at ``width`` characters."""
    found = lines_matching(source, pattern)
    shown = [f"  {n:4d} | {line if len(line) <= width else line[: width - 3] + '...'}" for n, line in found[:limit]]
    if len(found) > limit:
        shown.append(f"       ({len(found) - limit} more)")
    return "\n".join(shown) if shown else "  (no line matches)"


def tma_swizzles(host_source: str) -> dict[str, int]:
    """Each TMA descriptor's swizzle code (0: none; 1, 2, 3: over 32, 64, 128 bytes) in a compiled CUDA kernel's
    host code, by the tensor's name: the third argument from the end of the call that encodes the descriptor."""
    found = {}
    for name, body, count in re.findall(r"void\* (\w+)_desc = stack_\d+;(.*?)tensormap_create_tiled_packed, "
                                        r"\(TVMFFIAny\*\) stack_ffi_any, (\d+)", host_source, flags=re.S):
        values = dict(re.findall(r"stack_ffi_any\)\[(\d+)\]\.v_int64\) = \(\(int64_t\)(\w+)\)", body))
        found[name] = int(values[str(int(count) - 3)])
    return found
