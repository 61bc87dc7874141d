"""Launcher of the SparseGemv kernels: ``y[B, N] = x[B, K] @ W.T`` with W in
:class:`~kernels.nm_int4.PackedNMInt4`, through the GEMV (:mod:`kernels.gemv_int4`, B <= 8) or the
tensor-core kernel (:mod:`kernels.tc_int4`, B >= 8).

:func:`nm_int4_linear_triton` is the entry point. The first call for a (layer, dtype, batch bucket,
bias) binds a launcher: it picks a :class:`~kernels.int4_tuner.KernelConfig` through :data:`TUNER` (timed
once per shape and bucket, cached as JSON; see :mod:`kernels.int4_tuner`), compiles, and keeps the
compiled kernel and every argument that does not change between calls (weight pointers as ints, grid,
scratch). Later calls do one dict lookup, a few shape checks, ``torch.empty`` for the output and the raw
launch (no Triton argument binding, specialization or pointer checks). The positions that launch
rewrites per call (activations, output, batch, row stride, partial-tile stride) come from each kernel's
own signature (``arg_names``), read once at import.

:func:`compile_offline` compiles one variant for ``sm_<arch>`` without a GPU (CI's PTX check,
``bench/kernel_sass.py``). The layer-level call (reference on CPU, this module on CUDA, a
``torch.library`` op for ``torch.compile``) is :func:`kernels.packed_linear.nm_int4_linear`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import weakref

import torch
import triton

from kernels.gemv_int4 import _nm_int4_gemv_kernel
from kernels.int4_tuner import BATCH_BUCKETS, BUCKET_OF, KernelConfig, KernelTuner, batch_bucket, gemv_ok
from kernels.nm_int4 import PackedNMInt4, SparsityPattern
from kernels.tc_int4 import _nm_int4_tc_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} not supported by the Triton kernel; expected float16 or bfloat16")
    if x.dim() < 1 or x.shape[-1] != p.in_features:
        raise ValueError(f"x: expected [..., {p.in_features}] (in_features), got {tuple(x.shape)}")
    if x.device != p.device:
        raise ValueError(f"x is on {x.device} but the packed weight is on {p.device}")
    if not (x.is_cuda or _interpreting()):
        raise ValueError("nm_int4_linear_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if bias is not None and (bias.shape != (p.out_features,) or bias.device != x.device):
        raise ValueError(f"bias: expected [{p.out_features}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    if p.padded_kept % 32 or p.out_features >= 2**31 // max(1, p.padded_kept // 8):
        raise ValueError(f"packed weight of shape {p.out_features}x{p.in_features} exceeds the int32 indexing of the kernel")


class _Scratch:
    """Per-device split-K scratch: fp32 partial tiles and int32 per-tile counters (zero between launches).
    Grow-only; replaced buffers stay referenced by the launchers bound to them (CUDA graphs captured with
    them stay valid)."""

    def __init__(self) -> None:
        self._buf: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, cnt = self._buf.get(device, (None, None))
        if part is None or part.numel() < part_elems or cnt.numel() < tiles:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-K scratch must grow, which is not allowed during CUDA-graph capture: run once before capturing")
            n_part = max(part_elems, 0 if part is None else part.numel(), 1 << 20)
            n_cnt = max(tiles, 0 if cnt is None else cnt.numel(), 1 << 14)
            part = torch.empty(n_part, dtype=torch.float32, device=device)
            cnt = torch.zeros(n_cnt, dtype=torch.int32, device=device)
            self._buf[device] = (part, cnt)
        return part, cnt


_SCRATCH = _Scratch()


@dataclasses.dataclass
class _Plan:
    """Per-call launch geometry of a config on a layer (everything but the activations)."""

    grid0: int
    n_split: int
    kk_per_split: int

    @staticmethod
    def of(p: PackedNMInt4, cfg: KernelConfig) -> "_Plan":
        steps = triton.cdiv(p.padded_kept, cfg.block_kk)
        split = max(1, min(cfg.split_k, steps))
        kk_per_split = triton.cdiv(steps, split) * cfg.block_kk
        return _Plan(triton.cdiv(p.out_features, cfg.block_n), triton.cdiv(p.padded_kept, kk_per_split), kk_per_split)


def _x_words(x2: torch.Tensor) -> torch.Tensor:
    """x2 [B, K] viewed as int64 [B, K/4] (4 activations per word) for the GEMV kernel."""
    if x2.stride(0) % 4 or x2.data_ptr() % 8 or x2.shape[1] % 4:
        raise ValueError("x: rows must start on 8-byte boundaries (the launcher copies misaligned inputs)")
    return x2.view(torch.int64)


@dataclasses.dataclass(frozen=True)
class _Signature:
    """A kernel's argument names in order (runtime arguments first, then the constexprs) and the
    positions of the runtime arguments the bound fast path rewrites per call. Read from the kernel
    itself, so renaming or reordering a kernel argument cannot leave the launcher writing a stale slot."""

    names: tuple[str, ...]
    runtime: int  # the first ``runtime`` names are runtime arguments, the rest constexprs
    i_x: int  # activations pointer
    i_out: int
    i_b: int  # batch rows
    i_stride: int  # activation row stride (int64 words for the GEMV)
    i_part_stride: int  # split-K partial-tile stride (B * N)

    @staticmethod
    def of(fn, x: str, stride: str) -> "_Signature":
        names = tuple(fn.arg_names)
        params = inspect.signature(fn.fn).parameters
        is_const = ["constexpr" in str(params[n].annotation) for n in names]
        runtime = is_const.index(True) if True in is_const else len(names)
        if any(not c for c in is_const[runtime:]):
            raise TypeError(f"{fn.__name__}: the launcher passes constexprs after every runtime argument: {names}")
        idx = {n: i for i, n in enumerate(names[:runtime])}
        return _Signature(names, runtime, idx[x], idx["out_ptr"], idx["B"], idx[stride], idx["part_stride"])


_GEMV_SIG = _Signature.of(_nm_int4_gemv_kernel, x="x64_ptr", stride="stride_x64")
_TC_SIG = _Signature.of(_nm_int4_tc_kernel, x="x_ptr", stride="stride_xb")


def _kernel_fn(cfg: KernelConfig):
    return _nm_int4_tc_kernel if cfg.use_dot else _nm_int4_gemv_kernel


def _signature(cfg: KernelConfig) -> _Signature:
    return _TC_SIG if cfg.use_dot else _GEMV_SIG


def _kernel_args(x2: torch.Tensor, p: PackedNMInt4, bias, out, part, cnt, cfg: KernelConfig, plan: _Plan) -> tuple[list, dict]:
    """Runtime arguments of one launch (by name, in the order of the kernel's signature) and its constexprs."""
    batch = x2.shape[0]
    n_out = p.out_features
    sig = _signature(cfg)
    # the GEMV reads x as int64 words of 4 activations: its K and row stride count words
    xk = x2 if cfg.use_dot else _x_words(x2)
    x_name, k_name = sig.names[sig.i_x], ("K" if cfg.use_dot else "G4")
    vals = {x_name: xk, "qw_ptr": p.qweight, "qp_ptr": p.qpos if p.pattern.is_sparse else p.qweight,
            "sz_ptr": p.scale_zero_words, "gptr_ptr": p.group_ptr, "gshift_ptr": p.group_shift,
            "bias_ptr": bias if bias is not None else out, "out_ptr": out, "part_ptr": part, "cnt_ptr": cnt, "B": batch,
            "N": n_out, k_name: p.in_features if cfg.use_dot else p.in_features // 4, "KP": p.padded_kept,
            sig.names[sig.i_stride]: xk.stride(0), "stride_ob": out.stride(0), "kk_per_split": plan.kk_per_split,
            "n_split": plan.n_split, "part_stride": batch * n_out}
    args = [vals[n] for n in sig.names[: sig.runtime]]
    even = n_out % cfg.block_n == 0 and p.padded_kept % cfg.block_kk == 0 and p.kept == p.padded_kept
    meta = _kernel_meta(cfg, p.pattern, plan.n_split > 1, bias is not None, x2.dtype == torch.bfloat16,
                        asm=not _interpreting(), even=even)
    return args, meta


def _kernel_meta(cfg: KernelConfig, pattern: SparsityPattern, split: bool, has_bias: bool, bf16: bool, asm: bool,
                 even: bool) -> dict:
    """The constexprs of one kernel variant (a launch and :func:`compile_offline` build them here)."""
    meta = dict(NKEEP=pattern.n, BLOCK_B=cfg.block_b, BLOCK_N=cfg.block_n, BLOCK_KK=cfg.block_kk, SPLIT=split,
                HAS_BIAS=has_bias, IS_BF16=bf16, ASM=asm)
    if cfg.use_dot:
        meta["DOT_F32"] = not asm and bf16  # interpreter only: numpy has no bf16 matmul
    if not cfg.use_dot:  # the tensor-core kernel has no mask-free variant
        meta["EVEN"] = even
    return meta


def compile_offline(cfg: KernelConfig, pattern: SparsityPattern, bf16: bool = False, split: bool = False,
                    arch: int = 90):
    """Compile one kernel variant for NVIDIA ``sm_<arch>`` without a GPU and return Triton's compiled
    kernel (``.asm`` holds ``ptx`` and ``cubin``).

    The inline PTX of both kernels only runs on a GPU (the interpreter runs its emulation), so CI
    assembles every variant through Triton's bundled ``ptxas`` this way; ``bench/kernel_sass.py`` reads
    the SASS of the result. Pointers are typed as the launcher passes them (activations fp16/bf16,
    packed words int32, partials fp32) and marked 16-byte aligned, like the large shapes the launcher
    specializes for. Needs ``TRITON_INTERPRET`` unset when this module was imported.
    """
    from triton.backends.compiler import GPUTarget

    cfg.validate(pattern)
    fn = _kernel_fn(cfg)
    if not isinstance(fn, triton.runtime.jit.JITFunction) or _interpreting():
        raise RuntimeError("compile_offline needs TRITON_INTERPRET unset when kernels.int4_launch is imported")
    meta = _kernel_meta(cfg, pattern, split, has_bias=False, bf16=bf16, asm=True, even=True)
    act = "*bf16" if bf16 else "*fp16"
    ptr_types = {"x_ptr": act, "x64_ptr": "*i64", "bias_ptr": act, "out_ptr": act, "part_ptr": "*fp32"}
    aligned_ints = {"N", "K", "KP", "G4", "stride_xb", "stride_x64", "stride_ob", "kk_per_split"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in aligned_ints:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, sig, meta, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 128),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def launch(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None, cfg: KernelConfig, _return_kernel: bool = False):
    """Run the kernel once with ``cfg`` through Triton's normal launcher (validated by the caller).
    x2: [B, K] fp16/bf16 with unit inner stride (8-byte aligned rows for the GEMV kernel). Returns [B, N]
    (and the compiled kernel when asked)."""
    batch = x2.shape[0]
    plan = _Plan.of(p, cfg)
    out = torch.empty(batch, p.out_features, device=x2.device, dtype=x2.dtype)
    part, cnt = _SCRATCH.get(x2.device, plan.n_split * batch * p.out_features if plan.n_split > 1 else 1,
                             plan.grid0 * triton.cdiv(batch, cfg.block_b))
    args, meta = _kernel_args(x2, p, bias, out, part, cnt, cfg, plan)
    grid = (plan.grid0, plan.n_split, triton.cdiv(batch, cfg.block_b))
    fn = _kernel_fn(cfg)
    kernel = fn[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (out, kernel) if _return_kernel else out


def _launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler such as proton) is registered: then the normal launcher runs,
    which calls it. Triton 3.4+ keeps the hooks in a ``HookChain`` that is never None, so an empty
    chain counts as none (testing ``is not None`` made the bound fast path dead code: the H200 host
    probe measured 80-134 us per eager call through the normal launcher instead). Runs on every
    bound call, so it reads the module attribute rather than importing."""
    hook = triton.knobs.runtime.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


class _Bound:
    """A layer's launcher for one (dtype, batch bucket, bias) after its first call: the compiled kernel per
    activation specialization, and the argument list with everything fixed filled in (ints, not
    tensors, so the raw launcher skips its pointer checks). ``__call__`` returns None whenever the fast
    path does not apply; the caller then takes the normal path."""

    def __init__(self, p: PackedNMInt4, x2: torch.Tensor, bias, cfg: KernelConfig, kernel, spec, bucket: int) -> None:
        self.ref = weakref.ref(p)
        self.cfg = cfg
        self.plan = _Plan.of(p, cfg)
        self.dev = x2.get_device()
        self.device = x2.device
        self.n_out = p.out_features
        self.gemv = not cfg.use_dot
        self.kernels = {spec: kernel}
        rows = max(bucket, x2.shape[0])
        self.part, self.cnt = _SCRATCH.get(x2.device, self.plan.n_split * rows * self.n_out if self.plan.n_split > 1 else 1,
                                           self.plan.grid0 * triton.cdiv(rows, cfg.block_b))
        self.max_rows = rows
        self.bias = bias  # keeps the tensor alive while its pointer is baked in
        dummy_out = torch.empty(1, self.n_out, dtype=x2.dtype, device=x2.device)
        args, meta = _kernel_args(x2[:1], p, bias, dummy_out, self.part, self.cnt, cfg, self.plan)
        sig = _signature(cfg)
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args] + [meta[n] for n in sig.names[len(args):]]  # all constexprs are passed explicitly
        self.args = args
        self.i_x, self.i_out, self.i_b, self.i_stride, self.i_part_stride = (
            sig.i_x, sig.i_out, sig.i_b, sig.i_stride, sig.i_part_stride)
        self.has_bias = bias is not None
        self.keep = (p.qweight, p.qpos, p.scale_zero_words, p.group_ptr, p.group_shift)

    def __call__(self, x2: torch.Tensor, bias):
        if _launch_hooks_set() or x2.get_device() != self.dev or x2.stride(-1) != 1:
            return None
        if (bias is not None) != self.has_bias or (bias is not None and bias is not self.bias):
            return None
        batch = x2.shape[0]
        if batch > self.max_rows:
            return None
        xp = x2.data_ptr()
        stride = x2.stride(0)
        if self.gemv:
            if xp % 8 or stride % 4:
                return None
            stride //= 4
        kernel = self.kernels.get((xp % 16 == 0, stride % 16 == 0, stride == 1))
        if kernel is None:
            return None
        out = torch.empty(batch, self.n_out, dtype=x2.dtype, device=self.device)
        args = self.args.copy()
        args[self.i_x] = xp
        args[self.i_out] = out.data_ptr()
        args[self.i_b] = batch
        args[self.i_stride] = stride
        args[self.i_part_stride] = batch * self.n_out
        kernel.run(self.plan.grid0, self.plan.n_split, triton.cdiv(batch, self.cfg.block_b),
                   torch._C._cuda_getCurrentRawStream(self.dev), kernel.function, kernel.packed_metadata, None, None, None, *args)
        return out


def _spec_of(x2: torch.Tensor, gemv: bool) -> tuple:
    stride = x2.stride(0) // 4 if gemv else x2.stride(0)
    return (x2.data_ptr() % 16 == 0, stride % 16 == 0, stride == 1)


# (id(packed), dtype, bucket, has_bias) -> _Bound; entries drop when the packed weight is collected
_BOUND: dict[tuple, _Bound] = {}


def _bind(key: tuple, p: PackedNMInt4, x2: torch.Tensor, bias, cfg: KernelConfig, kernel) -> None:
    spec = _spec_of(x2, not cfg.use_dot)
    bound = _BOUND.get(key)
    if bound is not None and bound.ref() is p and bound.cfg == cfg:
        bound.kernels.setdefault(spec, kernel)
        return
    if torch.cuda.is_current_stream_capturing():
        return  # binding allocates scratch; the next eager call binds
    _BOUND[key] = _Bound(p, x2, bias, cfg, kernel, spec, key[2])
    weakref.finalize(p, _BOUND.pop, key, None)


# the process's tuner: configs are timed through this module's normal launch path
TUNER = KernelTuner(run=launch)


def takes_fast_path(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`nm_int4_linear_triton` (x [..., K], no forced config) runs this call through the
    bound launcher; when it does, the kernel runs once (for benchmarks: host-cost probes)."""
    x2 = x.reshape(-1, p.in_features)
    batch = x2.shape[0]
    if not 0 < batch <= BATCH_BUCKETS[-1]:
        return False
    bound = _BOUND.get((id(p), x.dtype, BUCKET_OF[batch], bias is not None))
    return bound is not None and bound.ref() is p and bound(x2, bias) is not None


def nm_int4_linear_triton(
    x: torch.Tensor,
    p: PackedNMInt4,
    bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``x @ dequantize(p).T + bias`` with the Triton kernel.

    Args:
        x: fp16/bf16 [..., K] on CUDA (CPU tensors only under ``TRITON_INTERPRET=1``). Any number of
            rows works; batch sizes 1..64 are tuned, larger ones run the 64-row tile repeatedly.
        p: packed weight on x's device. bias: [N] or None.
        config: force a :class:`KernelConfig` (tests, benchmarks); default: tuned/cached.
    Returns: [..., N] in x's dtype.
    """
    k_in = p.in_features
    if config is None and x.dim() >= 1 and x.shape[-1] == k_in:
        # hot path: one dict lookup; the bound launcher re-checks what can change between calls
        x2 = x.reshape(-1, k_in)
        batch = x2.shape[0]
        if 0 < batch <= BATCH_BUCKETS[-1]:
            bound = _BOUND.get((id(p), x.dtype, BUCKET_OF[batch], bias is not None))
            if bound is not None and bound.ref() is p:
                out = bound(x2, bias)
                if out is not None:
                    return out.view(*x.shape[:-1], p.out_features)
    _check_inputs(x, p, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_in)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, p.out_features)
    if config is not None:
        config.validate(p.pattern)
        if not config.use_dot and not gemv_ok(p):
            raise ValueError(f"the GEMV path needs in_features % 4 == 0, got {k_in}: use a tl.dot config")
    cfg = config if config is not None else TUNER.select(x2, p, bias)
    if x2.stride(-1) != 1 or (not cfg.use_dot and (x2.stride(0) % 4 or x2.data_ptr() % 8)):
        # unit inner stride; for the GEMV kernel 8-byte aligned rows (it reads x as int64 words)
        x2 = x2.clone(memory_format=torch.contiguous_format)
    out, kernel = launch(x2, p, bias, cfg, _return_kernel=True)
    if config is None and x2.is_cuda and not _interpreting() and x2.shape[0] <= BATCH_BUCKETS[-1]:
        _bind((id(p), x.dtype, batch_bucket(x2.shape[0]), bias is not None), p, x2, bias, cfg, kernel)
    return out.reshape(*lead, p.out_features)
