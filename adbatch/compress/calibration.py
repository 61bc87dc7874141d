"""Calibration: run texts through the model once, collecting what the scores and sensitivities need.

Per compressible linear layer (input x [T, K], output y [T, N], weight W [N, K]):

- ``act_sq`` float32 [K]: ``sum_t x_tj^2`` -> ``||X_j||_2 = sqrt(act_sq)`` and ``E[x_j^2] = act_sq / T``.
- ``grad_sq`` float32 [N, K]: ``sum_b (dE_b/dW)^2`` over calibration batches b, with E_b the *summed*
  token loss of batch b -> ``|dE/dW| = sqrt(grad_sq)`` (l2 over batches, so opposite-signed batch
  gradients do not cancel).
- ``out_grad_sq`` float32 [N]: ``sum_t (dE/dy_ti)^2`` -> the output-side curvature ``E[g_i^2]``.

Two paths, same statistics (``CalibrationConfig.mode``; tests/test_compress_layerwise.py):

- **full**: the whole model on the compute device, one forward + backward per batch. Needs the
  weights, their gradients and every layer's ``grad_sq`` resident at once (an 8B model: ~16 GB bf16
  weights + 14 GB grads + 28 GB fp32 statistics).
- **layerwise**: the weights stay where they were loaded (CPU); only the non-block modules
  (embeddings, final norm, lm_head, rotary) and one decoder block at a time sit on the device. A
  capture pass records each block's call arguments (mask, rotary embeddings, ...) as the model itself
  builds them; a no-grad sweep keeps only the block-boundary hidden states (on CPU); the model's own
  head (final norm, lm_head, loss) gives dE/dh at the top; a reverse sweep recomputes each block from
  its saved input with grad enabled and backpropagates the incoming hidden-state gradient, so each
  batch's per-weight gradient is exactly that of the full backward. Statistics of a block are moved
  to CPU as soon as it is done, so the device holds one block's ``grad_sq`` at a time.

Both paths record through the same hooks (:class:`_StatsCollector`). Texts are concatenated
(EOS-separated) and cut into fixed-length sequences, each starting with the tokenizer's own prefix
(BOS where it declares one), so there is no padding to mask out (:func:`token_blocks`).

Why one module of ~700 lines: the two paths must produce the same statistics (the tests compare them),
and they share the hooks, the statistics type, the text sources and the memory estimate that picks
between them; kept side by side so a change to one is seen against the other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from adbatch.compress.recipe import CalibrationConfig, CalibrationMode
from adbatch.config import ConfigError
from adbatch.models import eval_mode

log = logging.getLogger(__name__)

__all__ = ["LayerStats", "CalibrationStats", "calibrate", "load_calibration_texts", "served_calibration_texts",
           "served_corpus_sources", "example_corpus_split", "check_example_split", "token_blocks",
           "compressible_linears", "decoder_blocks",
           "choose_mode", "full_path_bytes", "free_memory_bytes", "EXAMPLE_CORPUS"]

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

    def to(self, device: torch.device | str) -> "LayerStats":
        """A copy with every tensor on ``device`` (the same object when nothing moves)."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LayerStats(act_sq=mv(self.act_sq), num_tokens=self.num_tokens, grad_sq=mv(self.grad_sq),
                          out_grad_sq=mv(self.out_grad_sq))


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


def check_example_split(num_calib: int, num_heldout: int, path: Path = EXAMPLE_CORPUS) -> int:
    """The number of ads of the bundled corpus (its footer only), refused (:class:`ConfigError`) when it holds
    fewer than ``num_calib`` calibration + ``num_heldout`` held-out ads (:func:`example_corpus_split`)."""
    import pyarrow.parquet as pq

    n = pq.read_metadata(path).num_rows
    if num_calib + num_heldout > n:
        raise ConfigError(f"{path} has {n} ads; asked for {num_calib} calibration + {num_heldout} held-out "
                          "(calibration.num_texts + eval_texts)")
    return n


