"""Format 2 vs the fragment-ordered copy (v3) on the product's own tuner, next to cuBLAS fp16 and torch int4,
in one run (issue 20; H200 or H100, ~4-8 min; no carry needed).

    python3 bench/v3_probe.py            # prints a line per (shape, pattern, B); writes $OUT/v3_probe.json

For the 8B shapes and the default 135M model's, 2:4 / 1:4 / dense INT4 and B = 1, 8, 16, 64: cuBLAS fp16 and
torch int4 (``_weight_int4pack_mm``, bf16); the product's dispatch (``nm_int4_linear_triton``, tuned by
:data:`kernels.int4_launch.TUNER` with its defaults) with its error against an fp32 reference; and, from
the tuner's log of the same tuning, the best config of each kernel family (GEMV, format-2 tensor-core,
fragment-ordered tensor-core) with the L2 warm (CUDA-graph replays, the tuner's default) and cold (flushed
before every call, in graphs). Every candidate is compiled first in 16 processes. Stops after
``--time-budget`` seconds (default 520; results are written after every shape).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton

# the headline shape first, then the shipped default model's (SmolLM2-135M: MLP 1536x576 / 576x1536,
# attention 576x576 and the 192-row k/v projections), then the other 8B shapes
SHAPES = [(8192, 28672), (1536, 576), (576, 1536), (576, 576), (192, 576), (28672, 8192), (4096, 14336), (14336, 4096)]
BATCHES = [1, 8, 16, 64]
PATS = ["2:4", "1:4", "4:4"]


def _compile(jobs):
    """Compile (launch once) each (pattern, KernelConfig items) job on a small layer; split 1 and 2 cover
    the split-K specializations."""
    from kernels import int4_launch as launcher
    from kernels.int4_tuner import KernelConfig
    from kernels.nm_int4 import random_packed
    n, packed = 0, {}
    for pat, items in jobs:
        if pat not in packed:
            packed[pat] = random_packed(256, 4096, pat, device="cuda")
        cfg = KernelConfig(**dict(items))
        x = torch.randn(max(cfg.block_b, 2), 4096, device="cuda").half()
        try:
            launcher.launch(x, packed[pat], None, cfg)
            n += 1
        except Exception as e:  # noqa: BLE001
            print("compile fail", pat, cfg, repr(e)[:300], flush=True)
    torch.cuda.synchronize()
    return n


def gtime(fn):
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def ftime(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-budget", type=float, default=520.0, help="stop after this many seconds")
    ap.add_argument("--shapes", default="", help="comma list NxK (default: all, in SHAPES order)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    t_start = time.time()
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    from kernels import int4_launch as launcher
    from kernels.nm_int4 import dequantize_nm_int4, random_packed
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).resolve().parent / "kernels.py")
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # --- parallel precompile of every candidate the tuner will time
    from kernels.int4_tuner import candidate_configs
    jobs = set()
    for pat in PATS:
        p = random_packed(256, 4096, pat)
        for b in BATCHES:
            for cfg in candidate_configs(p, b, sms):
                for split in (1, 2):
                    jobs.add((pat, tuple(sorted(dict(cfg.__dict__, split_k=split).items()))))
    jobs = sorted(jobs)
    t0 = time.time()
    with cf.ProcessPoolExecutor(16, mp_context=mp.get_context("spawn")) as ex:
        n = sum(ex.map(_compile, [jobs[i::16] for i in range(16)]))
    print(f"precompiled {n}/{len(jobs)} in {time.time() - t0:.0f}s", flush=True)
    rows = []
    for n_out, k in shapes:
        torch.manual_seed(n_out + k)
        w16 = (torch.randn(n_out, k, device="cuda") / math.sqrt(k)).half()
        xs = {b: (torch.randn(b, k, device="cuda") + 0.05).half() for b in BATCHES}
        base = {b: gtime(lambda b=b: F.linear(xs[b], w16)) for b in BATCHES}
        base_f = {b: ftime(lambda b=b: F.linear(xs[b], w16)) for b in BATCHES}
        try:
            wq, sz, _ = kb._torch_int4(n_out, k, "cuda")
            xb = {b: xs[b].bfloat16() for b in BATCHES}
            ti4 = {b: gtime(lambda b=b: torch._weight_int4pack_mm(xb[b], wq, 128, sz)) for b in BATCHES}
        except Exception as e:  # noqa: BLE001
            print("torch int4 failed", repr(e)[:200])
            ti4 = {}
        del w16
        for pat in PATS:
            p = random_packed(n_out, k, pat, device="cuda")
            wref = dequantize_nm_int4(p)
            for b in BATCHES:
                x = xs[b]
                ref = x.float() @ wref.t()
                launcher.TUNER.start_tune_log()
                y = launcher.nm_int4_linear_triton(x, p)  # tunes this (shape, bucket): every candidate logged
                log = launcher.TUNER.tune_log()
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                tuned = gtime(lambda: launcher.nm_int4_linear_triton(x, p))
                tuned_f = ftime(lambda: launcher.nm_int4_linear_triton(x, p))
                cfg = launcher.TUNER.lookup(p, b, x.dtype, x.device)
                fams = {}
                for e in log:
                    c = e["config"]
                    fam = "frag" if c["fragment"] else "tc" if c["use_dot"] else "gemv"
                    for l2 in ("warm", "cold"):
                        if fam + "_" + l2 not in fams or e[f"{l2}_us"] < fams[fam + "_" + l2]:
                            fams[fam + "_" + l2] = e[f"{l2}_us"]
                            if l2 == "warm":
                                fams[fam + "_cfg"] = c
                row = dict(shape=f"{n_out}x{k}", pattern=pat, B=b, cublas_us=base[b], cublas_flushed_us=base_f[b],
                           torch_int4_us=ti4.get(b), tuned_us=tuned, tuned_flushed_us=tuned_f, tuned_err=err,
                           tuned_cfg=dataclasses.asdict(cfg) if cfg else None, candidates=len(log), **fams)
                rows.append(row)

                def fx(key, row=row, base=base[b]):
                    v = row.get(key)
                    return f"{v:7.1f} ({base / v:4.2f}x)" if v else "      -         "
                print(f"{row['shape']:>11} {pat} B={b:>2}  fp16 {base[b]:7.1f}  int4 {fx('torch_int4_us')}  "
                      f"tuned {fx('tuned_us')} err {err:.1e} [{'frag' if cfg and cfg.fragment else 'tc' if cfg and cfg.use_dot else 'gemv'}]  "
                      f"gemv {fx('gemv_warm')}  tc {fx('tc_warm')}  frag {fx('frag_warm')}  "
                      f"cold: fp16 {base_f[b]:7.1f} tc {row.get('tc_cold') or float('nan'):7.1f} "
                      f"frag {row.get('frag_cold') or float('nan'):7.1f} gemv {row.get('gemv_cold') or float('nan'):7.1f}",
                      flush=True)
            del p, wref
            torch.cuda.empty_cache()
        (out_dir / "v3_probe.json").write_text(json.dumps(rows, indent=1))
        if time.time() - t_start > args.time_budget:
            print("time budget reached", flush=True)
            break


if __name__ == "__main__":
    main()
