"""Profile of the decode engine's step on a GPU: where a beam-search step's time goes.

Not a test. On a random-init bf16 model of the default model's shape (SmolLM2-135M; ``--shape 8b``
for Llama-3-8B's), built by ``bench/decode.py``'s ``build_model``:

1. **kernel check**: :func:`kernels.decode_attention.decode_attention` against its torch reference in
   bf16 at this shape's heads (the CPU tests can only run fp16 under the interpreter).
2. **step table**: graph-replayed ``DecodeEngine.step`` (the product's step: the same entry point
   ``search_targets`` calls) at query batches ``--queries`` x ``--beams`` slot rows and suffix
   positions ``--positions``, median of ``--repeats`` replays; and the graph-replayed plain forward
   of the same rows (HF's model over one token per row with a static cache of the same length: the
   limit the issue names) where ``--limit`` is given.
3. **kernel profile**: one step at the largest row count (its body run eagerly: a replayed graph hides
   its kernels) under ``torch.profiler``: the top kernels by
   device time, how many kernels a step launches and their summed time.

    python bench/step_profile.py --out bench/results/step_profile_default.md
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


def kernel_check(model, beams: int, dev) -> dict:
    cfg = model.config
    kv, H = cfg.num_key_value_heads, cfg.num_attention_heads
    D = cfg.hidden_size // H
    Qb, Lp, S, t = 64, 48, 32, 17
    R = Qb * beams
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, kp, vp = rn(R, H, D), rn(Qb, kv, Lp, D), rn(Qb, kv, Lp, D)
    ks, vs = rn(S, R, kv, D), rn(S, R, kv, D)
    plen = torch.randint(1, Lp + 1, (Qb,), device=dev, generator=g)
    valid = torch.arange(Lp, device=dev)[None] >= Lp - plen[:, None]
    pb = torch.where(valid, 0.0, float("-inf"))
    pp = (valid.long().cumsum(-1) - 1).clamp(min=0)
    anc = torch.randint(0, R, (R, S), device=dev, generator=g, dtype=torch.int32)
    out = {}
    for window in (0, 8):
        a = decode_attention(q, kp, vp, pb, pp, plen, ks, vs, anc, torch.tensor([t], device=dev), beams, D ** -0.5, window)
        b = decode_attention_reference(q, kp, vp, pb, pp, plen, ks, vs, anc, t, beams, D ** -0.5, window)
        out[f"max_abs_err_window{window}"] = float((a.float() - b.float()).abs().max())
    return out


def graph_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def hf_forward_ms(model, rows: int, ctx: int, repeats: int, dev) -> float:
    """HF's own forward over ``rows`` x 1 token with a StaticCache of ``ctx`` tokens, graph-replayed."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_batch_size=rows, max_cache_len=ctx + 8, device=dev,
                        dtype=torch.bfloat16) if "max_batch_size" in StaticCache.__init__.__code__.co_varnames \
        else StaticCache(config=model.config, max_cache_len=ctx + 8)
    ids = torch.randint(100, 40000, (rows, 1), device=dev)
    pos = torch.full((1,), ctx, device=dev, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=torch.randint(100, 40000, (rows, ctx), device=dev), past_key_values=cache,
              cache_position=torch.arange(ctx, device=dev), use_cache=True)
        return graph_ms(lambda: model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True),
                        repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="default")
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--queries", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256, 1024])
    ap.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=[4, 28])
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--limit", action="store_true", help="also time HF's graph-replayed forward")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(args.shape, dev, smoke=False)
    lines = [f"# Decode step profile ({args.shape} shape, bf16, {torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    chk = kernel_check(model, args.beams, dev)
    lines += [f"kernel check (bf16, 64 queries x {args.beams} beams, t = 17): {json.dumps(chk)}", ""]
    print(lines[-2], flush=True)
    eng = engine_for(model)
    queries = random_prompts(max(args.queries), args.prompt_len, 100, 40000, seed=0)
    lines += ["| queries | beams | rows | t | step ms (graph) | HF forward ms (graph) | first call s |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for qn in args.queries:
        for t in args.positions:
            t0 = time.perf_counter()
            eng.prefill(queries[:qn], args.beams, max(args.positions) + 4)
            Qb = eng.bucket(qn)
            R = Qb * args.beams
            tok = torch.randint(100, 40000, (R,), device=dev)
            par = torch.randperm(R, device=dev)
            eng.step(tok, t, Qb, par)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ts = []
            for _ in range(args.repeats):
                t1 = time.perf_counter()
                eng.step(tok, t, Qb, par)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t1)
            ms = 1e3 * float(np.median(ts))
            hf = None
            if args.limit:
                try:
                    hf = hf_forward_ms(model, R, args.prompt_len + t, args.repeats, dev)
                except Exception as exc:  # the limit is a reference; its failure must not end the profile
                    print(f"HF graph-replayed forward failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            row = f"| {qn} | {args.beams} | {R} | {t} | {ms:.2f} | {'' if hf is None else f'{hf:.2f}'} | {first:.1f} |"
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
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