def example_corpus_split(num_calib: int, num_heldout: int, seed: int = 0,
                         path: Path = EXAMPLE_CORPUS) -> tuple[list[str], list[str]]:
    """Disjoint ads from the bundled corpus: calibration texts ("title. description") and held-out
    texts (descriptions of other ads, never seen in calibration)."""
    import pyarrow.parquet as pq

    n = check_example_split(num_calib, num_heldout, path)
    table = pq.read_table(path, columns=["title", "description"])
    titles = table.column("title").to_pylist()
    descs = table.column("description").to_pylist()
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
            raise ConfigError(f"{path}: needs a 'text' column or 'title'+'description'; has {sorted(cols)}")
    elif path.suffix.lower() in (".txt", ".md"):
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ConfigError(f"CalibrationConfig.path: {path} must be .txt/.md or .parquet")
    if not texts:
        raise ConfigError(f"CalibrationConfig.path: {path} holds no texts")
    if len(texts) < config.num_texts:
        log.warning("calibration: %s holds %d texts, fewer than num_texts = %d: using them all",
                    path, len(texts), config.num_texts)
    g = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(texts), generator=g).tolist()[: config.num_texts]
    return [texts[i] for i in order]


def served_corpus_sources(index_dir: str | Path, manifest: dict[str, Any],
                          ads: str | Path | None = None) -> tuple[list[Path], Any]:
    """The corpus files the ad texts of :func:`served_calibration_texts` are read from (``ads``, default the
    ``input_files`` of the index's ``manifest``, each of which must still be there) and the
    :class:`adbatch.index.corpus.CorpusConfig` they are read with: the index's column mapping, texts only (a
    corpus copy without the precomputed embedding column reads too); None = the corpus defaults."""
    from adbatch.index.corpus import CorpusConfig

    columns = (manifest.get("config") or {}).get("columns")
    col_cfg = CorpusConfig.from_dict({**columns, "embedding": None, "embedding_dim": None}) if columns else None
    sources = [Path(ads)] if ads is not None else [Path(p) for p in manifest.get("input_files") or []]
    if not sources:
        raise ConfigError(f"{index_dir}: the index manifest lists no input_files; pass the ad corpus (ads=)")
    for src in sources:
        if ads is None and not src.exists():
            raise FileNotFoundError(f"{index_dir}: the ad corpus {src} the index was built from is not there; "
                                    "pass it (ads=)")
    return sources, col_cfg


