"""scripts/ncu_sass_summary.py on a hand-made ncu source-page CSV (no GPU, no ncu)."""
import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_sass_summary", ROOT / "scripts" / "ncu_sass_summary.py")
summary_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary_mod)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_wait", "stall_short_sb", "stall_wait (Not Issued)"]


def write(path, kernels):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in kernels:
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (sass, samples, executed, wait, short_sb) in enumerate(rows):
                w.writerow([hex(0x1000 + 16 * i), sass, samples, executed, wait, short_sb, wait // 2])


def test_loop_head_and_reasons(tmp_path):
    # 4 trips of a loop: barrier, 3 copy-side instructions, then the mma; a prologue run once.
    loop = [("MOV R1, R2 ;", 10, 1, 10, 0),
            ("BAR.SYNC.DEFER_BLOCKING 0x0 ;", 20, 4, 20, 0),
            ("IMAD R3, R4, R5, RZ ;", 30, 4, 30, 0),
            ("@P0 LDGSTS.E.BYPASS.128 [R6], desc[UR4][R8.64] ;", 40, 8, 0, 40),
            ("LEA R9, R10, UR4, 0x1 ;", 0, 4, 0, 0),
            ("HMMA.16816.F32 R12, R16, R20, R12 ;", 100, 8, 60, 40),
            ("BRA 0x1010 ;", 0, 4, 0, 0)]
    other = [("EXIT ;", 1, 1, 1, 0)]
    path = tmp_path / "rep.sass.csv"
    write(path, [("kernel_a(int)", loop), ("kernel_b(int)", other)])
    found = summary_mod.kernels(str(path))
    assert [k[0] for k in found] == ["kernel_a(int)", "kernel_b(int)"]
    text = summary_mod.summary(*found[0])
    assert "samples 200" in text
    assert "wait 60.0%" in text and "short_sb 40.0%" in text  # 120 and 80 of 200
    assert "Not Issued" not in text  # the not-issued subset is not a reason of its own
    assert "HMMA 50.0%" in text and "LDGSTS 20.0%" in text  # the predicate is not the opcode
    # 33 executed / 4 trips; head = barrier .. before HMMA: 4 + 4 + 8 + 4 = 20 -> 5 per trip, 2 LDGSTS,
    # (20 + 30 + 40 + 0) / 200 of the samples
    assert "4 warp-trips, 8 instructions (the whole kernel) per warp-trip (2 HMMA)" in text
    assert "5 instructions (2.0 LDGSTS), 45.0% of samples" in text
    assert "loop" not in summary_mod.summary(*found[1])  # no barrier: no loop line
