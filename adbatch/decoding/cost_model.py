"""The verification trigger's measured cost model.

Two piecewise-linear curves, measured on the hardware in use (never constants):
``step_ms(rows)`` — one decode step of ``rows`` cache rows (one token each), and
``verify_ms(tokens)`` — one tree-verification pass feeding ``tokens`` tree tokens in total.
Both are timed on a context of ``context_len`` cached tokens. A calibration is saved as JSON in
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
from adbatch.decoding.kv import (cache_length, copy_rows, forward_hidden, head_logits_lse, keep_rows,
                                 model_device, model_dtype, new_cache)

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # 2: steps timed with in-place reorder + log-sum-exp head, as searched


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
def calibrate(model: Any, rows: tuple[int, ...] = (1, 4, 16, 64, 256),
              tokens: tuple[int, ...] = (16, 64, 256, 1024, 4096), context_len: int = 64,
              repeats: int = 3) -> CostModel:
    """Time decode steps vs rows and tree passes vs tree tokens on ``model``'s device.

    Trees are timed as chains of 32 tokens (``tokens // 32`` beams), which exercises the same 4-D
    mask path as real trees; cost depends on the token count, not the tree's shape.
    """
    dev = model_device(model)
    dtype = model_dtype(model)
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(
        model.get_output_embeddings(), "weight") else model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prefix(n: int) -> tuple[Any, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, context_len), generator=gen).to(dev)
        mask = torch.ones_like(ids)
        pos = torch.arange(context_len, device=dev)[None].expand(n, -1)
        cache = new_cache()
        forward_hidden(model, ids, mask, pos, cache)
        return cache, mask

    def best_of(fn) -> float:
        fn()  # warm-up (allocator, kernel selection)
        fn()
        _sync(dev)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    step_ms = []
    for r in rows:
        cache, mask = prefix(r)
        ids = torch.randint(0, vocab, (r, 1), generator=gen).to(dev)

        def step() -> None:
            # exactly a search step: reorder rows in place, feed one token, log-normalize the head
            keep_rows(cache, torch.arange(r, device=dev))
            length = cache_length(cache)
            m2 = torch.ones(r, length + 1, dtype=torch.long, device=dev)
            pos = torch.full((r, 1), length, device=dev)
            h = forward_hidden(model, ids, m2, pos, cache)
            head_logits_lse(model, h[:, 0])  # the cache grows by one per call: negligible here
        step_ms.append(best_of(step))
        del cache

    verify_ms = []
    chain = 32
    for t in tokens:
        beams = max(t // chain, 1)
        length = min(t, chain)
        cache, mask = prefix(beams)
        ids = torch.randint(0, vocab, (beams, length), generator=gen).to(dev)
        pos = context_len + torch.arange(length, device=dev)[None].expand(beams, -1)
        causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
        vis = torch.cat([torch.ones(beams, length, context_len, dtype=torch.bool, device=dev),
                         causal[None].expand(beams, -1, -1)], -1)[:, None]
        m4 = torch.zeros(vis.shape, dtype=dtype, device=dev).masked_fill_(~vis, torch.finfo(dtype).min)

        def verify() -> None:
            c = copy_rows(cache, torch.arange(beams, device=dev))
            h = forward_hidden(model, ids, m4, pos, c)
            head_logits_lse(model, h.reshape(beams * length, -1))
        verify_ms.append(best_of(verify))
        del cache
    cm = CostModel(list(rows), step_ms, list(tokens), verify_ms, key=calibration_key(model),
                   meta={"device": device_name(dev), "dtype": str(dtype), "context_len": context_len,
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    log.info("decode cost model: step_ms %s at rows %s; verify_ms %s at tokens %s",
             [round(x, 2) for x in step_ms], list(rows), [round(x, 2) for x in verify_ms], list(tokens))
    return cm


def calibration_dir() -> Path:
    from adbatch.models import cache_root

    return cache_root() / "decoding_calibration"


def load_or_calibrate(model: Any, cache_dir: str | Path | None = None, **kwargs: Any) -> CostModel:
    """The saved calibration for (model, device, dtype) if present, else measure and save it."""
    key = calibration_key(model)
    path = Path(cache_dir) if cache_dir is not None else calibration_dir()
    path = path / f"{key}.json"
    if path.is_file():
        try:
            return CostModel.load(path)
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            log.warning("ignoring unreadable calibration %s (%s); measuring again", path, exc)
    cm = calibrate(model, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    cm.save(path)
    return cm