def served_calibration_texts(index_dir: str | Path, tokenizer: Any, config: CalibrationConfig,
                             queries: Sequence[tuple[str, Any]] = (), ads: str | Path | None = None,
                             query_share: float = 0.5, max_query_tokens: int = 48) -> list[str]:
    """Calibration texts from what a model serving the index at ``index_dir`` reads: ``config.num_texts``
    texts, sampled with ``config.seed``.

    - ``1 - query_share`` of them: ad texts of the indexed ads, as the index embedded them (category,
      title, description, keywords of the corpus it was built from: ``ads``, default the manifest's
      ``input_files``, read with the index's column mapping).
    - ``query_share``: queries rendered as the targeting prompt (:func:`adbatch.serving.prompts.encode_targeting_prompt`,
      decoded back to text) followed by the ad's target sequence (its ``ad_codes.text``, the trailing
      EOS left to :func:`token_blocks`) -- the labelled ``(query, ad_id)`` pairs that name an indexed ad,
      topped up with span pseudo-queries of the ads' titles (:func:`adbatch.training.pseudo_queries.span_pseudo_queries`)
      when there are fewer than that.

    ``tokenizer``: the one of the model being compressed (a model trained on a ``codes`` index has its
    code tokens, so a rendered ``<ad_L0_3>...`` target reads back as those tokens).
    """
    from adbatch.index.corpus import read_corpus
    from adbatch.index.build import load_index
    from adbatch.serving.prompts import encode_targeting_prompt, special_tokens_around
    from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries

    if not 0.0 <= query_share <= 1.0:
        raise ConfigError(f"served_calibration_texts: query_share must be in [0, 1], got {query_share}")
    index = load_index(index_dir)
    sources, col_cfg = served_corpus_sources(index_dir, index.manifest, ads)
    text_of: dict[Any, str] = {}
    title_of: dict[Any, str] = {}
    for src in sources:
        corpus = read_corpus(src, col_cfg)
        ids = corpus.table.column("ad_id").to_pylist()
        text_of.update(zip(ids, corpus.embedding_inputs()))
        title_of.update(zip(ids, corpus.table.column("text").to_pylist()))
    ad_ids = index.ad_ids
    rows = [r for r, a in enumerate(ad_ids) if text_of.get(a)]
    if not rows:
        raise ConfigError(f"{index_dir}: none of the index's {len(ad_ids)} ads has a text in {[str(s) for s in sources]}")
    if len(rows) < len(ad_ids):
        log.warning("calibration: %d of the index's %d ads have no text in %s (the corpus changed since the "
                    "index was built?)", len(ad_ids) - len(rows), len(ad_ids), [str(s) for s in sources])
    n_query = int(round(config.num_texts * query_share))
    n_ad = config.num_texts - n_query
    g = torch.Generator().manual_seed(config.seed)
    ad_rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()[:n_ad]]
    out = [text_of[ad_ids[r]] for r in ad_rows]

    row_of = {a: r for r, a in enumerate(ad_ids)}
    pairs = [(str(q), row_of[a]) for q, a in queries if a in row_of and str(q).strip()]
    picked = [pairs[i] for i in torch.randperm(len(pairs), generator=g).tolist()[:n_query]]
    if len(picked) < n_query:  # too few labelled pairs (or none): span pseudo-queries of other ads' titles
        order = torch.randperm(len(rows), generator=g).tolist()[: n_query - len(picked)]
        span_rows = [rows[i] for i in order]
        spans = span_pseudo_queries([title_of.get(ad_ids[r]) or "" for r in span_rows],
                                    PseudoQueryConfig(per_ad=1, seed=config.seed))
        picked += [(q, span_rows[j]) for q, j in spans]
    targets = index.texts()
    eos_str = tokenizer.eos_token or ""
    prefix = list(special_tokens_around(tokenizer)[0])
    for q, r in picked:
        prompt = encode_targeting_prompt(tokenizer, q, max_query_tokens=max_query_tokens)
        if prefix and prompt[:len(prefix)] == prefix:  # token_blocks starts every row with the prefix
            prompt = prompt[len(prefix):]
        target = targets[r]
        if eos_str and target.endswith(eos_str):  # token_blocks ends every text with EOS
            target = target[:-len(eos_str)]
        out.append(tokenizer.decode(prompt) + target)
    log.info("calibration: %d ad texts + %d query prompts (%d labelled) from index %s", len(ad_rows),
             len(picked), min(len(pairs), n_query), index.index_hash[:12])
    return out


