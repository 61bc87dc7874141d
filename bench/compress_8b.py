"""Compress an 8B-shaped random-init Llama end to end, without Ray: layer-wise calibration on the GPU,
then importance analysis, layer-adaptive plan, adaptive INT4 and packing of all 224 linears, with the
per-layer math on the GPU (``SequentialExecutor(device=...)``, the loop the Ray path mirrors).

    python bench/compress_8b.py --out DIR                 # GPU: Llama-3-8B shapes, 8 x 512 tokens
    python bench/compress_8b.py --smoke --out DIR         # CPU smoke test: 2 layers, width 128

Structure and cost only: the weights are random, so the chosen patterns and any quality are
meaningless. Prints a phase table (seconds, peak GPU memory, peak host RSS) plus bits/weight and
packed bytes, and writes the same to ``DIR/compress_8b.md`` (+ ``compress_8b.json``).
Third-party imports: torch, transformers (tqdm only if installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

# run as a script, sys.path[0] is bench/, whose kernels.py would shadow the kernels package
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from adbatch.compress.calibration import calibrate, compressible_linears, peak_rss_mb  # noqa: E402
from adbatch.compress.linear import SequentialExecutor, compress_  # noqa: E402
from adbatch.compress.recipe import CalibrationConfig, CompressConfig  # noqa: E402

log = logging.getLogger("compress_8b")

#: Llama-3-8B shapes (config.json of Meta-Llama-3-8B)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
#: the --smoke smoke-test shapes
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512, tie_word_embeddings=False)


class TimedExecutor(SequentialExecutor):
    """The sequential loop, timing each pass (``importance``, ``quantize+pack``) and its peak GPU memory."""

    def __init__(self, device: torch.device | None) -> None:
        super().__init__(device)
        self.seconds: dict[str, float] = {}
        self.peak_gpu_mb: dict[str, float | None] = {}

    def map(self, fn, handles, args, desc: str = "layers"):
        _reset_gpu_peak()
        t0 = time.perf_counter()
        out = super().map(fn, handles, args, desc)
        self.seconds[desc] = time.perf_counter() - t0
        self.peak_gpu_mb[desc] = _gpu_peak_mb()
        return out


def _reset_gpu_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _gpu_peak_mb() -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def build_random_llama(shapes: dict, dtype: torch.dtype, fill_device: torch.device, seed: int):
    """A random-init ``LlamaForCausalLM`` in ``dtype`` on CPU without the slow HF init: built on the meta
    device, storage allocated empty on CPU, then every matrix drawn N(0, 0.02) on ``fill_device`` (the
    GPU draws 8B values in well under a second) and copied in; 1-d tensors (RMSNorm weights) = 1.
    The rotary module's ``inv_freq`` is a non-persistent buffer left garbage by ``to_empty``: rebuilt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shapes)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.to_empty(device="cpu")
    gen = torch.Generator(device=fill_device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=dtype, device=fill_device).normal_(0.0, 0.02, generator=gen))
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=cfg)
    return model.eval()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (compress_8b.md, compress_8b.json)")
    ap.add_argument("--smoke", action="store_true", help="2 layers, width 128, 4 x 64 tokens: CPU smoke test")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers (time knob)")
    ap.add_argument("--num-seqs", type=int, default=None, help="calibration sequences (default 8; --smoke 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; --smoke 64)")
    ap.add_argument("--batch-size", type=int, default=4, help="calibration sequences per forward/backward")
    ap.add_argument("--device", default=None, help="compute device (default cuda if available, else cpu)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="weights dtype (default bfloat16; --smoke float32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = dict(SMALL if args.smoke else LLAMA3_8B)
    if args.layers is not None:
        shapes["num_hidden_layers"] = args.layers
    num_seqs = args.num_seqs or (4 if args.smoke else 8)
    seq_len = args.seq_len or (64 if args.smoke else 512)
    dtype = getattr(torch, args.dtype or ("float32" if args.smoke else "bfloat16"))
    rows: list[dict] = []

    def record(phase: str, seconds: float, gpu_mb: float | None) -> None:
        rows.append({"phase": phase, "seconds": seconds, "peak_gpu_mb": gpu_mb, "peak_rss_mb": peak_rss_mb()})
        log.info("%s: %.1f s, peak GPU %s MB, peak RSS %.0f MB", phase, seconds, _fmt(gpu_mb, 0), peak_rss_mb())

    t_all = time.perf_counter()
    _reset_gpu_peak()
    t0 = time.perf_counter()
    model = build_random_llama(shapes, dtype, device, args.seed)
    record("build (meta init, random fill, CPU)", time.perf_counter() - t0, _gpu_peak_mb())
    n_params = sum(p.numel() for p in model.parameters())

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, shapes["vocab_size"], (num_seqs, seq_len), generator=gen)  # long [S, T]
    cal = CalibrationConfig(mode="layerwise", device=str(device), batch_size=args.batch_size,
                            seq_len=seq_len, num_texts=num_seqs)
    t0 = time.perf_counter()
    stats = calibrate(model, tokens, cal)
    record("calibrate (layerwise fwd+bwd)", time.perf_counter() - t0, stats.info["peak_device_mb"])
    if device.type == "cuda":
        torch.cuda.empty_cache()

    executor = TimedExecutor(device)
    n_linears = len(compressible_linears(model))  # a count only: holding the modules would pin their weights
    _reset_gpu_peak()
    t0 = time.perf_counter()
    recipe = compress_(model, CompressConfig(), stats, executor=executor)
    total_compress = time.perf_counter() - t0
    for desc, label in (("importance", "analysis (scores, 2:4/1:4 proxy loss)"),
                        ("quantize+pack", "mask + adaptive INT4 + pack")):
        record(label, executor.seconds[desc], executor.peak_gpu_mb[desc])
    # the rest of compress_: fp32 CPU copies of the weights, the pattern plan, the module swap
    record("prep + plan + module swap (CPU)", total_compress - sum(executor.seconds.values()), None)
    total = time.perf_counter() - t_all
    rows.append({"phase": "total", "seconds": total, "peak_gpu_mb": None, "peak_rss_mb": peak_rss_mb()})

    s = recipe.summary()
    group_rows: dict[int, int] = {}
    for layer in recipe.layers:
        for g, c in layer.group_size_counts.items():
            group_rows[g] = group_rows.get(g, 0) + c
    result = {
        "shapes": shapes, "dtype": str(dtype), "device": str(device), "params": n_params,
        "compressed_linears": len(recipe.layers), "linears_found": n_linears,
        "calibration": stats.info, "phases": rows, "summary": s, "group_size_rows": group_rows,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    lines = [
        "# bench/compress_8b.py", "",
        f"Random-init Llama ({shapes['num_hidden_layers']} layers, hidden {shapes['hidden_size']}, "
        f"intermediate {shapes['intermediate_size']}, vocab {shapes['vocab_size']}; {n_params / 1e6:,.1f} M "
        f"params, {dtype}) on {result['gpu'] or device}; calibration {num_seqs} x {seq_len} tokens "
        f"(batch {args.batch_size}, {stats.info['mode']}); full recipe (paper score, layer-adaptive "
        "2:4/1:4/dense at density 0.5, adaptive INT4 <= g128 bits), no Ray. Random weights: structure and "
        "cost only.", "",
        "| phase | seconds | peak GPU MB | peak host RSS MB |", "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['phase']} | {r['seconds']:.1f} | {_fmt(r['peak_gpu_mb'], 0)} | {_fmt(r['peak_rss_mb'], 0)} |"
              for r in rows]
    lines += [
        "",
        f"Compressed linears: {s['layers']} ({s['params']:,} weights); packed bytes {s['packed_bytes']:,} "
        f"({s['bits_per_weight']:.3f} bits/weight, bf16 would be {2 * s['params']:,}); density "
        f"{s['density']:.4f}; patterns {s['pattern_counts']}; rows per group size "
        f"{dict(sorted(group_rows.items()))}.", "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compress_8b.md").write_text(text)
    (args.out / "compress_8b.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
