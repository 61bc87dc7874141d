"""Training throughput of the product's train loop (``adbatch.training.trainer.train_loop``), per variant.

Runs on the device (no Ray, no network) and on CPU with ``--smoke``. Builds the training examples the
way ``adbatch train`` does (:func:`adbatch.training.index_examples` with :class:`TrainConfig`'s
defaults: indexing + labelled retrieval + span pseudo-queries) from a bundle made by
``bench/train_eval.py prepare`` (``--bundle``, first ``--max-ads`` ads of ``index_<catalogue>_<scheme>``)
or from synthetic product titles, then for each variant trains a fresh copy of the model for
``--warmup`` + ``--steps`` optimizer steps and reports medians over the timed steps:

- tokens/s (token slots, padding included), real tokens/s, padded share;
- MFU = ``6·N·real tokens`` (the LM head counted at target positions only, as it runs) per second over
  the H200's dense bf16 peak (989 TFLOP/s), the training summary's own formula;
- step ms, first step s (compile included), peak GPU memory.

Variants: ``default`` (TrainConfig defaults) then each ``--variant`` (comma-separated TrainConfig
overrides, ``on``/``off`` for booleans, dotted keys for nested configs), e.g. ``--variant packing=off,compile=off
--variant pack_length=128 --variant qat.start_fraction=0``. With the defaults, QAT attaches at 80 % of a
variant's ``--warmup + --steps`` steps (inside the timed steps): ``qat.enabled=off`` / ``qat.start_fraction=0``
time the phases apart.
Every step ends with a loss read (``log_every=1``: one sync per step, so step times are measurable);
the loop's own summary (whole run, warm-up and compile included) is in the JSON too.

Device::

    python bench/train_throughput.py --model /tmp/adbatch_files/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --bundle .carry/bundle --variant packing=off,compile=off --variant compile=off --out $OUT/tp.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("train_throughput")

WORDS = ("behr deck stain cedar outdoor wood gallon semi transparent pine oak white gloss interior paint "
         "steel hammer claw drill cordless lithium brushless impact driver kit toilet elongated bowl seat "
         "porcelain faucet kitchen pull down chrome nickel led bulb dimmable soft daylight watt pack "
         "vinyl plank flooring waterproof grey tile ceramic shower wall mirror frame black bronze copper").split()


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``cfg`` with ``overrides`` applied; a dotted key reaches into a nested config
    (``{"qat.enabled": False}`` -> ``cfg.replace(qat=cfg.qat.replace(enabled=False))``)."""
    flat = {k: v for k, v in overrides.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            head, _, rest = key.partition(".")
            nested.setdefault(head, {})[rest] = value
    for head, sub in nested.items():
        flat[head] = with_overrides(getattr(cfg, head), sub)
    return cfg.replace(**flat)


def parse_variant(spec: str) -> dict[str, Any]:
    """``"packing=off,pack_length=128,qat.enabled=off"`` -> ``{"packing": False, "pack_length": 128,
    "qat.enabled": False}`` (dotted keys: :func:`with_overrides`)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, raw = part.partition("=")
        if not sep:
            raise SystemExit(f"--variant {spec!r}: {part!r} is not key=value")
        low = raw.lower()
        if low in ("on", "true", "yes"):
            value: Any = True
        elif low in ("off", "false", "no"):
            value = False
        elif low == "none":
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key.strip()] = value
    return out


def synthetic_index(tok: Any, n_ads: int, seed: int) -> tuple[Any, dict[int, str]]:
    """An index-shaped namespace of ``n_ads`` product titles (3-9 words), ``text`` ids = the title's tokens
    (at most 32), as ``prepare_model_for_index`` / ``index_examples`` read it."""
    import random

    import pyarrow as pa

    rng = random.Random(seed)
    titles = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n_ads)]
    ids = list(range(n_ads))
    targets = [tok(t, add_special_tokens=False)["input_ids"][:32] or [0] for t in titles]
    table = pa.table({"ad_id": ids, "token_ids": targets, "title": titles})
    index = SimpleNamespace(ad_ids=ids, ad_codes=table, manifest={"scheme": "text"}, scheme="text",
                            index_hash="synthetic")
    return index, dict(zip(ids, titles))


def bundle_index(bundle: Path, catalogue: str, scheme: str, max_ads: int | None) -> tuple[Any, dict, list]:
    """The bundle's index (its first ``max_ads`` ads), ad titles and the labelled pairs of those ads."""
    from bench.train_eval import load_bundle  # the bundle's reader

    data = load_bundle(bundle, catalogue)
    if scheme not in data["indexes"]:
        raise SystemExit(f"bundle {bundle} has no {scheme} index for catalogue {catalogue}")
    index = data["indexes"][scheme]
    if max_ads is not None and max_ads < len(index.ad_ids):
        keep = index.ad_ids[:max_ads]
        kept = set(keep)
        index = SimpleNamespace(ad_ids=keep, ad_codes=index.ad_codes.slice(0, max_ads), manifest=index.manifest,
                                scheme=getattr(index, "scheme", None), index_hash=index.index_hash)
        labelled = [(q, a) for q, a in data["labelled"] if a in kept]
    else:
        labelled = data["labelled"]
    return index, data["ad_texts"], labelled


def load_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.smoke or args.random_model:
        from adbatch.models import resolve_model

        cfg_dir = args.config_dir or resolve_model()
        tok = AutoTokenizer.from_pretrained(cfg_dir, local_files_only=True, trust_remote_code=False)
        cfg = AutoConfig.from_pretrained(cfg_dir, local_files_only=True, trust_remote_code=False)
        if args.smoke:  # a tiny model of the same architecture and vocabulary: the plumbing, on CPU
            cfg.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16})
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, trust_remote_code=False)
        what = f"random-init {cfg.model_type} from {cfg_dir}" + (" (smoke: tiny)" if args.smoke else "")
    else:
        from adbatch.models import load_causal_lm

        model, tok = load_causal_lm(args.model, dtype=torch.float32, device="cpu")
        what = str(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.float(), tok, what


def run_variant(name: str, base: Any, tok: Any, examples: Any, cfg: Any, device: Any, warmup: int,
                profile: Path | None = None) -> dict:
    import torch

    from adbatch.training.trainer import H200_BF16_PEAK_FLOPS, train_loop

    model = copy.deepcopy(base).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stamps: list[tuple[int, float]] = []
    t_start = time.perf_counter()
    # on_step runs after the loss of every log_every-th step is read back (the loop's only sync): the
    # host runs ahead inside a block as in production, and block time / block steps = step time
    prof = None
    if profile is not None:
        from torch.profiler import ProfilerActivity, profile as torch_profile, schedule

        # only steps after the warm-up (compile, QAT's re-compile when it attaches there): on_step runs
        # at every logged step, so the profiler's step count is in logged steps (--sync-every 1 = steps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        logged_warmup = max(1, warmup // max(1, cfg.log_every))
        prof = torch_profile(activities=acts, schedule=schedule(wait=logged_warmup, warmup=1, active=10**6))
        prof.__enter__()

    def on_step(step: int, _loss: float) -> None:
        stamps.append((step, time.perf_counter()))
        if prof is not None:
            prof.step()

    stats, _ = train_loop(model, examples, cfg, pad_id=tok.pad_token_id, device=device, progress=False,
                          on_step=on_step)
    if prof is not None:
        prof.__exit__(None, None, None)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        profile.write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    summary = stats.summary(model, device)
    first_step_s = stamps[0][1] - t_start
    blocks = [((t1 - t0) / (s1 - s0), s0) for (s0, t0), (s1, t1) in zip(stamps, stamps[1:]) if s1 > s0]
    timed = [b for b, s0 in blocks if s0 >= warmup] or [b for b, _ in blocks] or [first_step_s]
    step_s = [first_step_s]
    med = statistics.median(timed)
    n = max(1, stats.steps)
    slots, real = stats.padded_tokens / n, stats.tokens / n  # per step (batches have near-equal sizes)
    out = {
        "name": name, "steps": stats.steps, "blocks_timed": len(timed), "step_ms": round(1e3 * med, 2),
        "block_step_ms": [round(1e3 * b, 2) for b, _ in blocks],
        "steps_timed": sum(s1 - s0 for (s0, _), (s1, _) in zip(stamps, stamps[1:]) if s0 >= warmup),
        "first_step_s": round(step_s[0], 3),
        "tokens_per_s": round(slots / med, 1), "real_tokens_per_s": round(real / med, 1),
        "padded_share": summary["padded_share"], "target_tokens_per_step": round(stats.target_tokens / n, 1),
        "mfu": round(summary["model_flops"] / n / med / H200_BF16_PEAK_FLOPS, 4) if device.type == "cuda" else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "packing": stats.packing, "compiled": stats.compiled,
        "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
        "config": {k: v for k, v in cfg.to_dict().items() if k in ("packing", "pack_length", "compile", "qat",
                                                                    "ce_chunk_tokens", "batch_tokens", "bf16")},
        "loop_summary": {k: v for k, v in summary.items() if k not in ("evals",)},
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def print_table(results: dict) -> None:
    head = ("variant", "tokens/s", "real tokens/s", "padded", "MFU", "step ms", "1st step s", "peak GiB", "loss")
    rows = []
    for v in results["variants"]:
        rows.append((v["name"], f"{v['tokens_per_s']:,.0f}", f"{v['real_tokens_per_s']:,.0f}",
                     f"{100 * v['padded_share']:.1f}%", "-" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%",
                     f"{v['step_ms']:.1f}", f"{v['first_step_s']:.2f}",
                     "-" if v["peak_mem_gib"] is None else f"{v['peak_mem_gib']:.1f}",
                     f"{v['first_loss']:.3f}->{v['final_loss']:.3f}"))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print(f"{results['device']} | {results['model']} | {results['data']}")
    print(f"MFU = 6*N*real tokens / s / {results['mfu_peak_tflops']:.0f} TFLOP/s ({results['mfu_peak']}); "
          f"step ms = median over blocks of {results['sync_every']} steps, {results['steps']} steps after "
          f"{results['warmup']} warm-up steps")
    for r in [head, *rows]:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for f in results.get("failed", []):
        print(f"FAILED {f['name']}: {f['error']}")


def main(args: argparse.Namespace) -> dict:
    import torch

    from adbatch.training import TrainConfig, index_examples, prepare_model_for_index
    from adbatch.training.trainer import H200_BF16_PEAK_FLOPS, MFU_PEAK_NAME

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.smoke:
        args.steps, args.warmup, args.sync_every, args.settle_s = min(args.steps, 4), min(args.warmup, 1), 1, 0.0
        args.max_ads = min(args.max_ads or 40, 40)
    t0 = time.perf_counter()
    base, tok, what = load_model(args)
    if args.bundle:
        index, ad_texts, labelled = bundle_index(Path(args.bundle), args.catalogue, args.scheme, args.max_ads)
        data = f"bundle {args.catalogue}/{args.scheme}, {len(index.ad_ids)} ads"
    else:
        index, ad_texts = synthetic_index(tok, args.max_ads or 1000, args.seed)
        labelled, data = [], f"synthetic titles, {len(index.ad_ids)} ads"
    default = TrainConfig()
    if args.smoke:  # small batches so that a handful of steps fit the tiny data
        default = default.replace(batch_tokens=1024, pseudo_queries=default.pseudo_queries.replace(per_ad=4))
    info = prepare_model_for_index(base, tok, index, ad_texts)
    examples, data_stats = index_examples(tok, index, default, ad_texts, labelled)
    log.info("model %s, %s: %s (%.1f s)", what, data, data_stats, time.perf_counter() - t0)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "model": what, "data": data, "data_stats": data_stats, "scheme": info["scheme"],
        "steps": args.steps, "warmup": args.warmup, "sync_every": args.sync_every, "mfu_peak": MFU_PEAK_NAME,
        "mfu_peak_tflops": H200_BF16_PEAK_FLOPS / 1e12, "variants": []}
    import transformers

    results["transformers"] = transformers.__version__
    specs = ([] if args.no_default else [("default", {})]) + [(v, parse_variant(v)) for v in args.variant]
    if args.settle_s > 0 and specs:
        # Untimed: the process's first compiled run is slow for its first ~20 s on the H200 (measured:
        # ~215 ms/step, then ~85 ms with nothing recompiled; inductor's compile workers starting up
        # beside a host-bound loop, most likely), which a few warm-up steps do not cover
        cfg = with_overrides(default, specs[0][1]).replace(max_steps=10**6, time_budget_s=args.settle_s, log_every=50, eval_every=0.0)
        log.info("settling for %.0f s on %s (untimed)", args.settle_s, specs[0][0])
        settle = run_variant("settle", base, tok, examples, cfg, device, 0)
        results["settle"] = {"steps": settle["steps"], "block_step_ms": settle["block_step_ms"]}
    for name, overrides in specs:
        cfg = with_overrides(default, overrides).replace(max_steps=args.warmup + args.steps, log_every=args.sync_every,
                              eval_every=0.0)
        cfg.validate()
        log.info("variant %s: %s", name, overrides)
        prof = Path(f"{args.out}.{len(results['variants'])}.profile.txt") if args.profile and args.out else None
        if prof is not None:
            prof.parent.mkdir(parents=True, exist_ok=True)
        try:
            results["variants"].append(run_variant(name, base, tok, examples, cfg, device, args.warmup, prof))
        except Exception as exc:  # a bench: record the variant that broke (e.g. a compile failure), run the rest
            import traceback

            log.exception("variant %s failed", name)
            results.setdefault("failed", []).append({"name": name, "error": repr(exc),
                                                     "traceback": traceback.format_exc()[-4000:]})
            if args.smoke:
                raise
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print_table(results)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    p.add_argument("--random-model", action="store_true", help="random-init model of --config-dir's config.json")
    p.add_argument("--config-dir", default=None, help="folder with config.json + tokenizer (default: the default model's)")
    p.add_argument("--bundle", default=None, help="bundle folder of bench/train_eval.py prepare (else synthetic titles)")
    p.add_argument("--catalogue", default="5000", help="bundle catalogue name (5000 / full)")
    p.add_argument("--scheme", default="text", choices=("text", "codes"))
    p.add_argument("--max-ads", type=int, default=1000, help="first N ads of the index (0 = all)")
    p.add_argument("--variant", action="append", default=[], help="TrainConfig overrides, e.g. packing=off,compile=off")
    p.add_argument("--no-default", action="store_true", help="skip the defaults variant")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (compile) per variant")
    p.add_argument("--sync-every", type=int, default=5,
                   help="loss read-back (the loop's log_every) every this many steps; step ms = block time / steps")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="untimed run of the first variant for this many seconds first (0 = none; --smoke: 0)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table per variant beside --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 40 ads, 1+3 steps (CPU)")
    p.add_argument("--out", default=None, help="JSON results file")
    return p


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = build_parser().parse_args()
    if a.max_ads == 0:
        a.max_ads = None
    main(a)
