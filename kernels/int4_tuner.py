"""Launch configurations of the SparseGemv kernels and the tuner that picks one per layer shape.

:class:`KernelConfig` holds the launch parameters of the GEMV (:mod:`kernels.gemv_int4`) or tensor-core
(:mod:`kernels.tc_int4`) kernel. The config space is pure functions of (packed shape, batch, SM count):
:func:`heuristic_config` (one config without timing) and :func:`candidate_configs` (what the tuner times).

:class:`KernelTuner` is the one owner of the runtime tuning state: the configs chosen per (pattern, N, K,
dtype, batch bucket, device, autotune flag, L2 mode) in memory, the :class:`TuneCache` JSON file per
device name under :func:`cache_dir` (``$ADBATCH_CACHE/kernels/``, default ``~/.cache/adbatch``; the decode engine's
per-bucket linear plans are kept there too), and the optional log of
every timed candidate (:meth:`KernelTuner.start_tune_log` / :meth:`KernelTuner.tune_log`, for
benchmarks). It times candidates by CUDA-graph replays, with a warm L2 unless
``ADBATCH_NM_INT4_TUNE_L2=cold`` (see :func:`time_graphed_ms`); a heuristic runs under the interpreter or
with ``ADBATCH_NM_INT4_AUTOTUNE=0``. The launcher (:mod:`kernels.int4_launch`) builds the process's one
tuner, :data:`kernels.int4_launch.TUNER`, around its own launch function; this module imports no kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Callable

import torch
import triton

from kernels.nm_int4 import PackedNMInt4, SparsityPattern, nm_int4_linear_reference

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GEMV_BATCH_TILES = (1, 2, 4, 8)  # batch tiles of the GEMV kernel
GEMV_MAX_BATCH = GEMV_BATCH_TILES[-1]
GEMV_TUNE_MAX_BATCH = 16  # largest bucket whose tuner also times GEMV configs (several batch tiles)
# part of the tuning-cache file name: configs tuned for older kernels are not reused. Bump it when the
# code gemv_int4 / tc_int4 generate changes.
KERNEL_VERSION = 9


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the GEMV (``use_dot=False``, :mod:`kernels.gemv_int4`) or tensor-core
    (:mod:`kernels.tc_int4`) kernel."""

    block_b: int
    block_n: int
    block_kk: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3

    def validate(self, pattern: SparsityPattern) -> None:
        if self.block_kk not in (32, 64, 128):
            raise ValueError(f"block_kk={self.block_kk} must be 32, 64 or 128")
        if not self.use_dot and self.block_b not in GEMV_BATCH_TILES:
            raise ValueError(f"the GEMV path takes block_b in {GEMV_BATCH_TILES}: {self}")
        if self.use_dot and (self.block_b < 16 or 4 * self.block_kk // pattern.n < 16 or self.block_n < 16):
            raise ValueError(f"tl.dot needs block_b, block_n and the dense K tile >= 16: {self}")
        for name in ("block_b", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.use_dot and self.block_kk % 32:
            raise ValueError(f"the tensor-core kernel takes whole 32-value sub-blocks: {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")


# the bucket of each batch size 1..64 (index = batch; the launcher's hot path indexes it)
BUCKET_OF = [0] + [next(b for b in BATCH_BUCKETS if n <= b) for n in range(1, BATCH_BUCKETS[-1] + 1)]


def batch_bucket(batch: int) -> int:
    """Smallest bucket in BATCH_BUCKETS holding ``batch`` (64 for anything larger)."""
    return BUCKET_OF[batch] if 0 < batch <= BATCH_BUCKETS[-1] else BATCH_BUCKETS[-1]


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pow2_floor(v: float) -> int:
    return 1 << max(0, int(v).bit_length() - 1) if v >= 1 else 1


def _split_for(p: PackedNMInt4, block_n: int, block_kk: int, n_bblocks: int, num_sms: int, waves: float = 4.0) -> int:
    """Split-K so the grid has about ``waves`` programs per SM, keeping >= 4 K steps per program."""
    programs = triton.cdiv(p.out_features, block_n) * n_bblocks
    steps = triton.cdiv(p.padded_kept, block_kk)
    want = _pow2_floor(waves * num_sms / programs) if programs < waves * num_sms else 1
    return max(1, min(want, _pow2_floor(steps / 4), 32))


def gemv_ok(p: PackedNMInt4) -> bool:
    """The GEMV kernel reads x as int64 words of 4 activations: K must be a multiple of 4 (always true
    for n:4 patterns)."""
    return p.in_features % 4 == 0


def tc_block_kk(pattern: SparsityPattern) -> int:
    """Kept values per K step of the tensor-core kernel: a 128-column dense tile for every pattern (4
    sub-blocks of dense, 2 of 2:4, 1 of 1:4). Longer steps amortize the per-step barriers, scale loads
    and address math: sm_90 SASS per kept value at BLOCK_N = 64, B = 16 (bench/kernel_sass.py): dense
    6.5 -> 4.9 (64 -> 128), 2:4 16.8 -> 12.9 (32 -> 64)."""
    return 128 * pattern.n // 4


def heuristic_config(p: PackedNMInt4, batch: int, num_sms: int) -> KernelConfig:
    """A reasonable config without timing (interpreter, or autotuning disabled): the GEMV up to 8 rows,
    the tensor-core kernel above (or where the GEMV cannot run)."""
    bucket = batch_bucket(batch)
    use_dot = bucket > GEMV_MAX_BATCH or not gemv_ok(p)
    block_b = max(16, bucket) if use_dot else bucket
    block_kk = tc_block_kk(p.pattern) if use_dot else 64
    block_n = 128 if use_dot else 64  # see candidate_configs
    n_bblocks = triton.cdiv(batch, block_b)
    split = _split_for(p, block_n, block_kk, n_bblocks, num_sms)
    return KernelConfig(block_b, block_n, block_kk, split, use_dot)


def candidate_configs(p: PackedNMInt4, batch: int, num_sms: int) -> list[KernelConfig]:
    """The configs the autotuner times for this (shape, batch bucket), at most ~26: GEMV tiles up to
    bucket 16 (fewer where tensor-core tiles compete), tensor-core tiles from bucket 8 up (one batch
    tile of max(16, bucket) rows: the MMA's N side); each with the split-K choices of
    :func:`_with_splits`; the first tensor-core tile also with 2 and 4 pipeline stages."""
    bucket = batch_bucket(batch)
    out: list[KernelConfig] = []
    if bucket <= GEMV_TUNE_MAX_BATCH and gemv_ok(p):
        tiles = ((64, 64, 4), (128, 64, 4), (128, 32, 4), (64, 128, 4))
        tiles = tiles[: {8: 2, 16: 1}.get(bucket, 4)]
        for block_n, block_kk, warps in tiles:
            cfg = KernelConfig(min(bucket, GEMV_MAX_BATCH), block_n, block_kk, 1, False, warps)
            out += _with_splits(p, batch, cfg, num_sms)
    if bucket >= 8 or not gemv_ok(p):
        kk = tc_block_kk(p.pattern)
        kk2 = 2 * kk if 2 * kk <= 128 else kk // 2
        # (block_n, block_kk, warps): 64 weight rows fill one warpgroup's wgmma M side; 128 rows on one
        # warpgroup amortize the per-step overhead best (sm_90 SASS per kept value at B = 16: 2:4 11.4
        # vs 13.5, 1:4 17.9 vs 22.4, dense 4.1 vs 5.3); the longer K step spills at 64 batch rows
        # 8 warps (two warpgroups, 64 rows each) halve the registers per thread of a 128-row tile (2:4:
        # 158 -> 88), so more CTAs fit per SM; 256 rows on 8 warps amortize like 128 on 4
        if bucket <= 16:
            tiles = [(128, kk, 4), (128, kk, 8), (128, kk2, 4), (256, kk, 8), (64, kk, 4), (64, kk2, 4)]
        else:
            tiles = [(128, kk, 4), (64, kk, 4), (64, kk2, 4), (128, kk, 8)]
        tiles = tiles[: {8: 3, 16: 4}.get(bucket, 4)] if gemv_ok(p) else tiles
        for i, (block_n, block_kk, warps) in enumerate(tiles):
            cfg = KernelConfig(max(16, bucket), block_n, block_kk, 1, True, warps)
            out += _with_splits(p, batch, cfg, num_sms)
            if i == 0:  # pipeline depth of the weight loads: 2 frees shared memory for wide x tiles, 4 hides more latency
                split = _split_for(p, block_n, block_kk, triton.cdiv(batch, cfg.block_b), num_sms)
                out += [dataclasses.replace(cfg, split_k=split, num_stages=st) for st in (2, 4)]
    return list(dict.fromkeys(out))


def _with_splits(p: PackedNMInt4, batch: int, cfg: KernelConfig, num_sms: int) -> list[KernelConfig]:
    """No split; splits giving about 4 and 16 programs per SM; and a half and a quarter of the first.
    Fewer splits than "4 per SM" win at large B, where each split writes a [B, N] fp32 partial tile
    (H200 round 8, 8192x28672 2:4 B = 64: split 4 125.7 us, split 8 144.8 us, split 32 256 us)."""
    n_b = triton.cdiv(batch, cfg.block_b)
    base = _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms)
    splits = {1, max(1, base // 4), max(1, base // 2), base, _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms, 16.0)}
    return [dataclasses.replace(cfg, split_k=v) for v in sorted(splits)]


def cuda_device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of ``device`` (the current device where it has no index), read once per
    index: what the tuning caches are kept per."""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def cache_dir() -> Path:
    """Where measured choices of this machine's kernels are kept: ``$ADBATCH_CACHE/kernels`` (default
    ``~/.cache/adbatch/kernels``): the tuned kernel configs (:class:`TuneCache`) and the decode engine's per-bucket
    linear plans (:mod:`adbatch.decoding.linear_plan`), each in files named by the device they were measured on."""
    return Path(os.environ.get("ADBATCH_CACHE", Path.home() / ".cache" / "adbatch")) / "kernels"


def file_safe(name: str) -> str:
    """``name`` (a device name: ``NVIDIA H100 80GB HBM3``) as a file-name part: runs of other characters -> ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


class TuneCache:
    """Chosen configs per key, persisted as JSON per device name (one file, rewritten atomically)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mem: dict[str, dict[str, KernelConfig]] = {}

    @staticmethod
    def path(device_name: str) -> Path:
        return cache_dir() / f"nm_int4_tune_{file_safe(device_name)}_triton{triton.__version__}_k{KERNEL_VERSION}.json"

    def _load(self, device_name: str) -> dict[str, KernelConfig]:
        if device_name not in self._mem:
            table: dict[str, KernelConfig] = {}
            path = self.path(device_name)
            if path.is_file():
                try:
                    raw = json.loads(path.read_text())
                    table = {k: KernelConfig(**v["config"]) for k, v in raw.items()}
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("ignoring unreadable kernel tuning cache %s: %s", path, e)
            self._mem[device_name] = table
        return self._mem[device_name]

    def get(self, device_name: str, key: str) -> KernelConfig | None:
        with self._lock:
            return self._load(device_name).get(key)

    def put(self, device_name: str, key: str, cfg: KernelConfig, micros: float) -> None:
        with self._lock:
            table = self._load(device_name)
            table[key] = cfg
            path = self.path(device_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = json.loads(path.read_text()) if path.is_file() else {}
            raw[key] = {"config": dataclasses.asdict(cfg), "us": round(micros, 3)}
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
            tmp.replace(path)


def _tune_l2_env() -> str:
    return os.environ.get("ADBATCH_NM_INT4_TUNE_L2", "warm")


def tune_l2() -> str:
    """``warm`` (default) or ``cold``: the L2 state the tuner times configs in (``ADBATCH_NM_INT4_TUNE_L2``)."""
    mode = _tune_l2_env()
    if mode not in ("cold", "warm"):
        raise ValueError(f"ADBATCH_NM_INT4_TUNE_L2 must be 'cold' or 'warm', got {mode!r}")
    return mode


def tune_key(p: PackedNMInt4, batch: int, dtype: torch.dtype) -> str:
    return (f"{p.pattern.value}|N{p.out_features}|K{p.in_features}|{str(dtype).removeprefix('torch.')}"
            f"|B{batch_bucket(batch)}|L2{tune_l2()}")


def time_graphed_ms(fn, l2: str) -> float:
    """Median ms of ``fn`` with the L2 in state ``l2``, both replayed from CUDA graphs so that no host
    launch cost is timed.

    ``warm`` (default): ``do_bench_cudagraph`` (back-to-back replays, L2 warm).
    ``cold``: :func:`_cold_graph_ms`, an L2 flush before every call. Round 6 on the H200 tuned cold with
    ``do_bench`` (flush, then an eager launch between two events) and picked worse configs than the
    warm tuner at most points (4096x14336 B = 2: 2:4 21.2 -> 37.8 us, dense 31.0 -> 57.9 us; 1:4 B = 1 on
    8192x28672 27.3 -> 35.0 us in graphs vs round 4; round 6 of the kernel runs, in git history): the tuning launch runs
    through the slow Python path, whose host time exceeds the flush and so landed inside the timed
    window, varying by config. ncu showed the kernel durations of cold- and warm-picked configs within
    ~15 % of each other, so warm stays the default.
    """
    fn()  # compile / warm up outside the timing
    try:
        if l2 == "cold":
            return _cold_graph_ms(fn)
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")
    except RuntimeError as e:
        log.debug("graph timing failed (%s); timing with events", e)
        return triton.testing.do_bench(fn, warmup=3, rep=8, return_mode="median")


def _cold_graph_ms(fn, calls: int = 8, replays: int = 7) -> float:
    """Median ms per call of ``fn`` after an L2 flush, without host time: a graph of ``calls`` x (flush
    256 MB, fn) minus a graph of the flushes alone, medians over ``replays`` replays each.
    (Not yet measured on the device: opt-in.)"""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        for with_fn in (False, True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(calls):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.synchronize()

    def median_ms(g) -> float:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return max(median_ms(graphs[1]) - median_ms(graphs[0]), 1e-6) / calls


# The largest relative Frobenius error vs the fp32 reference a tuned config may have. The kernels'
# error is the fp16 rounding of the dequantized weight and of the output (~1.1-1.5e-3 measured on
# K = 1,024-4,096, bench/kernel_accuracy.py; bf16 rounds 8x coarser): 3e-2 leaves room for bf16 and
# long K while any indexing or layout error (O(1)) is caught.
TUNE_MAX_REL_ERROR = 3e-2


def output_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of a kernel output ``y [B, N]`` against the fp32 reference ``ref``
    (NaN and inf count as infinitely wrong)."""
    y = y.float()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return float((y - ref).norm() / ref.norm().clamp(min=1e-30))


# When a list: autotune appends one dict per timed candidate (key, config, microseconds in the tuner's
# L2 state and, for the record, in the other one). Benchmarks set it to report what the tuner saw.


# (x2 [B, K], packed, bias [N] or None, config) -> y [B, N]: one launch through Triton's normal launcher
LaunchFn = Callable[[torch.Tensor, PackedNMInt4, "torch.Tensor | None", KernelConfig], torch.Tensor]


class KernelTuner:
    """The tuned configs of one process: an in-memory table in front of a :class:`TuneCache`, and the
    optional log of timed candidates. ``run`` launches one config (the launcher's ``launch``): the
    tuner times candidates through it without importing the kernels."""

    def __init__(self, run: LaunchFn, cache: TuneCache | None = None) -> None:
        self._run = run
        self.cache = cache if cache is not None else TuneCache()
        # (pattern, N, K, dtype, batch bucket, device, autotune flag, L2 env) -> config: after the first
        # call of a key, a lookup does no env parsing, JSON or string work
        self._fast: dict[tuple, KernelConfig] = {}
        self._log: list[dict] | None = None

    # ---- the tune log (benchmarks) ------------------------------------------------------------
    def start_tune_log(self) -> None:
        """From now on, :meth:`autotune` records one dict per timed candidate: ``key``, ``config``
        (as a dict), and microseconds in the tuner's L2 state and, for the record, in the other one
        (``warm_us`` / ``cold_us``)."""
        self._log = []

    def tune_log(self) -> list[dict]:
        """The candidates timed since :meth:`start_tune_log` (empty when it was not called)."""
        return list(self._log or ())

    # ---- lookups --------------------------------------------------------------------------------
    def lookup(self, p: PackedNMInt4, batch: int, dtype: torch.dtype, device: torch.device) -> KernelConfig | None:
        """The config tuned for this layer shape, batch bucket and dtype in the tuning cache of
        ``device`` (CUDA), or None: nothing is timed. A non-CUDA device has no tuned configs."""
        if device.type != "cuda":
            return None
        return self.cache.get(cuda_device_name(device), tune_key(p, batch, dtype))

    def select(self, x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> KernelConfig:
        """Cached tuned config, tuning on a miss (CUDA, ``ADBATCH_NM_INT4_AUTOTUNE`` != 0), else heuristic.
        x2: [B, K] fp16/bf16 activations (the candidates are timed on them), bias [N] or None."""
        fast_key = (p.pattern, p.out_features, p.in_features, x2.dtype, batch_bucket(x2.shape[0]), x2.device,
                    os.environ.get("ADBATCH_NM_INT4_AUTOTUNE", "1"), _tune_l2_env())
        cfg = self._fast.get(fast_key)
        if cfg is None:
            cfg = self._select_slow(x2, p, bias)
            self._fast[fast_key] = cfg
        return cfg

    def _select_slow(self, x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> KernelConfig:
        batch = x2.shape[0]
        if not x2.is_cuda or os.environ.get("ADBATCH_NM_INT4_AUTOTUNE", "1") == "0":
            return heuristic_config(p, batch, _num_sms(x2.device))
        dev = cuda_device_name(x2.device)
        key = tune_key(p, batch, x2.dtype)
        cfg = self.cache.get(dev, key)
        if cfg is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"kernel config for {key} not tuned yet: run once before CUDA-graph capture")
            cfg, micros = self.autotune(x2, p, bias)
            log.info("tuned %s on %s: %s (%.2f us)", key, dev, cfg, micros)
            self.cache.put(dev, key, cfg, micros)
        return cfg

    def autotune(self, x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> tuple[KernelConfig, float]:
        """Time every candidate on these inputs and return the fastest (config, microseconds) among those
        whose output matches the fp32 reference (:func:`output_error` at most :data:`TUNE_MAX_REL_ERROR`): a config that computes a wrong
        answer fast is never cached."""
        num_sms = _num_sms(x2.device)
        l2 = tune_l2()
        ref = nm_int4_linear_reference(x2, p, bias).float()
        best: tuple[float, KernelConfig] | None = None
        for cfg in candidate_configs(p, x2.shape[0], num_sms):
            try:
                err = output_error(self._run(x2, p, bias, cfg), ref)
                if not err <= TUNE_MAX_REL_ERROR:
                    log.warning("kernel config %s rejected for %s: relative error %.3g vs the fp32 reference",
                                cfg, tune_key(p, x2.shape[0], x2.dtype), err)
                    continue
                ms = time_graphed_ms(lambda: self._run(x2, p, bias, cfg), l2)
                if self._log is not None:
                    other = "cold" if l2 == "warm" else "warm"
                    self._log.append(dict(key=tune_key(p, x2.shape[0], x2.dtype), config=dataclasses.asdict(cfg),
                                          **{f"{l2}_us": ms * 1e3, f"{other}_us": time_graphed_ms(lambda: self._run(x2, p, bias, cfg), other) * 1e3}))
            except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:  # type: ignore[attr-defined]
                log.debug("config %s rejected: %s", cfg, e)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is None:
            raise RuntimeError(f"no kernel config compiled for {tune_key(p, x2.shape[0], x2.dtype)}")
        return best[1], best[0] * 1e3
