"""A summary of Nsight Compute's exports for a warp-specialised kernel: what lab 07's profile table reads.

    ncu --profile-from-start off --set full --import-source yes -k regex:"lanes_backward|post_project" \\
        -o hot python -m mhc_lab.bench training --parts profile_kernels --shapes 16384x4096 --no-save
    ncu -i hot.ncu-rep --page details --csv > details.csv
    ncu -i hot.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m mhc_lab.bench ncu-summary details.csv sass.csv [--json out.json] [--table]

Per kernel: time, clocks, throughputs, issue and warps from the details page; from the SASS page, the
consumer loop (the SASS lines executed the most common number of times: once per tile by every consumer
warp) counted by instruction class, and the warp-stall samples by reason without the producer's waits for
free stages (the try-wait branches of mbarriers that the consumer loop does not execute), which only say that
the consumers set the pace.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys
from pathlib import Path

DETAILS = {  # (section, metric) of the details page -> the summary's key
    ("GPU Speed Of Light Throughput", "SM Frequency"): "sm_clock_ghz",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_pct",
    ("GPU Speed Of Light Throughput", "Duration"): "duration_us",
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"): "l2_throughput_pct",
    ("Compute Workload Analysis", "Issue Slots Busy"): "issue_slots_busy_pct",
    ("Scheduler Statistics", "Issued Warp Per Scheduler"): "issued_warps_per_scheduler_cycle",
    ("Scheduler Statistics", "Active Warps Per Scheduler"): "active_warps_per_scheduler",
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"): "eligible_warps_per_scheduler",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "warp_cycles_per_issued_instruction",
    ("Instruction Statistics", "Executed Instructions"): "warp_instructions",
    ("Launch Statistics", "Block Size"): "block",
    ("Launch Statistics", "Grid Size"): "grid",
    ("Launch Statistics", "Registers Per Thread"): "registers_per_thread",
    ("Launch Statistics", "Dynamic Shared Memory Per Block"): "shared_kb_per_cta",
}
DURATION_TO_US = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6}

# bf16 unpacking (a shift by 16 as SHF or as IMAD by 0x10000, the high half masked, a half moved by PRMT)
# and packing (F2FP, PRMT 0x5410)
_BF16 = re.compile(r"^(F2FP\.BF16|SHF\.L\.U32 \S+ \S+ 0x10,|IMAD\.U32 \S+ \S+ 0x10000,|LOP3\.LUT \S+ \S+ 0xffff0000,"
                   r"|PRMT \S+ \S+ 0x(7632|5410),)")
SASS_CLASSES = ("arithmetic (FFMA, FMUL, FADD)", "bf16 conversions", "uniform registers (descriptors)",
                "shared loads", "shared stores", "wgmma", "addresses, barriers, control")


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    return float(text) if text else 0.0


def _instruction(source: str) -> str:
    """A SASS line without its predicate, operands joined by single spaces: 'FFMA R1, R2, R3, R4'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return " ".join(words)


def sass_class(source: str) -> str:
    """The class of one SASS line (one of SASS_CLASSES)."""
    line = _instruction(source)
    opcode = line.split(" ")[0] if line else ""
    base = opcode.split(".")[0]
    if base in ("FFMA", "FMUL", "FADD"):
        return SASS_CLASSES[0]
    if _BF16.match(line):
        return SASS_CLASSES[1]
    if base.startswith("U") or base in ("R2UR", "S2UR"):
        return SASS_CLASSES[2]
    if base == "LDS" or base == "LDSM":
        return SASS_CLASSES[3]
    if base in ("STS", "STSM"):
        return SASS_CLASSES[4]
    if base == "HGMMA":
        return SASS_CLASSES[5]
    return SASS_CLASSES[6]


