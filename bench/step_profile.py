"""Profile of the decode engine's step on a GPU: where a beam-search step's time goes.

Not a test. On a random-init bf16 model of the default model's shape (SmolLM2-135M; ``--shape 8b``
for Llama-3-8B's), built by ``bench/decode.py``'s ``build_model``:

1. **kernel check**: :func:`kernels.decode_attention.decode_attention` against its torch reference in
   bf16 at this shape's heads (the CPU tests can only run fp16 under the interpreter).
2. **step table**: graph-replayed ``DecodeEngine.step`` (the product's step: the same entry point
   ``search_targets`` calls) at query batches ``--queries`` x ``--beams`` slot rows and suffix
   positions ``--positions``, median of ``--repeats`` replays, next to the step's roofline on an
   H200 (GEMM FLOPs at the bf16 tensor-core peak, or weights + K/V + logits bytes at HBM bandwidth).
3. **kernel profile**: one step at the largest row count (its body run eagerly: a replayed graph hides
   its kernels) under ``torch.profiler``: the top kernels by
   device time, how many kernels a step launches and their summed time.

    python bench/step_profile.py --out $OUT/step_profile.md
    python bench/step_profile.py --smoke      # CPU, seconds: a tiny model's eager step (see --smoke's help)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import SHAPES, build_model, random_prompts  # noqa: E402
from adbatch.decoding.engine import engine_for  # noqa: E402
from kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402


def attention_inputs(model, beams: int, dev, Qb: int, Lp: int = 48, S: int = 32) -> tuple:
    cfg = model.config
    kv, H = cfg.num_key_value_heads, cfg.num_attention_heads
    D = cfg.hidden_size // H
    R = Qb * beams
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, kp, vp = rn(R, H, D), rn(Qb, kv, Lp, D), rn(Qb, kv, Lp, D)
    ks, vs = rn(S, R, kv, D), rn(S, R, kv, D)
    plen = torch.randint(1, Lp + 1, (Qb,), device=dev, generator=g)
    valid = torch.arange(Lp, device=dev)[None] >= Lp - plen[:, None]
    pb = torch.where(valid, 0.0, float("-inf"))
    pp = (valid.long().cumsum(-1) - 1).clamp(min=0)
    # a path's slots are its own query's beams (as beam search writes them)
    own = (torch.arange(R, device=dev) // beams * beams)[:, None]
    anc = (own + torch.randint(0, beams, (R, S), device=dev, generator=g)).to(torch.int32)
    return q, kp, vp, pb, pp, plen, ks, vs, anc, D


def kernel_check(model, beams: int, dev) -> dict:
    t = 17
    *args, D = attention_inputs(model, beams, dev, 64)
    q, kp, vp, pb, pp, plen, ks, vs, anc = args
    out = {}
    for window in (0, 8):
        a = decode_attention(q, kp, vp, pb, pp, plen, ks, vs, anc, torch.tensor([t], device=dev), beams, D ** -0.5, window)
        b = decode_attention_reference(q, kp, vp, pb, pp, plen, ks, vs, anc, t, beams, D ** -0.5, window)
        out[f"max_abs_err_window{window}"] = float((a.float() - b.float()).abs().max())
    return out


PEAK_BF16_FLOPS = 989e12   # H200 SXM dense bf16 tensor-core peak
PEAK_HBM_BYTES = 4.8e12    # H200 HBM3e


def roofline_ms(model, eng, rows: int, queries: int, t: int) -> float:
    """Lower bound of one step: max(GEMM FLOPs / peak, bytes that must move / HBM bandwidth), with
    the bytes = weights once + the prompt and path K/V read + the logits written and read once."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops = 2.0 * rows * linear
    L, kv, D, Lp, V = len(eng.layers), eng.n_kv, eng.head_dim, eng.Lp, eng.vocab
    kv_bytes = 2 * 2 * L * kv * D * (queries * Lp + rows * (t + 1))
    moved = 2 * linear + kv_bytes + 2 * 2 * rows * V
    return 1e3 * max(flops / PEAK_BF16_FLOPS, moved / PEAK_HBM_BYTES)


