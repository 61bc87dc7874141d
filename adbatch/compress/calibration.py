"""Calibration: run texts through the model once, collecting what the scores and sensitivities need.

Per compressible linear layer (input x [T, K], output y [T, N], weight W [N, K]):

- ``act_sq`` float32 [K]: ``sum_t x_tj^2`` -> ``||X_j||_2 = sqrt(act_sq)`` and ``E[x_j^2] = act_sq / T``.
- ``grad_sq`` float32 [N, K]: ``sum_b (dE_b/dW)^2`` over calibration batches b, with E_b the *summed*
  token loss of batch b -> ``|dE/dW| = sqrt(grad_sq)`` (l2 over batches, so opposite-signed batch
  gradients do not cancel).
- ``out_grad_sq`` float32 [N]: ``sum_t (dE/dy_ti)^2`` -> the output-side curvature ``E[g_i^2]``.

Path: one full forward + backward per batch over the whole model (the "full" path). The default
135M model needs ~1 GB for weights, grads and statistics, so layer-by-layer processing buys nothing
there; the peak resident memory is measured and reported. Texts are concatenated (EOS-separated)
and cut into fixed-length sequences, so there is no padding to mask out of the statistics.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from adbatch.compress.recipe import CalibrationConfig

log = logging.getLogger(__name__)

__all__ = ["LayerStats", "CalibrationStats", "calibrate", "load_calibration_texts",
           "example_corpus_split", "token_blocks", "compressible_linears", "EXAMPLE_CORPUS"]

EXAMPLE_CORPUS = Path(__file__).resolve().parents[2] / "examples" / "slogan_ads.parquet"


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer (CPU float32); see the module docstring."""

    act_sq: torch.Tensor  # [K]
    num_tokens: int
    grad_sq: torch.Tensor | None = None  # [N, K]
    out_grad_sq: torch.Tensor | None = None  # [N]

    @property
    def act_norm(self) -> torch.Tensor:
        """float32 [K]: ``||X_j||_2`` over all calibration tokens."""
        return self.act_sq.sqrt()

    @property
    def col_moment(self) -> torch.Tensor:
        """float32 [K]: ``E[x_j^2]``."""
        return self.act_sq / max(self.num_tokens, 1)

    @property
    def grad_abs(self) -> torch.Tensor | None:
        """float32 [N, K]: ``|dE/dW|`` (l2 over batches) or None."""
        return None if self.grad_sq is None else self.grad_sq.sqrt()

    @property
    def row_moment(self) -> torch.Tensor | None:
        """float32 [N]: ``E[g_i^2]`` or None."""
        return None if self.out_grad_sq is None else self.out_grad_sq / max(self.num_tokens, 1)


@dataclass
class CalibrationStats:
    layers: dict[str, LayerStats]
    info: dict[str, Any] = field(default_factory=dict)