def token_blocks(tokenizer: Any, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate texts (EOS between them) and cut into rows of ``seq_len`` tokens, each row
    starting the way the tokenizer starts a text.

    Special tokens follow the tokenizer's own settings (:func:`adbatch.serving.prompts.special_tokens_around`):
    every row begins with its prefix (BOS where it declares ``add_bos_token``: Gemma's perplexity
    without it is ~7x higher), and texts end with its suffix when it adds one (``add_eos_token``),
    else with EOS. A tokenizer that adds nothing (SmolLM2) gives plain EOS-joined text.

    Returns long [B, seq_len]; the tail shorter than seq_len becomes a last, shorter batch only if
    nothing else exists (so tiny inputs still yield one row).
    """
    from adbatch.serving.prompts import special_tokens_around

    prefix, suffix = special_tokens_around(tokenizer)
    end = list(suffix) if suffix else ([] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id])
    if len(prefix) >= seq_len:
        raise ValueError(f"seq_len {seq_len} leaves no room after the tokenizer's {len(prefix)} prefix tokens")
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.extend(end)
    if not ids:
        raise ValueError("calibration texts tokenized to nothing")
    flat = torch.tensor(ids, dtype=torch.long)
    body = seq_len - len(prefix)
    rows = flat.numel() // body
    if rows == 0:
        rows, body = 1, flat.numel()
    blocks = flat[: rows * body].reshape(rows, body)  # [B, seq_len - len(prefix)]
    if prefix:
        blocks = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(rows, len(prefix)), blocks], dim=1)
    return blocks


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (MB; Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder blocks: the ``nn.ModuleList`` holding the most parameters.

    Architecture-agnostic (``model.layers`` in Llama/Qwen2/Mistral/Gemma, ``transformer.h`` in GPT-2):
    a nested list (e.g. MoE experts inside a block) always holds fewer parameters than the stack.
    Returns ``(qualified name, module list)``.
    """
    best: tuple[str, nn.ModuleList, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[2]:
                best = (name, mod, n)
    if best is None or best[2] == 0:
        raise ValueError("layerwise calibration: the model has no nn.ModuleList of decoder blocks; use mode=full")
    return best[0], best[1]


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: ``cudaMemGetInfo`` for CUDA, ``MemAvailable`` of /proc/meminfo
    (else free physical pages) for CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError("calibration expects the model on one device, its parameters are on "
                         f"{sorted(map(str, devices))}")
    return devices.pop()


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def full_path_bytes(model: nn.Module, linears: dict[str, nn.Linear], batch_tokens: int,
                    use_gradients: bool, device: torch.device) -> int:
    """Estimated bytes the full path needs on ``device`` beyond what is already there.

    = parameters (only if the model is elsewhere) + the linears' weight gradients (model dtype)
    + statistics (fp32 act_sq; with gradients also grad_sq [N, K] and out_grad_sq) + activations of
    one batch: ``batch_tokens * (sum over linears of (K + N) * element size + 12 * vocab)`` (inputs
    and outputs kept for backward, fp32 logits with their softmax and gradient).
    """
    on_device = _normalize(_model_device(model)) == _normalize(device)
    params = 0 if on_device else sum(p.numel() * p.element_size() for p in model.parameters())
    grads = stats = act = 0
    for m in linears.values():
        n, k = m.weight.shape
        elem = m.weight.element_size()
        stats += 4 * k
        if use_gradients:
            grads += n * k * elem
            stats += 4 * (n * k + n)
        act += (k + n) * elem
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = int(emb.weight.shape[0]) if emb is not None and hasattr(emb, "weight") else 0
    act = batch_tokens * (act + 12 * vocab)
    return params + grads + stats + act


def choose_mode(model: nn.Module, linears: dict[str, nn.Linear], blocks: torch.Tensor,
                config: CalibrationConfig, device: torch.device) -> tuple[CalibrationMode, str]:
    """Resolve ``config.mode``: auto -> layerwise iff :func:`full_path_bytes` >
    ``config.auto_memory_fraction`` * :func:`free_memory_bytes`. Returns ``(mode, reason)``."""
    mode = CalibrationMode(config.mode)
    if mode is not CalibrationMode.AUTO:
        return mode, "configured"
    need = full_path_bytes(model, linears, config.batch_size * int(blocks.shape[1]), config.use_gradients, device)
    free = free_memory_bytes(device)
    limit = config.auto_memory_fraction * free
    chosen = CalibrationMode.LAYERWISE if need > limit else CalibrationMode.FULL
    reason = (f"auto: full path needs ~{need / 2**20:.0f} MB, {config.auto_memory_fraction:g} x free "
              f"{free / 2**20:.0f} MB on {device} = {limit / 2**20:.0f} MB -> {chosen.value}")
    return chosen, reason


class _StatsCollector:
    """Accumulates :class:`LayerStats` through hooks; shared by the full and the layerwise path.

    A forward hook on each linear adds the input's ``x^2`` column sums and, when the output is part of
    a graph, registers a tensor hook adding the output gradient's ``g^2`` row sums;
    :meth:`add_weight_grads` adds ``(dE_b/dW)^2`` after each batch's backward. Hooks record only while
    :attr:`active` (the layerwise path runs blocks more than once); a call while inactive is noted
    in :attr:`inactive_calls`.
    """

    def __init__(self, linears: dict[str, nn.Linear], use_grad: bool) -> None:
        self.linears = linears
        self.use_grad = use_grad
        self.stats: dict[str, LayerStats] = {}
        self.active = True
        self.inactive_calls: set[str] = set()
        self._handles = [m.register_forward_hook(self._make_hook(name)) for name, m in linears.items()]

    def _make_hook(self, name: str):
        def hook(mod, inputs, output):
            if not self.active:
                self.inactive_calls.add(name)
                return
            st = self.stats[name]
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            st.act_sq += x.pow(2).sum(dim=0)
            st.num_tokens += x.shape[0]
            if self.use_grad and output.requires_grad:
                def grad_hook(g):
                    st.out_grad_sq.add_(g.detach().reshape(-1, g.shape[-1]).float().pow(2).sum(dim=0))
                output.register_hook(grad_hook)
        return hook

    def allocate(self, names: Iterable[str], device: torch.device) -> None:
        """Zero statistics for ``names`` on ``device`` (beside the weights: no per-batch transfers)."""
        for name in names:
            m = self.linears[name]
            st = LayerStats(act_sq=torch.zeros(m.in_features, device=device), num_tokens=0)
            if self.use_grad:
                st.grad_sq = torch.zeros(m.out_features, m.in_features, device=device)
                st.out_grad_sq = torch.zeros(m.out_features, device=device)
            self.stats[name] = st

    def add_weight_grads(self, names: Iterable[str]) -> None:
        """``grad_sq += (dE_b/dW)^2`` for ``names`` after one batch's backward; clears the grads."""
        for name in names:
            m = self.linears[name]
            self.stats[name].grad_sq += m.weight.grad.detach().float().pow(2)
            m.weight.grad = None

    def offload(self, names: Iterable[str]) -> None:
        for name in names:
            self.stats[name] = self.stats[name].to("cpu")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def calibrate(model: torch.nn.Module, blocks: torch.Tensor, config: CalibrationConfig,
              skip: tuple[str, ...] = ("lm_head",)) -> CalibrationStats:
    """Collect :class:`LayerStats` (CPU float32) for every compressible linear of ``model``.

    Args: model: a causal LM (returns ``.loss`` given ``labels``) on one device; blocks: long [B, T]
    token ids; config: batch size, gradients on/off, ``mode`` (full | layerwise | auto) and the
    compute ``device``. The model's parameters are left unchanged and where they were
    (requires_grad flags restored, grads cleared). ``info`` records the mode, the device, the peak
    device memory (CUDA ``max_memory_allocated``) and the process's peak RSS.
    """
    t0 = time.perf_counter()
    linears = compressible_linears(model, skip)
    if not linears:
        raise ValueError("model has no compressible nn.Linear layers")
    model_device = _model_device(model)
    device = _normalize(torch.device(config.device)) if config.device is not None else model_device
    mode, reason = choose_mode(model, linears, blocks, config, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    use_grad = config.use_gradients
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    if use_grad:
        for m in linears.values():
            m.weight.requires_grad_(True)
    collector = _StatsCollector(linears, use_grad)
    batches = list(torch.split(blocks, config.batch_size))
    try:
        with eval_mode(model):
            if mode is CalibrationMode.FULL:
                _calibrate_full(model, batches, collector, device, model_device)
            else:
                _calibrate_layerwise(model, batches, collector, device)
    finally:
        collector.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
            p.grad = None
    info = {
        "path": f"{mode.value}_forward_backward" if use_grad else f"{mode.value}_forward",
        "mode": mode.value,
        "mode_reason": reason,
        "device": str(device),
        "sequences": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "tokens": int(blocks.numel()),
        "layers": len(linears),
        "seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_device_mb": (round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                           if device.type == "cuda" else None),
    }
    log.info("calibration: %s", info)
    return CalibrationStats(layers=collector.stats, info=info)


def _summed_loss_backward(model: nn.Module, batch: torch.Tensor) -> None:
    """Backward of the batch's *summed* (not mean) next-token loss, so the statistics do not depend
    on the batch size; both paths use it, so their |dE/dW| agree."""
    out = model(input_ids=batch, labels=batch, use_cache=False)
    (out.loss * (batch.shape[0] * (batch.shape[1] - 1))).backward()


def _calibrate_full(model: nn.Module, batches: list[torch.Tensor], collector: _StatsCollector,
                    device: torch.device, model_device: torch.device) -> None:
    """One forward (+ backward of the summed token loss) per batch over the whole model."""
    names = list(collector.linears)
    moved = device != model_device
    if moved:
        model.to(device)
    try:
        collector.allocate(names, device)
        for batch in tqdm(batches, desc="calibration", unit="batch", leave=False):
            batch = batch.to(device)
            if collector.use_grad:
                _summed_loss_backward(model, batch)
                collector.add_weight_grads(names)
            else:
                with torch.no_grad():
                    model(input_ids=batch)
    finally:
        if moved:
            model.to(model_device)
    collector.offload(names)


class _StopForward(Exception):
    """Raised by the capture pass once the last block's arguments are recorded."""


@contextlib.contextmanager
def _replaced_forwards(blocks: nn.ModuleList, make_forward) -> Iterator[None]:
    """Temporarily replace each block's ``forward`` (instance attribute, so hooks and the class
    stay untouched) by ``make_forward(i)``."""
    try:
        for i, block in enumerate(blocks):
            block.forward = make_forward(i)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


@contextlib.contextmanager
def _rest_on(model: nn.Module, blocks: nn.ModuleList, device: torch.device) -> Iterator[None]:
    """Move everything but the decoder blocks (embeddings, final norm, lm_head, rotary buffers) to
    ``device`` and back. The blocks are detached from the list meanwhile, so ``model.to`` skips
    them; tied parameters stay tied (one Parameter object moved once)."""
    home = _model_device(model)
    saved = dict(blocks._modules)

    def move(dev: torch.device) -> None:
        blocks._modules.clear()
        try:
            model.to(dev)
        finally:
            blocks._modules.update(saved)

    move(device)
    try:
        yield
    finally:
        move(home)


def _block_output(out: Any) -> torch.Tensor:
    """Hidden states from a block's return value (a tensor, or a tuple starting with it)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _calibrate_layerwise(model: nn.Module, batches: list[torch.Tensor], collector: _StatsCollector,
                         device: torch.device) -> None:
    """Block-by-block forward, the model's own head, block-by-block backward (module docstring)."""
    prefix, blocks = decoder_blocks(model)
    n_blocks = len(blocks)
    block_names: list[list[str]] = [[] for _ in range(n_blocks)]
    head_names: list[str] = []
    for name in collector.linears:
        rel = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None
        if rel is not None and rel.split(".", 1)[0].isdigit():
            block_names[int(rel.split(".", 1)[0])].append(name)
        else:
            head_names.append(name)
    use_grad = collector.use_grad
    home = [next(b.parameters()).device for b in blocks]
    try:
        with _rest_on(model, blocks, device):
            # 1. capture: run the model's own forward up to the blocks; each block records its input and
            # call arguments (mask, rotary cos/sin, position ids: on the device, shared by all blocks,
            # a few MB) and passes its input through; the last one stops the forward.
            hidden: list[torch.Tensor] = []  # block-boundary states of the current depth, CPU
            calls: list[list[tuple[tuple, dict]]] = []  # [batch][block] -> (args after hidden, kwargs)
            collector.active = False
            collector.inactive_calls.clear()
            for batch in batches:
                per_block: list[tuple[tuple, dict]] = []
                first: list[torch.Tensor] = []

                def make_capture(i: int):
                    def forward(*args, **kwargs):
                        h = args[0] if args else kwargs.pop("hidden_states")
                        if first and h.shape != first[0].shape:
                            raise ValueError(f"layerwise calibration: block {i} received hidden states of shape "
                                             f"{tuple(h.shape)}, block 0 {tuple(first[0].shape)}; this model's "
                                             "block outputs are not plain hidden states, use mode=full")
                        if not first:
                            first.append(h)
                        per_block.append((tuple(args[1:]), dict(kwargs)))
                        if i == n_blocks - 1:
                            raise _StopForward
                        return h
                    return forward

                with _replaced_forwards(blocks, make_capture), torch.no_grad():
                    try:
                        model(input_ids=batch.to(device), use_cache=False)
                    except _StopForward:
                        pass
                if len(per_block) != n_blocks:
                    raise ValueError(f"layerwise calibration: the forward called {len(per_block)} of {n_blocks} blocks")
                hidden.append(first[0].to("cpu"))
                calls.append(per_block)
            if collector.inactive_calls:
                early = sorted(collector.inactive_calls)[:3]
                raise ValueError(f"layerwise calibration: compressible linears {early} run "
                                 "before the decoder blocks, so their gradients need the full backward; use mode=full")

            # 2. forward sweep without grad, keeping every block's input (CPU); without gradients this
            # is where the statistics are recorded
            inputs: list[list[torch.Tensor]] = []
            for i, block in enumerate(tqdm(blocks, desc="calibration forward", unit="block", leave=False)):
                block.to(device)
                collector.active = not use_grad
                if not use_grad:
                    collector.allocate(block_names[i], device)
                outs = []
                with torch.no_grad():
                    for b, h in enumerate(hidden):
                        args, kwargs = calls[b][i]
                        outs.append(_block_output(block(h.to(device), *args, **kwargs)).to("cpu"))
                if not use_grad:
                    collector.offload(block_names[i])
                block.to(home[i])
                inputs.append(hidden)
                hidden = outs

            # 3. the model's own head on the last block's output: final norm, lm_head, (softcap,) loss;
            # the blocks pass through and the last returns the saved state, so nothing is re-implemented
            collector.active = True
            collector.allocate(head_names, device)
            grads: list[torch.Tensor] = []
            for b, batch in enumerate(batches):
                h_top = hidden[b].to(device).detach().requires_grad_(use_grad)

                def make_inject(i: int):
                    def forward(*args, **kwargs):
                        return h_top if i == n_blocks - 1 else (args[0] if args else kwargs["hidden_states"])
                    return forward

                batch = batch.to(device)
                with _replaced_forwards(blocks, make_inject):
                    if use_grad:
                        _summed_loss_backward(model, batch)
                        collector.add_weight_grads(head_names)
                        grads.append(h_top.grad.to("cpu"))
                    elif head_names:
                        with torch.no_grad():
                            model(input_ids=batch, use_cache=False)
            collector.offload(head_names)
            if not use_grad:
                return

            # 4. reverse sweep: recompute each block from its saved input with grad enabled, push the
            # incoming gradient through it (hooks record activations and output gradients, then the
            # per-batch weight gradients are squared and added), pass the input gradient down
            for i in tqdm(range(n_blocks - 1, -1, -1), desc="calibration backward", unit="block", leave=False):
                block = blocks[i]
                block.to(device)
                collector.allocate(block_names[i], device)
                for b in range(len(batches)):
                    args, kwargs = calls[b][i]
                    x = inputs[i][b].to(device).detach().requires_grad_(True)
                    with torch.enable_grad():
                        y = _block_output(block(x, *args, **kwargs))
                    torch.autograd.backward(y, grads[b].to(device))
                    collector.add_weight_grads(block_names[i])
                    grads[b] = x.grad.to("cpu")
                collector.offload(block_names[i])
                inputs[i] = []
                block.to(home[i])
    finally:
        # an error half-way must not leave blocks on the device
        for block, dev in zip(blocks, home):
            block.to(dev)