def eager_step_ms(eng, queries, qn: int, beams: int, t: int, suffix: int, repeats: int) -> float:
    """Median ms of an eager ``DecodeEngine.step`` (the CPU path: no CUDA graphs), after one untimed step."""
    eng.prefill(queries[:qn], beams, suffix)
    Qb = eng.bucket(qn)
    tok = torch.randint(100, 1000, (Qb * beams,))
    ts = []
    with torch.no_grad():
        for i in range(repeats + 1):
            t1 = time.perf_counter()
            eng.step(tok, t, Qb)
            ts.append(time.perf_counter() - t1)
    return 1e3 * float(np.median(ts[1:]))


def smoke(args) -> None:
    """The CPU-able part of this script: a tiny model of the shape's architecture, its engine, eager steps and
    the roofline arithmetic. The kernel check (bf16 Triton), graph replay and the CUDA profiler need a GPU."""
    model = build_model(args.shape, torch.device("cpu"), smoke=True)
    eng = engine_for(model)
    queries = random_prompts(4, 8, 100, 1000, seed=0)
    lines = [f"# Decode step smoke ({args.shape} architecture, tiny, CPU, eager; times mean nothing)", "",
             "| queries | beams | rows | t | step ms (eager) | roofline ms (H200) |", "|---:|---:|---:|---:|---:|---:|"]
    for qn in (1, 4):
        ms = eager_step_ms(eng, queries, qn, 2, 1, 6, 2)
        R = eng.bucket(qn) * 2
        lines.append(f"| {qn} | 2 | {R} | 1 | {ms:.2f} | {roofline_ms(model, eng, R, eng.bucket(qn), 1):.4f} |")
    write_report(lines, args.out)


def graphed_step_ms(eng, queries, qn: int, beams: int, t: int, suffix: int, repeats: int, dev) -> tuple[float, float]:
    """(median ms of a graph-replayed ``DecodeEngine.step`` at ``qn`` queries x ``beams`` rows and suffix
    position ``t``, seconds of its first call: prefill + planning + capture)."""
    t0 = time.perf_counter()
    eng.prefill(queries[:qn], beams, suffix)
    Qb = eng.bucket(qn)
    R = Qb * beams
    tok = torch.randint(100, 40000, (R,), device=dev)
    par = torch.randperm(R, device=dev)
    eng.step(tok, t, Qb, par)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ts = []
    for _ in range(repeats):
        t1 = time.perf_counter()
        eng.step(tok, t, Qb, par)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t1)
    return 1e3 * float(np.median(ts)), first


