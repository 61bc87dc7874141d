"""The verification trigger's measured cost model.

Two piecewise-linear curves, measured on the hardware in use (never constants):
``step_ms(rows)`` — one decode step of ``rows`` cache rows (one token each), and
``verify_ms(tokens)`` — one tree-verification pass feeding ``tokens`` tree tokens in total.
Both are timed on the decode engine exactly as the search runs them (graph-replayed steps on CUDA,
eager on CPU; shared prompt of ``context_len`` tokens, 16 suffix tokens, 8 beams per query). A calibration is saved as JSON in
``<adbatch cache>/decoding_calibration/<key>.json``, the key hashing the model config, the device
name and the dtype, and loaded instead of re-measuring when present.

Decision rule (auto mode): verify a beam at node ``n`` when
``verify_ms(fed[n]) < height[n] * step_ms(rows now)``, within the per-beam and per-pass token caps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adbatch.artifacts import sha256_json, write_json_atomic
from adbatch.decoding.engine import engine_for, model_device, model_dtype

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 4  # 4: tree passes graph-replayed on CUDA too (3: steps only)


@dataclasses.dataclass
class CostModel:
    """Measured costs in milliseconds at the given points (ascending)."""

    step_rows: list[int]
    step_ms: list[float]
    verify_tokens: list[int]
    verify_ms: list[float]
    key: str = ""
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, xs, ys in (("step", self.step_rows, self.step_ms),
                             ("verify", self.verify_tokens, self.verify_ms)):
            if len(xs) < 1 or len(xs) != len(ys):
                raise ValueError(f"CostModel.{name}: need >= 1 point and equal lengths")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"CostModel.{name}: points must be strictly ascending, got {xs}")

    @staticmethod
    def _interp(x: np.ndarray, xs: list[int], ys: list[float]) -> np.ndarray:
        """Piecewise-linear, extended linearly past the last point (cost grows with size)."""
        x = np.asarray(x, dtype=np.float64)
        xs_a, ys_a = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
        out = np.interp(x, xs_a, ys_a)
        if len(xs_a) >= 2:
            slope = max((ys_a[-1] - ys_a[-2]) / (xs_a[-1] - xs_a[-2]), 0.0)
        else:
            slope = ys_a[-1] / max(xs_a[-1], 1.0)
        return np.where(x > xs_a[-1], ys_a[-1] + slope * (x - xs_a[-1]), out)

    def step_cost(self, rows: Any) -> np.ndarray:
        """Milliseconds of one decode step at ``rows`` cache rows."""
        return self._interp(rows, self.step_rows, self.step_ms)

    def verify_cost(self, tokens: Any) -> np.ndarray:
        """Milliseconds of one verification pass feeding ``tokens`` tree tokens."""
        return self._interp(tokens, self.verify_tokens, self.verify_ms)

    def to_dict(self) -> dict:
        return {"version": CALIBRATION_VERSION, **dataclasses.asdict(self)}

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        if data.pop("version", None) != CALIBRATION_VERSION:
            raise ValueError(f"{path}: calibration version differs from {CALIBRATION_VERSION}")
        return cls(**data)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def calibration_key(model: Any) -> str:
    """Hash of (model config, device name, dtype): a calibration is reused only on the same."""
    dev = model_device(model)
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(vars(model.config))
    cfg = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    ident = {"model": type(model).__name__, "config": cfg, "device": device_name(dev),
             "dtype": str(model_dtype(model)),
             "linear": sorted({type(m).__name__ for m in model.modules()
                               if "Linear" in type(m).__name__})}
    return sha256_json(ident)[:24]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def calibrate(model: Any, rows: tuple[int, ...] | None = None, tokens: tuple[int, ...] | None = None,
              context_len: int = 64, repeats: int = 3, beams: int = 8) -> CostModel:
    """Time decode steps vs rows and tree passes vs tree tokens on ``model``'s device, on its engine.

    Steps run ``rows // beams`` queries of ``beams`` slots (rows are rounded to that grid); trees
    are timed as chains of 32 tokens (``tokens // 32`` beams), which exercises the same tree mask
    path as real trees; cost depends on the token count, not the tree's shape.
    """
    dev = model_device(model)
    dtype = model_dtype(model)
    # default points: what beam search reaches on the device (CPU: small batches only)
    if rows is None:
        rows = (8, 32, 128, 512, 2048, 8192) if dev.type == "cuda" else (8, 32, 128)
    if tokens is None:
        tokens = (16, 64, 256, 1024, 4096) if dev.type == "cuda" else (16, 64, 256)
    engine = engine_for(model)
    vocab = engine.vocab
    gen = torch.Generator().manual_seed(0)
    suffix_t = 16
    chain = 32
    max_q = max(max(r // beams, 1) for r in rows)
    max_q = max(max_q, max(max(t // chain, 1) for t in tokens) // beams + 1)
    prompts = torch.randint(0, vocab, (max_q, context_len), generator=gen).tolist()
    engine.prefill(prompts, beams, suffix_t + 1)

    def best_of(fn) -> float:
        fn()  # warm-up (graph capture, allocator, kernel selection)
        fn()
        _sync(dev)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    step_rows, step_ms = [], []
    for r in rows:
        qb = max(r // beams, 1)
        qb = 1 << (qb - 1).bit_length()
        n = qb * beams
        if step_rows and n <= step_rows[-1]:
            continue
        ids = torch.randint(0, vocab, (n,), generator=gen).to(dev)
        parent = torch.arange(n, device=dev)

        def step() -> None:  # exactly a search step: reorder by parent, one token per row, log-normalize
            engine.step(ids, suffix_t, qb, parent)
        step_rows.append(n)
        step_ms.append(best_of(step))

    verify_ms = []
    for t in tokens:
        nb = max(t // chain, 1)
        length = min(t, chain)
        rows_v = torch.arange(nb, device=dev)
        ids = torch.randint(0, vocab, (nb, length), generator=gen).to(dev)
        pos = engine.prompt_len[rows_v // engine.B][:, None] + suffix_t + torch.arange(length, device=dev)
        causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()[None].expand(nb, -1, -1)

        def verify() -> None:
            engine.tree_forward(rows_v, suffix_t, ids, pos, causal)
        verify_ms.append(best_of(verify))
    cm = CostModel(step_rows, step_ms, list(tokens), verify_ms, key=calibration_key(model),
                   meta={"device": device_name(dev), "dtype": str(dtype), "context_len": context_len,
                         "beams": beams, "graphs": engine.graphs_enabled,
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    log.info("decode cost model: step_ms %s at rows %s; verify_ms %s at tokens %s",
             [round(x, 2) for x in step_ms], step_rows, [round(x, 2) for x in verify_ms], list(tokens))
    return cm


def calibration_dir() -> Path:
    from adbatch.models import cache_root

    return cache_root() / "decoding_calibration"


def load_or_calibrate(model: Any, cache_dir: str | Path | None = None, **kwargs: Any) -> CostModel:
    """The saved calibration for (model, device, dtype) if present, else measure and save it.

    Under a file lock per key: generation actors starting together on one host (one per GPU) would
    otherwise each measure at once -- under each other's load, into different cost models, so the `auto`
    verification decisions, and with them the output rows, would depend on how many actors ran. With
    the lock the first one measures alone and the others load its result."""
    from filelock import FileLock

    key = calibration_key(model)
    path = Path(cache_dir) if cache_dir is not None else calibration_dir()
    path = path / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            try:
                return CostModel.load(path)
            except (ValueError, TypeError, json.JSONDecodeError) as exc:
                log.warning("ignoring unreadable calibration %s (%s); measuring again", path, exc)
        cm = calibrate(model, **kwargs)
        cm.save(path)
        return cm
