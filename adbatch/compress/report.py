"""Quality report of a compression: perplexity, sizes, ablation table and per-layer plots.

Perplexity is ``exp(mean token NLL)`` over fixed-length blocks (texts concatenated with EOS between
them) of two held-out sets: ad text (descriptions of slogan ads *not* used for calibration) and
generic English (``data/generic_en.txt``, written for this repository).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from adbatch.artifacts import atomic_path
from adbatch.compress.calibration import CalibrationStats, token_blocks
from adbatch.compress.linear import LayerExecutor, compress_, densify_
from adbatch.compress.recipe import (
    PATTERN_DENSITY, CompressConfig, CompressionRecipe, GroupPolicy, PatternPolicy, ScoreMethod,
    SparsityPattern,
)

log = logging.getLogger(__name__)

__all__ = ["GENERIC_TEXT", "perplexity", "size_report", "ablation_variants", "run_ablations",
           "plot_layers", "write_report", "EvalSets"]

GENERIC_TEXT = Path(__file__).resolve().parent / "data" / "generic_en.txt"


@dataclasses.dataclass
class EvalSets:
    """Token blocks (long [B, T]) of the held-out evaluation texts."""

    ads: torch.Tensor
    generic: torch.Tensor

    @classmethod
    def build(cls, tokenizer: Any, ad_texts: list[str], seq_len: int = 256) -> "EvalSets":
        generic = [p for p in GENERIC_TEXT.read_text().split("\n") if p.strip()]
        return cls(ads=token_blocks(tokenizer, ad_texts, seq_len), generic=token_blocks(tokenizer, generic, seq_len))

    def info(self) -> dict[str, int]:
        return {"ad_tokens": int(self.ads.numel()), "generic_tokens": int(self.generic.numel())}


@torch.no_grad()
def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """``exp`` of the mean next-token NLL over ``blocks`` (long [B, T]); every block predicts T-1 tokens."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for batch in torch.split(blocks, batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        target = batch[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
        nll += float(loss)
        count += target.numel()
    return math.exp(nll / max(count, 1))


def evaluate(model: nn.Module, sets: EvalSets) -> dict[str, float]:
    return {"ppl_ads": perplexity(model, sets.ads), "ppl_generic": perplexity(model, sets.generic)}


def size_report(recipe: CompressionRecipe) -> dict[str, Any]:
    """Bytes of the compressed linears: dense fp16, plain CSR (int32 col + fp16 value + int32 row
    pointers) at the same masks, and ours (the packed tensors, alignment padding included)."""
    params = sum(x.out_features * x.in_features for x in recipe.layers)
    dense = 2 * params
    csr = 0
    for x in recipe.layers:
        kept = x.out_features * x.in_features * PATTERN_DENSITY[x.pattern]
        csr += int(kept) * (4 + 2) + 4 * (x.out_features + 1)
    ours = sum(x.packed_bytes for x in recipe.layers)
    return {
        "params": params,
        "dense_fp16_bytes": dense,
        "csr_bytes": csr,
        "ours_bytes": ours,
        "ours_over_csr": ours / csr if csr else float("nan"),
        "ours_over_dense_fp16": ours / dense if dense else float("nan"),
        "bits_per_weight": 8.0 * ours / params if params else float("nan"),
    }