def compressible_linears(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` modules compression touches, by qualified name, in model order.

    Skipped: names ending in one of ``skip`` and any linear whose weight is the (tied) input
    embedding table.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    out: dict[str, torch.nn.Linear] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if any(name == s or name.endswith("." + s) for s in skip):
            continue
        if emb_w is not None and mod.weight is emb_w:
            continue
        out[name] = mod
    return out


def example_corpus_split(num_calib: int, num_heldout: int, seed: int = 0,
                         path: Path = EXAMPLE_CORPUS) -> tuple[list[str], list[str]]:
    """Disjoint ads from the bundled corpus: calibration texts ("title. description") and held-out
    texts (descriptions of other ads, never seen in calibration)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["title", "description"])
    titles = table.column("title").to_pylist()
    descs = table.column("description").to_pylist()
    n = len(titles)
    if num_calib + num_heldout > n:
        raise ValueError(f"{path} has {n} ads; asked for {num_calib} calibration + {num_heldout} held-out")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    calib = [f"{(titles[i] or '').strip()}. {(descs[i] or '').strip()}" for i in perm[:num_calib]]
    held = [(descs[i] or "").strip() for i in perm[n - num_heldout:]]
    return calib, [h for h in held if h]


def load_calibration_texts(config: CalibrationConfig) -> list[str]:
    """Texts for calibration: the bundled corpus sample, or ``config.path`` (.txt: one text per
    non-empty line; .parquet: column ``text``, else ``title``+``description``)."""
    if config.path is None:
        return example_corpus_split(config.num_texts, 0, config.seed)[0]
    path = Path(config.path)
    if not path.is_file():
        raise FileNotFoundError(f"CalibrationConfig.path: {path} not found")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        cols = set(table.column_names)
        if "text" in cols:
            texts = [t for t in table.column("text").to_pylist() if t]
        elif {"title", "description"} <= cols:
            texts = [f"{a or ''}. {b or ''}" for a, b in zip(table.column("title").to_pylist(),
                                                            table.column("description").to_pylist())]
        else:
            raise ValueError(f"{path}: needs a 'text' column or 'title'+'description'; has {sorted(cols)}")
    elif path.suffix.lower() in (".txt", ".md"):
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"CalibrationConfig.path: {path} must be .txt/.md or .parquet")
    if not texts:
        raise ValueError(f"CalibrationConfig.path: {path} holds no texts")
    g = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(texts), generator=g).tolist()[: config.num_texts]
    return [texts[i] for i in order]


def token_blocks(tokenizer: Any, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate texts (EOS between them) and cut into rows of ``seq_len`` tokens.

    Returns long [B, seq_len]; the tail shorter than seq_len becomes a last, shorter batch only if
    nothing else exists (so tiny inputs still yield one row).
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    if not ids:
        raise ValueError("calibration texts tokenized to nothing")
    flat = torch.tensor(ids, dtype=torch.long)
    rows = flat.numel() // seq_len
    if rows == 0:
        return flat.unsqueeze(0)
    return flat[: rows * seq_len].reshape(rows, seq_len)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def calibrate(model: torch.nn.Module, blocks: torch.Tensor, config: CalibrationConfig,
              skip: tuple[str, ...] = ("lm_head",)) -> CalibrationStats:
    """Collect :class:`LayerStats` for every compressible linear of ``model``.

    Args: model: a causal LM (returns ``.loss`` given ``labels``); blocks: long [B, T] token ids.
    The model's parameters are left unchanged (requires_grad flags restored, grads cleared).
    """
    t0 = time.perf_counter()
    linears = compressible_linears(model, skip)
    if not linears:
        raise ValueError("model has no compressible nn.Linear layers")
    device = next(model.parameters()).device
    # statistics live beside the weights while collecting (no per-batch transfers), CPU at the end
    stats = {name: LayerStats(act_sq=torch.zeros(m.in_features, device=device), num_tokens=0)
             for name, m in linears.items()}
    use_grad = config.use_gradients
    if use_grad:
        for name, m in linears.items():
            stats[name].grad_sq = torch.zeros(m.out_features, m.in_features, device=device)
            stats[name].out_grad_sq = torch.zeros(m.out_features, device=device)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    if use_grad:
        for m in linears.values():
            m.weight.requires_grad_(True)

    handles = []

    def make_hook(name: str):
        st = stats[name]

        def hook(mod, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            st.act_sq += x.pow(2).sum(dim=0)
            st.num_tokens += x.shape[0]
            if use_grad and output.requires_grad:
                def grad_hook(g):
                    st.out_grad_sq.add_(g.detach().reshape(-1, g.shape[-1]).float().pow(2).sum(dim=0))
                output.register_hook(grad_hook)
        return hook

    for name, m in linears.items():
        handles.append(m.register_forward_hook(make_hook(name)))
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        batches = list(torch.split(blocks, config.batch_size))
        for batch in tqdm(batches, desc="calibration", unit="batch", leave=False):
            batch = batch.to(device)
            if use_grad:
                out = model(input_ids=batch, labels=batch)
                # summed (not mean) token loss, so the statistics do not depend on the batch size
                n_pred = batch.shape[0] * (batch.shape[1] - 1)
                (out.loss * n_pred).backward()
                for name, m in linears.items():
                    stats[name].grad_sq += m.weight.grad.detach().float().pow(2)
                    m.weight.grad = None
            else:
                with torch.no_grad():
                    model(input_ids=batch)
            tokens += batch.numel()
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
            p.grad = None
        model.train(was_training)
    for st in stats.values():
        st.act_sq = st.act_sq.cpu()
        st.grad_sq = None if st.grad_sq is None else st.grad_sq.cpu()
        st.out_grad_sq = None if st.out_grad_sq is None else st.out_grad_sq.cpu()
    info = {
        "path": "full_forward_backward" if use_grad else "full_forward",
        "sequences": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "tokens": tokens,
        "layers": len(linears),
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    log.info("calibration: %s", info)
    return CalibrationStats(layers=stats, info=info)
