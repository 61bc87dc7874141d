"""SASS instruction mix of the SparseGemv kernels' K loop, per kept weight value (no GPU needed).

Compiles the SparseGemv kernels (``kernels/gemv_int4.py``, ``kernels/tc_int4.py``) for sm_90 (Triton
compiles for a GPUTarget without a device), disassembles the cubin with the ``cuobjdump`` bundled in the Triton wheel, finds the main K
loop (the backward branch spanning the most instructions) and divides its static instruction counts by
the kept values one thread handles per iteration (``BLOCK_N * BLOCK_KK / (32 * num_warps)``). Each loop
instruction runs once per iteration per thread, so this is "instructions per kept value per thread",
the ALU cost that has to hide under the memory time. It says nothing about stalls or occupancy.

Usage (here or on the device):
    python3 bench/kernel_sass.py                      # default table: GEMV vs tensor-core kernel at B = 8, 16, 64
    python3 bench/kernel_sass.py --out DIR            # also writes DIR/kernel_sass.md and .json
    python3 bench/kernel_sass.py --dump DIR           # also the full SASS of every kernel
    python3 bench/kernel_sass.py --smoke              # one variant, seconds (the CPU smoke test)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU (inline PTX), never the interpreter

import triton  # noqa: E402

from kernels.int4_launch import compile_offline  # noqa: E402
from kernels.int4_tuner import GEMV_MAX_BATCH, KernelConfig, tc_block_kk  # noqa: E402
from kernels.nm_int4 import SparsityPattern  # noqa: E402

# instruction classes (first matching prefix wins), in table order
CLASSES = [
    ("mma", ("HGMMA", "HMMA", "WARPGROUP")),
    ("lop3", ("LOP3",)),
    ("prmt", ("PRMT",)),
    ("shift", ("SHF", "SHL", "SHR")),
    ("half", ("HFMA2", "HADD2", "HMUL2", "HSET2", "HMNMX2")),
    ("cvt", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")),
    ("fp32", ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP")),
    ("lds", ("LDS", "LDSM")),
    ("sts", ("STS", "STSM")),
    ("ldg", ("LDG", "LDGSTS", "UTMALDG", "LDGDEPBAR", "DEPBAR")),
    ("int/addr", ("IMAD", "IADD3", "LEA", "IABS", "IMNMX", "VIADD", "VIMNMX", "MOV", "UMOV", "UIADD3", "ULEA",
                  "UIMAD", "S2R", "S2UR", "CS2R", "R2UR", "USHF", "ULOP3", "SGXT")),
    ("cmp/sel", ("ISETP", "SEL", "PLOP3", "P2R", "R2P", "UISETP", "USEL")),
    ("sync", ("BAR", "WARPSYNC", "SYNCS", "FENCE", "MEMBAR", "ARRIVES", "UCGABAR")),
]


def _tool(name: str) -> str:
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def compile_sass(cfg: KernelConfig, pattern: SparsityPattern, bf16: bool = False, split: bool = False) -> str:
    kernel = compile_offline(cfg, pattern, bf16, split)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        return subprocess.run([_tool("cuobjdump"), "-sass", str(path)], check=True, capture_output=True, text=True).stdout


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def main_loop(sass: str) -> list[str]:
    """Opcodes (predicate stripped) of the backward-branch region with the most instructions."""
    ins: list[tuple[int, str]] = []
    for m in _LINE.finditer(sass):
        ins.append((int(m.group(1), 16), m.group(2).strip()))
    best: tuple[int, int] | None = None
    for idx, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = next(i for i, (a, _) in enumerate(ins) if a >= int(m.group(1), 16))
            if best is None or idx - start > best[1] - best[0]:
                best = (start, idx)
    if best is None:
        return []
    ops = []
    for _, text in ins[best[0]: best[1] + 1]:
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        ops.append(text.split()[0])
    return ops


def classify(ops: list[str]) -> dict[str, int]:
    out = collections.Counter()
    for op in ops:
        base = op.split(".")[0]
        for name, prefixes in CLASSES:
            if base.startswith(prefixes):
                out[name] += 1
                break
        else:
            out["other"] += 1
    return dict(out)


def variants(batches: list[int]) -> list[tuple[str, SparsityPattern, int, KernelConfig]]:
    """(label, pattern, B, config): the GEMV at B <= 8 and the tensor-core kernel with BLOCK_N = 64 and with
    BLOCK_N = 128 (the heuristic)."""
    out = []
    for pattern in (SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR, SparsityPattern.DENSE):
        for b in batches:
            bt = max(16, b)
            if b <= GEMV_MAX_BATCH:
                out.append(("gemv", pattern, b, KernelConfig(b, 64, 64, 1, False)))
            out.append(("tc", pattern, b, KernelConfig(bt, 64, tc_block_kk(pattern), 1, True)))
            out.append(("tc", pattern, b, KernelConfig(bt, 128, tc_block_kk(pattern), 1, True)))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8,16,64")
    ap.add_argument("--bf16", action="store_true", help="bf16 activations instead of fp16")
    ap.add_argument("--out", help="directory for kernel_sass.md / kernel_sass.json")
    ap.add_argument("--dump", help="directory for the full SASS of every variant")
    ap.add_argument("--smoke", action="store_true",
                    help="one variant (2:4 tensor cores, B = 16, BLOCK_N 128): the compile-and-count plumbing in seconds")
    args = ap.parse_args(argv)
    rows = []
    names = [c for c, _ in CLASSES] + ["other"]
    header = "| kernel | pattern | B | config | loop instr | kept/thread | instr/kept | " + " | ".join(names) + " |"
    lines = [header, "|" + "---|" * (7 + len(names))]
    todo = variants([int(v) for v in args.batches.split(",")])
    if args.smoke:
        todo = [v for v in variants([16]) if v[1] is SparsityPattern.TWO_FOUR and v[3].block_n == 128]
    for label, pattern, b, cfg in todo:
        try:
            sass = compile_sass(cfg, pattern, args.bf16)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{label} {pattern.value} B={b}: compile failed: {e!r}"[:400], flush=True)
            continue
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / f"{label}_{pattern.value.replace(':', 'of')}_B{b}.sass").write_text(sass)
        ops = main_loop(sass)
        per_thread = cfg.block_n * cfg.block_kk / (32 * cfg.num_warps)
        cls = classify(ops)
        row = dict(kernel=label, pattern=pattern.value, batch=b, config=dict(cfg.__dict__), loop=len(ops),
                   kept_per_thread=per_thread, per_kept=len(ops) / per_thread,
                   classes={k: round(v / per_thread, 3) for k, v in cls.items()})
        rows.append(row)
        tile = f"b{cfg.block_b} n{cfg.block_n} kk{cfg.block_kk} w{cfg.num_warps}"
        lines.append(f"| {label} | {pattern.value} | {b} | {tile} | {len(ops)} | {per_thread:g} | {len(ops) / per_thread:.2f} | "
                     + " | ".join(f"{cls.get(n, 0) / per_thread:.2f}" for n in names) + " |")
        print(lines[-1], flush=True)
    text = (f"SASS per kept value in the main K loop (sm_90, triton {triton.__version__}, "
            f"{'bf16' if args.bf16 else 'fp16'} activations); class columns are per kept value too.\n\n" + "\n".join(lines) + "\n")
    print()
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kernel_sass.md").write_text(text)
        (Path(args.out) / "kernel_sass.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
