"""The fragment-ordered tensor-core kernel vs the product's tuned path, cuBLAS fp16 and torch int4, in one run
(issue 20; H200, ~9 min; no carry needed).

    python3 bench/v3_probe.py            # prints a line per (shape, pattern, B); writes $OUT/v3_probe.json

For the 8B shapes and the default 135M model's, 2:4 / 1:4 / dense INT4 and B = 1, 8, 16, 64: cuBLAS fp16 and torch int4
(``_weight_int4pack_mm``, bf16), the tuned ``nm_int4_linear_triton`` (GEMV or format-2 tensor-core
kernel, whichever the tuner picks), and the best of a small grid of forced ``KernelConfig(fragment=True)``
configs (BLOCK_N 64 / 128, 3 / 4 stages, split-K for ~4 and ~16 programs per SM), each with its error
against an fp32 reference. Times: CUDA-graph replays (L2 warm, median) and ``do_bench`` with the L2
flushed. Every kernel variant is compiled first in 16 processes. Stops after ``--time-budget`` seconds
(default 520; results are written after every shape).
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


def v3_configs(p, b, sms):
    """The forced fragment-ordered configs timed per (layer, B): BLOCK_N 64 / 128 x 3 / 4 stages x split-K
    for ~4 and ~16 programs per SM."""
    from kernels.int4_tuner import KernelConfig, _split_for, tc_block_kk
    bb = 16 if b <= 16 else 64
    kk = tc_block_kk(p.pattern)
    out = []
    for bn in (64, 128):
        for st in (3, 4):
            nb = triton.cdiv(b, bb)
            for s in sorted({_split_for(p, bn, kk, nb, sms), _split_for(p, bn, kk, nb, sms, 16.0)}):
                out.append(KernelConfig(bb, bn, kk, s, True, num_stages=st, fragment=True))
    return out


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
    args = ap.parse_args(argv)
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
    # --- parallel precompile: the fragment-ordered variants and the tuner's candidates
    from kernels.int4_tuner import candidate_configs
    jobs = set()
    for pat in PATS:
        p = random_packed(256, 4096, pat)
        for b in BATCHES:
            for cfg in v3_configs(p, b, sms) + candidate_configs(p, b, sms):
                for split in (1, 2):
                    jobs.add((pat, tuple(sorted(dict(cfg.__dict__, split_k=split).items()))))
    jobs = sorted(jobs)
    t0 = time.time()
    with cf.ProcessPoolExecutor(16, mp_context=mp.get_context("spawn")) as ex:
        n = sum(ex.map(_compile, [jobs[i::16] for i in range(16)]))
    print(f"precompiled {n}/{len(jobs)} in {time.time() - t0:.0f}s", flush=True)
    rows = []
    for n_out, k in SHAPES:
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
                y2 = launcher.nm_int4_linear_triton(x, p)
                torch.cuda.synchronize()
                e2 = ((y2.float() - ref).norm() / ref.norm()).item()
                v2 = gtime(lambda: launcher.nm_int4_linear_triton(x, p))
                v2f = ftime(lambda: launcher.nm_int4_linear_triton(x, p))
                best = None
                for c in v3_configs(p, b, sms):
                    try:
                        fn = lambda c=c: launcher.launch(x, p, None, c)
                        y3 = fn()
                        torch.cuda.synchronize()
                        e3 = ((y3.float() - ref).norm() / ref.norm()).item()
                        t = gtime(fn)
                    except Exception as ex:  # noqa: BLE001
                        print("v3 fail", pat, b, c, repr(ex)[:300], flush=True)
                        continue
                    if best is None or t < best[0]:
                        best = (t, c, e3, fn)
                v3f = ftime(best[3]) if best else None
                row = dict(shape=f"{n_out}x{k}", pattern=pat, B=b, cublas_us=base[b], cublas_flushed_us=base_f[b],
                           torch_int4_us=ti4.get(b), v2_us=v2, v2_flushed_us=v2f, v2_err=e2,
                           v3_us=best[0] if best else None, v3_flushed_us=v3f, v3_err=best[2] if best else None,
                           v3_cfg=dataclasses.asdict(best[1]) if best else None)
                rows.append(row)
                print(f"{row['shape']:>11} {pat} B={b:>2}  fp16 {base[b]:7.1f}  int4 {ti4.get(b, float('nan')):7.1f}  "
                      f"v2 {v2:7.1f} ({base[b] / v2:4.2f}x)  v3 {row['v3_us'] or float('nan'):7.1f} "
                      f"({base[b] / row['v3_us'] if row['v3_us'] else float('nan'):4.2f}x)  flushed v2 {base_f[b] / v2f:4.2f}x "
                      f"v3 {base_f[b] / v3f if v3f else float('nan'):4.2f}x  err v2 {e2:.1e} v3 {row['v3_err'] or float('nan'):.1e}  {row['v3_cfg']}",
                      flush=True)
            del p, wref
            torch.cuda.empty_cache()
        (out_dir / "v3_probe.json").write_text(json.dumps(rows, indent=1))
        if time.time() - t_start > args.time_budget:
            print("time budget reached", flush=True)
            break


if __name__ == "__main__":
    main()
