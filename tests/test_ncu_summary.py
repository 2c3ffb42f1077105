"""The summary of Nsight Compute's CSV exports (mhc_lab.bench.ncu_summary), on small exports written here in
ncu's layout, and its instruction classes on SASS lines as ptxas writes them."""

import csv
import json

import pytest

from mhc_lab.bench import ncu_summary

CONV, ARITH, ADDR = "bf16 conversions", "arithmetic (FFMA, FMUL, FADD)", "addresses, barriers, control"


@pytest.mark.parametrize("line,expected", [
    ("FFMA R1, R2, R3, R4", ARITH), ("FMUL R1, R2, R3", ARITH), ("@P1 FADD R1, R2, R3", ARITH),
    ("LOP3.LUT R5, R6, 0xffff0000, RZ, 0xc0, !PT", CONV), ("LOP3.LUT R13, R0, 0x1f, RZ, 0xc0, !PT", ADDR),
    ("IMAD.U32 R3, R4, 0x10000, RZ", CONV), ("IMAD.U32 R3, RZ, RZ, R4", ADDR),
    ("PRMT R1, R2, 0x7632, R3", CONV), ("PRMT R1, R2, 0x5410, R3", CONV), ("PRMT R1, R2, 0x7610, R3", ADDR),
    ("SHF.L.U32 R1, R2, 0x10, RZ", CONV), ("SHF.L.U32 R1, R2, 0x9, RZ", ADDR),
    ("F2FP.BF16.F32.PACK_AB R1, R2, R3", CONV), ("@!P0 BRA 0x7fe2bf7befb0", ADDR),
    ("R2UR UR4, R5", "uniform registers (descriptors)"),
    ("UIADD3 UR4, UR4, 0x1, URZ", "uniform registers (descriptors)"),
    ("LDS.64 R2, [R3+0x10]", "shared loads"), ("STSM.16.M88.4 [R1], R4", "shared stores"),
    ("STS.64 [R1], R2", "shared stores"), ("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR20].tnspB, RZ, !UPT", "wgmma"),
])
def test_sass_lines_fall_in_their_class(line, expected):
    assert ncu_summary.sass_class(line) == expected


def _details(path, rows):
    head = ["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, quoting=csv.QUOTE_ALL)
        writer.writerow(head)
        writer.writerows(rows)


def _sass(path, kernels):
    reasons = ["stall_long_sb", "stall_selected", "stall_wait"]
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *reasons,
            "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, quoting=csv.QUOTE_ALL)
        for name, lines in kernels.items():
            writer.writerow(["Kernel Name", name, ""])
            writer.writerow(head)
            for k, (source, executed, stalls) in enumerate(lines):
                values = [stalls.get(r[len("stall_"):], 0) for r in reasons]
                writer.writerow([hex(0x100 + 16 * k), source, f"{sum(values):,}", f"{executed:,}", *values, "0"])


def test_summary_counts_the_consumer_loop_and_leaves_out_the_producers_waits(tmp_path):
    _details(tmp_path / "d.csv", [
        ["0", "k", "GPU Speed Of Light Throughput", "Duration", "ms", "1.5"],
        ["0", "k", "GPU Speed Of Light Throughput", "SM Frequency", "Ghz", "1.33"],
        ["0", "k", "Launch Statistics", "Grid Size", "", "1,024"],
        ["0", "k", "Section", "Not summarised", "", "7"],
        ["1", "k", "GPU Speed Of Light Throughput", "Duration", "us", "9"],  # a second launch: not this one
    ])
    loop = [("FFMA R1, R2, R3, R4", 80, {"selected": 30}), ("FFMA R1, R2, R3, R5", 80, {"wait": 10}),
            ("LOP3.LUT R5, R6, 0xffff0000, RZ, 0xc0, !PT", 80, {}),
            ("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR20], RZ", 80, {}),
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x20], R0", 80, {}),
            ("@!P1 BRA 0x400", 80, {"long_sb": 20})]  # the consumers' own wait for a full stage: counted
    producer = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R3", 40, {}),
                ("@!P0 BRA 0x300", 40, {"long_sb": 60}),  # the producer's wait for a free stage: left out
                ("@!P0 BRA 0x380", 40, {"long_sb": 5}), ("IADD3 R1, R2, 0x1, RZ", 1, {"wait": 5})]
    _sass(tmp_path / "s.csv", {"k": loop + producer, "empty": []})
    got = ncu_summary.summarize(tmp_path / "d.csv", tmp_path / "s.csv")
    assert list(got) == ["k"]
    k = got["k"]
    assert k["duration_us"] == 1500.0 and k["sm_clock_ghz"] == 1.33 and k["grid"] == 1024.0
    assert "Not summarised" not in json.dumps(k)
    assert k["consumer_loop_executions"] == 80 and k["consumer_loop_instructions_per_warp_total"] == 6
    assert k["consumer_loop_instructions_per_warp"] == {ARITH: 2, CONV: 1, "wgmma": 1, ADDR: 2}
    # 130 samples, 60 in the producer's wait; the rest: selected 30, long_sb 20 + 5, wait 10 + 5
    assert k["producer_stage_wait_samples_pct_of_all"] == pytest.approx(100 * 60 / 130, abs=0.05)
    assert k["stall_pct_without_the_producers_stage_waits"] == {"selected": 42.9, "long_sb": 35.7, "wait": 21.4}