def ablation_variants(base: CompressConfig) -> list[tuple[str, str, CompressConfig | None]]:
    """(name, what it isolates, config) of the ablation table; config None = the dense model.

    Score comparisons use uniform INT4 g128 so only the score differs; pattern comparisons use the
    paper score and g128 so only the allocation differs.
    """
    g128 = dict(group_policy=GroupPolicy.UNIFORM, reference_group_size=128)
    r = base.replace
    variants = [
        ("dense", "reference", None),
        ("int4-g128", "uniform INT4 g128, no sparsity", r(pattern_policy=PatternPolicy.NONE, **g128)),
        ("int4-adaptive", "adaptive groups at g128's bits, no sparsity",
         r(pattern_policy=PatternPolicy.NONE, group_policy=GroupPolicy.ADAPTIVE, reference_group_size=128)),
        ("2:4-magnitude", "score: |W|", r(pattern_policy=PatternPolicy.UNIFORM, score=ScoreMethod.MAGNITUDE, **g128)),
        ("2:4-wanda", "score: |W|*||X||", r(pattern_policy=PatternPolicy.UNIFORM, score=ScoreMethod.WANDA, **g128)),
        ("2:4-paper", "score: |W|*||X|| + |W|*|dE/dW| (= uniform 2:4 at density 0.5)",
         r(pattern_policy=PatternPolicy.UNIFORM, score=ScoreMethod.PAPER, **g128)),
        ("adaptive-d0.5", "layer-adaptive {1:4,2:4,dense} at density 0.5",
         r(pattern_policy=PatternPolicy.LAYER_ADAPTIVE, score=ScoreMethod.PAPER, target_density=0.5,
           allowed_patterns=(SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR, SparsityPattern.DENSE), **g128)),
        ("interleaved-d0.375", "importance-blind 2:4/1:4 mix at density 0.375",
         r(pattern_policy=PatternPolicy.INTERLEAVED, score=ScoreMethod.PAPER, target_density=0.375,
           allowed_patterns=(SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR), **g128)),
        ("adaptive-d0.375", "layer-adaptive 2:4/1:4 at density 0.375",
         r(pattern_policy=PatternPolicy.LAYER_ADAPTIVE, score=ScoreMethod.PAPER, target_density=0.375,
           allowed_patterns=(SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR), **g128)),
        ("paper-recipe", "paper score, layer-adaptive 2:4/1:4/dense at density 0.5, adaptive INT4",
         r(pattern_policy=PatternPolicy.LAYER_ADAPTIVE, score=ScoreMethod.PAPER, target_density=0.5,
           allowed_patterns=(SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR, SparsityPattern.DENSE))),
        ("full-recipe", "the configured recipe (default: adaptive INT4, no post-training sparsity)", base),
    ]
    # a variant equal to the configured recipe (int4-adaptive under the defaults) is measured once, as full-recipe
    return [v for v in variants if v[0] == "full-recipe" or v[2] != base]


def run_ablations(model: nn.Module, stats: CalibrationStats, sets: EvalSets, base: CompressConfig,
                  executor: LayerExecutor | None = None,
                  variants: list[tuple[str, str, CompressConfig | None]] | None = None) -> list[dict[str, Any]]:
    """Compress a copy of ``model`` per variant and measure held-out perplexity and bytes/weight.

    ``model`` itself is not modified. Rows: name, what, ppl_ads, ppl_generic, density,
    bits_per_weight (packed bytes of the compressed linears), seconds.
    """
    rows = []
    for name, what, cfg in tqdm(variants or ablation_variants(base), desc="ablations", unit="variant"):
        t0 = time.perf_counter()
        if cfg is None:
            row = {"name": name, "what": what, **evaluate(model, sets), "density": 1.0, "bits_per_weight": 16.0}
        else:
            m = copy.deepcopy(model)
            recipe = compress_(m, cfg, stats, executor)
            densify_(m)  # same values as the packed reference path, cheaper to evaluate repeatedly
            summ = recipe.summary()
            row = {"name": name, "what": what, **evaluate(m, sets), "density": summ["density"],
                   "bits_per_weight": summ["bits_per_weight"], "pattern_counts": summ["pattern_counts"]}
            del m
        row["seconds"] = round(time.perf_counter() - t0, 2)
        log.info("ablation %s: %s", name, row)
        rows.append(row)
    return rows


_LAYER_RE = re.compile(r"\.(\d+)\.")


def _layer_index(name: str) -> int:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else -1