def read_details(path: Path) -> dict:
    """{kernel name: {summary key: value}} from `ncu --page details --csv` (the first launch of each kernel)."""
    out: dict = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            key = DETAILS.get((row.get("Section Name"), row.get("Metric Name")))
            kernel = out.setdefault(row["Kernel Name"], {"id": row["ID"]})
            if key is None or kernel["id"] != row["ID"] or key in kernel:
                continue
            value = _number(row["Metric Value"])
            if key == "duration_us":
                unit = row.get("Metric Unit", "us")
                if unit not in DURATION_TO_US:
                    raise ValueError(f"ncu details: expected a duration in {', '.join(DURATION_TO_US)}, got {unit!r}")
                value *= DURATION_TO_US[unit]
            kernel[key] = value
    for kernel in out.values():
        kernel.pop("id")
    return out


def read_sass(path: Path) -> dict:
    """{kernel name: [row per SASS line]} from `ncu --page source --csv --print-source sass`."""
    out: dict = {}
    kernel, header = None, None
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernel, header = row[1], None
                out.setdefault(kernel, [])
            elif row[0] == "Address":
                header = row
            elif kernel is not None and header is not None:
                out[kernel].append(dict(zip(header, row)))
    if not out:
        raise ValueError(f"ncu source page {path}: expected 'Kernel Name' and 'Address' rows (ncu -i REPORT --page "
                         "source --csv --print-source sass), found none")
    return out


def summarize_sass(lines: list[dict]) -> dict:
    """The consumer loop by instruction class, and the stall samples without the producer's stage waits."""
    executed = [int(_number(line["Instructions Executed"])) for line in lines]
    per_tile = collections.Counter(e for e in executed if e).most_common(1)[0][0]
    loop = [line for line, e in zip(lines, executed) if e == per_tile]
    classes = collections.Counter(sass_class(line["Source"]) for line in loop)
    waits = [line for k, (line, e) in enumerate(zip(lines, executed))
             if 0 < e < per_tile and _instruction(line["Source"]).startswith("BRA")
             and k > 0 and "SYNCS.PHASECHK" in lines[k - 1]["Source"]]
    wait_ids = {id(line) for line in waits}
    samples = sum(_number(line["Warp Stall Sampling (All Samples)"]) for line in lines)
    reasons = [c for c in lines[0] if c.startswith("stall_") and "(" not in c]
    stalls = {r[len("stall_"):]: sum(_number(line[r]) for line in lines if id(line) not in wait_ids) for r in reasons}
    total = sum(stalls.values()) or 1.0
    top = sorted(stalls.items(), key=lambda item: -item[1])[:8]
    return {"consumer_loop_executions": per_tile,
            "consumer_loop_instructions_per_warp": {c: classes[c] for c in SASS_CLASSES if classes[c]},
            "consumer_loop_instructions_per_warp_total": len(loop),
            "stall_pct_without_the_producers_stage_waits": {r: round(100 * v / total, 1) for r, v in top},
            "producer_stage_wait_samples_pct_of_all": round(
                100 * sum(_number(line["Warp Stall Sampling (All Samples)"]) for line in waits) / (samples or 1.0),
                1)}


def summarize(details_path: Path, sass_path: Path) -> dict:
    """{kernel name: summary} for each kernel in both exports."""
    details, sass = read_details(details_path), read_sass(sass_path)
    return {name: {**details.get(name, {}), **summarize_sass(lines)} for name, lines in sass.items() if lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench ncu-summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("details", type=Path, help="ncu -i REPORT --page details --csv > this file")
    parser.add_argument("sass", type=Path, help="ncu -i REPORT --page source --csv --print-source sass > this file")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--table", action="store_true", help="print a table (a column per kernel) instead of JSON")
    args = parser.parse_args(argv)
    for path in (args.details, args.sass):
        if not path.is_file():
            parser.error(f"expected an exported CSV file, got {path} (not a file)")
    summary = summarize(args.details, args.sass)
    text = json.dumps(summary, indent=1)
    if args.table:  # lab 07's table of the recorded profiles, for this one
        from mhc_lab.course.training_lab import hot_kernels_table

        print(hot_kernels_table({"profile": {"run": args.details.stem, "kernels": summary}}, keys=("profile",)))
    else:
        print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