def test_summary_refuses_what_is_not_ncus_export(tmp_path, capsys):
    (tmp_path / "s.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="expected 'Kernel Name' and 'Address' rows"):
        ncu_summary.read_sass(tmp_path / "s.csv")
    _details(tmp_path / "d.csv", [["0", "k", "GPU Speed Of Light Throughput", "Duration", "fortnight", "1"]])
    with pytest.raises(ValueError, match="expected a duration in ns, us, .* got 'fortnight'"):
        ncu_summary.read_details(tmp_path / "d.csv")
    with pytest.raises(SystemExit):
        ncu_summary.main([str(tmp_path / "missing.csv"), str(tmp_path / "s.csv")])
    assert "expected an exported CSV file, got" in capsys.readouterr().err


def test_summary_command_writes_what_it_prints(tmp_path, capsys):
    _details(tmp_path / "d.csv", [["0", "k", "Compute Workload Analysis", "Issue Slots Busy", "%", "46.08"]])
    _sass(tmp_path / "s.csv", {"k": [("FFMA R1, R2, R3, R4", 8, {"selected": 1})]})
    from mhc_lab.bench import main

    assert main(["ncu-summary", str(tmp_path / "d.csv"), str(tmp_path / "s.csv"), "--json",
                 str(tmp_path / "out.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out.json").read_text())
    assert printed["k"]["issue_slots_busy_pct"] == 46.08
    assert printed["k"]["consumer_loop_instructions_per_warp"] == {ARITH: 1}


def test_summary_command_prints_a_table_of_its_kernels(tmp_path, capsys):
    _details(tmp_path / "d.csv", [["0", "k", "GPU Speed Of Light Throughput", "Duration", "us", "557.4"]])
    _sass(tmp_path / "s.csv", {"k": [("FFMA R1, R2, R3, R4", 8, {}), ("LDS R1, [R2]", 8, {})]})
    from mhc_lab.bench import main

    assert main(["ncu-summary", str(tmp_path / "d.csv"), str(tmp_path / "s.csv"), "--table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Nsight Compute" and lines[1].split() == ["k"] and lines[2].split() == ["run", "d"]
    assert next(x for x in lines if x.startswith("time")).split()[-1] == "557"
    assert next(x for x in lines if x.startswith("instructions per warp")).split()[-1] == "2"
    assert next(x for x in lines if x.strip().startswith("shared loads")).split()[-1] == "1"