def plot_layers(recipe: CompressionRecipe, out_dir: Path) -> list[Path]:
    """PNG plots: per-layer importance (like the paper's Fig. 1), pattern and mean group size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = sorted({x.name.rsplit(".", 1)[-1] for x in recipe.layers})
    blocks = sorted({_layer_index(x.name) for x in recipe.layers})
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    for kind in kinds:
        xs = [(_layer_index(x.name), x.importance) for x in recipe.layers
              if x.name.endswith("." + kind) and x.importance is not None and x.importance > 0]
        if xs:
            ax.plot([a for a, _ in xs], [b for _, b in xs], marker="o", ms=3, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("importance: proxy loss per weight removed (2:4 -> 1:4)")
    ax.set_title("Layer importance")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    paths.append(out_dir / "importance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for key, title, fname in (("density", "Kept density per layer (1 = dense, 0.5 = 2:4, 0.25 = 1:4)", "patterns.png"),
                              ("group", "Mean INT4 group size per layer", "group_sizes.png")):
        grid = torch.full((len(kinds), len(blocks)), float("nan"))
        for x in recipe.layers:
            i, j = kinds.index(x.name.rsplit(".", 1)[-1]), blocks.index(_layer_index(x.name))
            if key == "density":
                grid[i, j] = PATTERN_DENSITY[x.pattern]
            else:
                tot = sum(x.group_size_counts.values())
                grid[i, j] = sum(g * c for g, c in x.group_size_counts.items()) / max(tot, 1)
        fig, ax = plt.subplots(figsize=(9, 3))
        im = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xticks(range(len(blocks)), [str(b) for b in blocks], fontsize=6)
        ax.set_xlabel("decoder layer")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _fmt(v: Any, nd: int = 2) -> str:
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def write_report(out_dir: Path, recipe: CompressionRecipe, quality: dict[str, float], sizes: dict[str, Any],
                 info: dict[str, Any], ablations: list[dict[str, Any]] | None = None,
                 plots: list[Path] | None = None) -> Path:
    """Write ``report.md``: what was applied per layer, sizes, dense vs compressed perplexity and,
    when given, the ablation table."""
    s = recipe.summary()
    lines = [
        "# Compression report", "",
        f"Model: `{info.get('model')}`. Calibration: {recipe.calibration.get('sequences')} x "
        f"{recipe.calibration.get('seq_len')} tokens ({recipe.calibration.get('path')}), "
        f"{recipe.calibration.get('seconds')} s, peak RSS {recipe.calibration.get('peak_rss_mb')} MB, "
        f"peak device {recipe.calibration.get('peak_device_mb') or '-'} MB; mode: {recipe.calibration.get('mode_reason')}.",
        f"Recipe: score={recipe.config.score.value}, patterns={recipe.config.pattern_policy.value} "
        f"(target density {recipe.config.target_density}), groups={recipe.config.group_policy.value} "
        f"(<= g{recipe.config.reference_group_size} bits). Embeddings/lm_head kept dense "
        f"({recipe.config.dense_dtype}; tied={recipe.tied_embeddings}).", "",
        "## Quality (held-out perplexity)", "",
        "| model | ad text | generic text |", "|---|---:|---:|",
        f"| dense | {_fmt(quality.get('dense_ppl_ads'))} | {_fmt(quality.get('dense_ppl_generic'))} |",
        f"| compressed | {_fmt(quality.get('ppl_ads'))} | {_fmt(quality.get('ppl_generic'))} |", "",
        f"Evaluation tokens: {info.get('eval_tokens')}.", "",
        "## Sizes of the compressed linears", "",
        "| format | bytes | bits/weight |", "|---|---:|---:|",
        f"| dense fp16 | {sizes['dense_fp16_bytes']:,} | 16.00 |",
        f"| plain CSR (int32 col + fp16 val) | {sizes['csr_bytes']:,} | {8 * sizes['csr_bytes'] / sizes['params']:.2f} |",
        f"| ours (2bit-CSR + INT4 + scales) | {sizes['ours_bytes']:,} | {sizes['bits_per_weight']:.2f} |", "",
        f"Ours = {100 * sizes['ours_over_csr']:.1f}% of CSR, {100 * sizes['ours_over_dense_fp16']:.1f}% of fp16. "
        f"Density {s.get('density', 0):.4f}; patterns {s.get('pattern_counts')}.", "",
    ]
    if ablations:
        lines += ["## Ablations", "",
                  "| variant | what | ppl ads | ppl generic | density | bits/weight |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in ablations:
            lines.append(f"| {r['name']} | {r['what']} | {_fmt(r['ppl_ads'])} | {_fmt(r['ppl_generic'])} | "
                         f"{_fmt(r['density'], 4)} | {_fmt(r['bits_per_weight'])} |")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["## Per layer", "", "| layer | pattern | group sizes (size: rows) | importance | packed bytes |",
              "|---|---|---|---:|---:|"]
    for x in recipe.layers:
        gs = ", ".join(f"{g}: {c}" for g, c in sorted(x.group_size_counts.items()))
        imp = "-" if x.importance is None else f"{x.importance:.3e}"
        lines.append(f"| {x.name} | {x.pattern.value} | {gs} | {imp} | {x.packed_bytes:,} |")
    path = out_dir / "report.md"
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    return path