def write_report(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def attention_sweep(model, beams: int, dev, queries: list[int], t: int) -> list[str]:
    """Graph-replayed time of one layer's decode attention per launch configuration (block_j,
    num_warps, num_stages) at each query batch: which configuration the kernel should default to."""
    from kernels.int4_tuner import time_graphed_ms

    lines = ["| queries | rows | block_j | warps | stages | us | x default |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for qn in queries:
        *args, D = attention_inputs(model, beams, dev, qn)
        tt = torch.tensor([t], device=dev)
        res = {}
        for bj in (32, 64, 128):
            for w in (2, 4, 8):
                for st in (1, 2, 3):
                    try:
                        res[(bj, w, st)] = 1e3 * time_graphed_ms(
                            lambda: decode_attention(*args, tt, beams, D ** -0.5, 0, block_j=bj, num_warps=w,
                                                     num_stages=st), "warm")
                    except Exception as exc:  # a config the compiler refuses (shared memory)
                        print(f"config {(bj, w, st)}: {type(exc).__name__}", flush=True)
        base = 1e3 * time_graphed_ms(lambda: decode_attention(*args, tt, beams, D ** -0.5, 0), "warm")
        for (bj, w, st), us in sorted(res.items(), key=lambda kv: kv[1])[:6]:
            lines.append(f"| {qn} | {qn * beams} | {bj} | {w} | {st} | {us:.1f} | {base / us:.2f} |")
        lines.append(f"| {qn} | {qn * beams} | default | | | {base:.1f} | 1.00 |")
        print("\n".join(lines[-7:]), flush=True)
    return lines


def tree_profile(eng, queries, args, dev) -> list[str]:
    """Wall time (eager, as verification runs it) and top kernels of one tree pass: every beam of
    ``q`` queries scores a chain of ``F`` tokens below its path at suffix position ``t``."""
    from torch.profiler import ProfilerActivity, profile

    lines = ["", "tree pass (eager): chains of F tokens below every beam at t = 8", "",
             "| queries | beams | F | tree tokens | wall ms (median) | kernels | top kernels (ms) |", "|---:|---:|---:|---:|---:|---:|---|"]
    t = 8
    for qn in args.queries:
        for Fn in args.tree:
            eng.prefill(queries[:qn], args.beams, t + Fn + 4)
            Qb = eng.bucket(qn)
            R = Qb * args.beams
            for s in range(t):
                eng.step(torch.randint(100, 40000, (R,), device=dev), s, Qb)
            rows = torch.arange(R, device=dev)
            tokens = torch.randint(100, 40000, (R, Fn), device=dev)
            pos = eng.prompt_len[rows // args.beams][:, None] + t + torch.arange(Fn, device=dev)[None]
            vis = torch.ones(Fn, Fn, dtype=torch.bool, device=dev).tril()[None].expand(R, Fn, Fn)
            ts = []
            for _ in range(max(3, args.repeats // 4)):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                eng.tree_forward(rows, t, tokens, pos, vis)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t1)
            with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
                eng.tree_forward(rows, t, tokens, pos, vis)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
            agg: dict[str, float] = {}
            for e in ev:
                agg[e.name[:40]] = agg.get(e.name[:40], 0.0) + e.device_time / 1e3
            top = ", ".join(f"`{n}` {v:.2f}" for n, v in sorted(agg.items(), key=lambda kv: -kv[1])[:4])
            row = f"| {qn} | {args.beams} | {Fn} | {R * Fn} | {1e3 * float(np.median(ts)):.2f} | {len(ev)} | {top} |"
            lines.append(row)
            print(row, flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="default")
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--queries", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256, 1024])
    ap.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=[4, 28])
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--attention-sweep", action="store_true", help="also time decode attention's launch configs")
    ap.add_argument("--tree", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="also profile eager tree passes of chains of these lengths")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: a tiny model's eager steps and roofline only (the kernel check, graphs and profiler need CUDA)")
    args = ap.parse_args()
    if args.smoke:
        return smoke(args)
    dev = torch.device("cuda")
    model = build_model(args.shape, dev, smoke=False)
    lines = [f"# Decode step profile ({args.shape} shape, bf16, {torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    chk = kernel_check(model, args.beams, dev)
    lines += [f"kernel check (bf16, 64 queries x {args.beams} beams, t = 17): {json.dumps(chk)}", ""]
    print(lines[-2], flush=True)
    if args.attention_sweep:
        lines += ["decode attention, one layer, t = 28 (best six configurations per batch):", ""]
        lines += attention_sweep(model, args.beams, dev, args.queries, 28) + [""]
    eng = engine_for(model)
    queries = random_prompts(max(args.queries), args.prompt_len, 100, 40000, seed=0)
    lines += ["| queries | beams | rows | t | step ms (graph) | roofline ms | of roofline | first call s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for qn in args.queries:
        for t in args.positions:
            ms, first = graphed_step_ms(eng, queries, qn, args.beams, t, max(args.positions) + 4, args.repeats, dev)
            Qb = eng.bucket(qn)
            R = Qb * args.beams
            roof = roofline_ms(model, eng, R, Qb, t)
            row = f"| {qn} | {args.beams} | {R} | {t} | {ms:.2f} | {roof:.2f} | {roof / ms:.0%} | {first:.1f} |"
            lines.append(row)
            print(row, flush=True)
    from torch.profiler import ProfilerActivity, profile

    qn, t = max(args.queries), max(args.positions)
    eng.prefill(queries[:qn], args.beams, t + 4)
    Qb = eng.bucket(qn)
    R = Qb * args.beams
    tok = torch.randint(100, 40000, (R,), device=dev)
    par = torch.randperm(R, device=dev)
    eng.step(tok, t, Qb, par)  # sets the engine's step inputs; the profile runs the same body eagerly
    torch.cuda.synchronize()   # (a replayed graph hides its kernels from the profiler)
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        eng._step_body(Qb)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in ev) / 1e3
    agg: dict[str, list[float]] = {}
    for e in ev:
        agg.setdefault(e.name[:70], []).append(e.device_time / 1e3)
    top = sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:15]
    lines += ["", f"kernel profile, one graph-replayed step at {R} rows, t = {t}: {len(ev)} kernels, "
                  f"{total:.2f} ms summed", "", "| kernel | calls | ms | share |", "|---|---:|---:|---:|"]
    lines += [f"| `{n}` | {len(v)} | {sum(v):.3f} | {100 * sum(v) / total:.1f} % |" for n, v in top]
    if args.tree:
        lines += tree_profile(eng, queries, args, dev)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
