"""The decoding engine: a static KV cache with a shared prompt prefix, and the decoder forward over it.

Layout (one engine per model, buffers grown on demand and reused across batches):

- **Prompt region**, per layer ``Kp, Vp: [Qmax, kv_heads, Lp, head_dim]``: one row per *query*,
  computed once by :meth:`DecodeEngine.prefill` (prompts left-padded to ``Lp``). Every beam (or
  sample) of a query reads its query's row: the prompt's KV is never duplicated per beam.
- **Suffix region**, ``Ks, Vs: [layers, S, Qmax * B, kv_heads, head_dim]``: step ``t`` writes the
  K/V of slot ``q * B + b``'s token at ``[t, slot]`` (all live rows of a batch are at the same depth,
  so ``t`` is one scalar) and nothing is ever moved. An *ancestry table* ``anc Int32[Qmax * B, S]``
  names, per row and position, the slot holding its path's K/V there: beam reordering is
  ``anc = anc[parent]`` on this small integer table, not a copy of the cache. (Measured on the H200:
  gathering the suffix rows themselves each step cost ~5 of 13 ms at 2,560 rows.)

The decode step (:meth:`DecodeEngine.step`) feeds one token per slot row: the ancestry gather by
parent row, embeddings, per layer norm -> q/k/v -> rotary -> write K/V at ``t`` -> attention over
(shared prompt row of the query) + (own path ``[0, t]`` through ``anc``; on CUDA the Triton kernel
:func:`kernels.decode_attention.decode_attention`) -> o_proj -> MLP, then the final norm, the LM head
and the full-vocabulary log-normalizer. On CUDA each step shape ``(queries bucket Qb, Lp)`` is
captured once as a CUDA graph and replayed for every ``t`` (``t`` is read on the device): a forward of
the 30-layer default model is a few hundred small kernels, and eager launches cost more than the math
at beam-search row counts.

The forward reuses the HF modules' weights and submodules (norms, projections, MLP, rotary): dense
``nn.Linear`` or :class:`adbatch.compress.CompressedLinear` alike. Which copy serves a linear (dense q/k/v and
gate/up concatenated into one GEMM; per row bucket, for a compressed layer, the packed kernel or a bf16 / 2:4
bf16 / FP8 / 2:4 FP8 copy, by measurement and an accuracy gate) is a plan of its own,
:class:`adbatch.decoding.linear_plan.LinearPlanner` (``engine.linears``; its measurements ``engine.plan``):
the engine asks it to route each pass's bucket before the pass runs, and runs every projection through it.
:meth:`DecodeEngine.warm_up` (:func:`warm_up_search`) routes the buckets a run will use before its work: the plan
is saved per device, so only a device's first run times it, and no run builds copies inside its work.

Supported decoder families: Llama (SmolLM2), Mistral, Qwen2, Qwen3 (q/k norms), Gemma 3 (q/k norms,
sandwich norms, sliding-window layers, scaled embeddings). Others are refused with a clear error.

Why one module of ~850 lines: :class:`DecodeEngine` is one object over one set of preallocated
buffers; prefill, step, tree pass and graph capture all index the same tensors and the same
captured-graph table, so splitting it would spread one state across files. The per-bucket linear plan
indexes the model's linear modules instead, and lives in :mod:`adbatch.decoding.linear_plan`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from adbatch.decoding.config import LinearFormats, TargetSearchConfig, VerifyMode
# the plan's names stay importable from here (bench scripts and callers named them when they lived here)
from adbatch.decoding.linear_plan import (_MODEL_COPIES, DEFAULT_LINEAR_FORMATS, FP8_CHOICES,  # noqa: F401
                                          LinearChoice, LinearPlan, LinearPlanner, semi_structured_copy)
from adbatch.models import eval_mode, submodules
from kernels import fused_ops as fo
from kernels.decode_attention import (RowGather, decode_attention, decode_attention_reference,
                                      decode_attention_rows, gather_suffix, row_gather)

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
PROMPT_BUCKET = 16     # prompt widths are rounded up to a multiple of this (graph keys)
SUFFIX_BUCKET = 8      # suffix capacity is rounded up to a multiple of this
LSE_CHUNK = 1024       # rows per float32 log-sum-exp chunk (bounds the [chunk, vocab] temporary)


def bucket_queries(n: int) -> int:
    """Query-count bucket: the next power of two (graph keys; few shapes, at most 2x padding)."""
    return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_token_id(model: Any) -> int:
    """The id padding rows feed: the model config's ``pad_token_id``, 0 where it has none."""
    pad = getattr(model.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: Any) -> torch.dtype:
    """Dtype of the activations (the input embeddings' dtype; compressed linears keep it too)."""
    w = getattr(model.get_input_embeddings(), "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def decoder_of(model: Any) -> Any:
    """The transformer body of a causal LM (without its LM head)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, "model", None)
    if dec is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder body (get_decoder/model)")
    return dec


def check_supported(model: Any) -> None:
    """Refuse models the engine's forward does not reproduce exactly."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} uses final_logit_softcapping; adbatch decoding "
                         "computes log-probs as log_softmax(lm_head(hidden)) and does not support it")
    if cfg is not None and getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} uses attn_logit_softcapping, which the decoding "
                         "engine does not implement")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"decoder family {mtype!r} ({type(model).__name__}) is not supported by the "
                         f"decoding engine; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


class _Ops:
    """The step's row-wise pieces: the Triton kernels of :mod:`kernels.fused_ops` on CUDA (one
    launch each, graph-safe, no TorchInductor compilation in a process's first batch) or the torch
    ops they reproduce (CPU, tests)."""

    def __init__(self, fused: bool) -> None:
        self.fused = fused
        self.add_rms_norm = fo.add_rms_norm if fused else fo.add_rms_norm_reference
        self.add_rms_norm_fp8 = fo.add_rms_norm_fp8 if fused else fo.add_rms_norm_fp8_reference
        self.gated_act = fo.gated_act if fused else fo.gated_act_reference
        self.rows_lse = fo.row_logsumexp if fused else fo.row_logsumexp_reference

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        if self.fused and x.stride(-1) == 1 and fo.rows_view_ok(x):
            return fo.add_rms_norm(x, None, weight, eps, unit_offset)[1]
        return fo.rms_norm_reference(x, weight, eps, unit_offset)


# ------------------------------------------------------------------------------------------ engine
@dataclass
class _Graph:
    graph: Any
    logits: torch.Tensor | None
    lse: torch.Tensor | None
    inputs: dict[str, torch.Tensor] | None = None  # a tree pass's static inputs (steps use the engine's)
    outputs: tuple[torch.Tensor, ...] = ()         # run_captured's outputs


class DecodeEngine:
    """Static-cache decoding over one HF causal LM (see the module docstring).

    Public tensors: ``prompt_len Long[Qmax]`` (real prompt tokens per query row), ``prompt_bias
    Float32[Qmax, Lp]`` (0 on real prompt keys, -inf on left padding). ``step`` returns ``logits
    [R, V]`` in the head's dtype and ``lse Float32[R]`` with ``log_softmax = logits - lse``.
    """

    def __init__(self, model: Any, fused: bool | None = None, formats: LinearFormats | None = None) -> None:
        check_supported(model)
        # no reference to the model itself: _ENGINES keys engines by it weakly, and an engine holding it would keep
        # a deleted model -- its weights, cache and captured graphs -- alive for the life of the process
        self.cfg = model.config
        self.dec = decoder_of(model)
        self.layers = list(self.dec.layers)[: self.cfg.num_hidden_layers]
        self.head = model.get_output_embeddings()
        self.device = model_device(model)
        self.dtype = model_dtype(model)
        attn0 = self.layers[0].self_attn
        self.n_heads = int(self.cfg.num_attention_heads)
        self.n_kv = int(getattr(self.cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or self.cfg.hidden_size // self.n_heads)
        self.scaling = [float(getattr(l.self_attn, "scaling", self.head_dim ** -0.5)) for l in self.layers]
        self.gemma = hasattr(self.layers[0], "pre_feedforward_layernorm")
        types = getattr(self.cfg, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.layer_types = list(types)[: len(self.layers)]
        window = getattr(self.cfg, "sliding_window", None)
        self.window = [int(window) if (window and t == "sliding_attention") else 0 for t in self.layer_types]
        if getattr(self.cfg, "model_type", "") == "mistral" and window:
            self.window = [int(window)] * len(self.layers)  # Mistral: every layer slides
        self.vocab = int(getattr(self.head, "out_features", 0) or self.cfg.vocab_size)
        #: which copy serves each linear (a compressed one: per row bucket, measured); the copies are shared by the
        #: model's engines of other linear_formats
        self.linears = LinearPlanner(model, self._groups(), formats, self.device, self.dtype)
        self.formats: LinearFormats = self.linears.formats
        self.plan: LinearPlan = self.linears.plan
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._tree_pool = None
        self._host_pool = None  # graphs of the search's own per-step tensor work (run_captured)
        self._prefill_pool = None
        self._seen_keys: dict[tuple, int] = {}
        self._eager_keys: set[tuple] = set()  # tree shapes / captured keys whose capture failed
        self.graphs_enabled = self.device.type == "cuda"
        self.ops = _Ops(self.device.type == "cuda" if fused is None else fused)
        # rotary + K/V cache write as one kernel needs the projections' raw outputs: models with
        # q/k norms (Qwen3, Gemma 3) norm them first and take the unfused path
        self.store_fused = self.ops.fused and not hasattr(attn0, "q_norm") and not self.head_dim & (self.head_dim - 1)
        act = str(getattr(self.cfg, "hidden_act", None) or getattr(self.cfg, "hidden_activation", "silu"))
        self.act = act if act in ("silu", "gelu_pytorch_tanh") else None  # None: the module's own act_fn
        #: ``(x, (q, s))``: the rows the last norm wrote and, where one FP8 copy reads them, their FP8 quantization
        #: from the same kernel (:meth:`_add_norm`); :meth:`_projections` hands it to that copy for that ``x`` only
        self._x_fp8: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.capture_seconds = 0.0
        self.signature: tuple = ()
        self.inference_tensors = False  # built under torch.inference_mode (engine_for sets it)
        # buffers (allocated by reserve)
        self.Qmax = self.Lp = self.S = self.B = 0
        self.kp: list[torch.Tensor] = []
        self.vp: list[torch.Tensor] = []
        self.ks: torch.Tensor | None = None  # [layers, S, Qmax * B, kv, D]
        self.vs: torch.Tensor | None = None
        self.anc: torch.Tensor | None = None  # Int32[Qmax * B, S]
        self.prompt_len = self.prompt_bias = self.prompt_pos = None
        self.in_tokens = self.in_parent = self.in_t = self.in_prompt = None

    def force_format(self, choice: LinearChoice | None) -> None:
        """Serve every compressed layer as ``choice`` at every bucket from now on, without timing (an
        accuracy measurement of one format; ``SPARSE_FP8`` / ``SPARSE`` fall back to ``FP8`` / ``DENSE`` on
        dense-pattern layers), or the measured plan again (None). Drops the captured graphs: they hold the
        old routing."""
        self.linears.force(choice)
        self._graphs.clear()
        self._pool = self._tree_pool = self._host_pool = self._prefill_pool = None
        self._seen_keys = {}
        self._eager_keys = set()

    def plan_keys(self, rows: int) -> list[tuple]:
        """The :attr:`plan` keys ``(N, K, pattern, rows)`` a pass at ``rows`` rows routes by."""
        return self.linears.keys(rows)

    def pass_buckets(self, queries: int, beams: int, prompt_tokens: int, tree_tokens: int = 0) -> list[int]:
        """The row buckets (ascending) at which graph-captured passes route the linears (see :meth:`prefill`,
        :meth:`step`, :meth:`tree_forward`) in batches of up to ``queries`` queries: prefills of prompts of up to
        ``prompt_tokens`` tokens (``bucket_queries(Qb * Lw)``), steps of ``beams`` slots per query (``Qb * beams``, at
        every query bucket ``Qb``: finished queries are compacted away) and tree passes of up to ``tree_tokens``
        padded tokens (0: none; ``bucket_queries(Vb * F)``, ``F >= 4``, ``Vb < 2 V``: a power of two from 4 to
        ``bucket_queries(2 * tree_tokens)``)."""
        query_buckets = [1 << i for i in range(bucket_queries(queries).bit_length())]
        widths = range(PROMPT_BUCKET, _round_up(max(prompt_tokens, 1), PROMPT_BUCKET) + 1, PROMPT_BUCKET)
        buckets = {q * beams for q in query_buckets} | {bucket_queries(q * w) for q in query_buckets for w in widths}
        if tree_tokens:
            buckets |= {1 << i for i in range(2, bucket_queries(2 * tree_tokens).bit_length())}
        return sorted(buckets)

    @torch.no_grad()
    def warm_up(self, queries: int, beams: int, prompt_tokens: int, tree_tokens: int = 0) -> list[int]:
        """Before the work, plan and build the compressed layers' copies at every bucket of :meth:`pass_buckets`
        (same arguments), so that no pass of the work times the plan's candidates (seconds per bucket on a device
        without a saved plan) or builds a copy. Returns the buckets routed: none for a dense model, or where passes
        run eagerly (CPU: they route nothing). Each shape's graph is still captured at its first pass."""
        if not self.linears.units or not self.graphs_enabled:
            return []
        buckets = self.pass_buckets(queries, beams, prompt_tokens, tree_tokens)
        t0 = time.perf_counter()
        self.linears.warm(buckets)
        log.info("linear plan warmed at %d row buckets (%d to %d) in %.1f s", len(buckets), buckets[0], buckets[-1],
                 time.perf_counter() - t0)
        return buckets

    # -------------------------------------------------------------- buffers
    def reserve(self, queries: int, beams: int, prompt_width: int, suffix: int) -> None:
        """Make room for ``queries`` query rows of ``beams`` slots, prompts of ``prompt_width``
        tokens and ``suffix`` generated tokens. Reallocating drops the captured graphs (they
        point at the old buffers)."""
        Q = bucket_queries(queries)
        Lp = _round_up(max(prompt_width, 1), PROMPT_BUCKET)
        S = _round_up(max(suffix, 1), SUFFIX_BUCKET)
        if beams == self.B:
            if Q <= self.Qmax and Lp <= self.Lp and S <= self.S:
                return
            # grow to cover both: shapes seen before keep fitting (fewer reallocations / captures)
            Q, Lp, S = max(Q, self.Qmax), max(Lp, self.Lp), max(S, self.S)
        self._graphs.clear()
        self._pool = self._tree_pool = self._host_pool = self._prefill_pool = None
        self._seen_keys = {}
        self.kp = self.vp = []
        self.ks = self.vs = self.anc = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        L, kv, D, dev, dt = len(self.layers), self.n_kv, self.head_dim, self.device, self.dtype
        # zeros, not empty: padded query rows and dead slots are computed too; their keys must be
        # finite so the rows stay finite (they are masked out of every result)
        self.kp = [torch.zeros(Q, kv, Lp, D, device=dev, dtype=dt) for _ in range(L)]
        self.vp = [torch.zeros(Q, kv, Lp, D, device=dev, dtype=dt) for _ in range(L)]
        self.ks = torch.zeros(L, S, Q * beams, kv, D, device=dev, dtype=dt)
        self.vs = torch.zeros(L, S, Q * beams, kv, D, device=dev, dtype=dt)
        self.anc = torch.arange(Q * beams, dtype=torch.int32, device=dev)[:, None].repeat(1, S)
        self.slot_ids = torch.arange(Q * beams, dtype=torch.int32, device=dev)
        self.prompt_len = torch.ones(Q, dtype=torch.long, device=dev)
        self.prompt_pos = torch.zeros(Q, Lp, dtype=torch.long, device=dev)
        self.prompt_bias = torch.zeros(Q, Lp, dtype=torch.float32, device=dev)
        self.in_tokens = torch.zeros(Q * beams, dtype=torch.long, device=dev)
        self.in_parent = torch.arange(Q * beams, dtype=torch.long, device=dev)
        self.in_t = torch.zeros(1, dtype=torch.long, device=dev)
        self.in_prompt = torch.full((Q, Lp), -1, dtype=torch.long, device=dev)  # prefill's ids, -1 = padding
        self.Qmax, self.Lp, self.S, self.B = Q, Lp, S, beams

    def bucket(self, queries: int) -> int:
        """Query rows a step runs at: a power of two where steps are graph-captured (few shapes),
        the exact count in eager mode (CPU), where padding rows would only cost compute."""
        return bucket_queries(queries) if self.graphs_enabled else max(queries, 1)

    def memory_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.kp + self.vp)
        if self.ks is not None:
            n += 2 * self.ks.numel() * self.ks.element_size() + self.anc.numel() * 4
        return n

    # -------------------------------------------------------------- building blocks
    def _rotary(self, x: torch.Tensor, pos: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, T, D]`` for positions ``pos: Long[N, T]``."""
        rot = self.dec.rotary_emb
        if self.gemma:
            local = getattr(self.dec, "rotary_emb_local", None)
            if local is not None:  # transformers < 5.x: a separate module for sliding layers
                return (local if layer_type == "sliding_attention" else rot)(x, pos)
            return rot(x, pos, layer_type)
        return rot(x, pos)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # Gemma 3's embedding module scales by sqrt(hidden) itself (Gemma3TextScaledWordEmbedding)
        return self.dec.embed_tokens(tokens)

    @staticmethod
    def _qkv_group(layer: Any) -> tuple[Any, ...]:
        return layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj

    @staticmethod
    def _gate_up_group(layer: Any) -> tuple[Any, ...]:
        return layer.mlp.gate_proj, layer.mlp.up_proj

    def _groups(self) -> list[tuple[Any, ...]]:
        """Each layer's projections that read the same input: (q, k, v) and (gate, up)."""
        return [g for layer in self.layers for g in (self._qkv_group(layer), self._gate_up_group(layer))]

    def _projections(self, group: tuple[Any, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """``group``'s outputs for ``x``, with the FP8 rows the norm that wrote ``x`` quantized (:meth:`_add_norm`)."""
        x_fp8 = self._x_fp8[1] if self._x_fp8 is not None and self._x_fp8[0] is x else None
        return self.linears.projections(group, x, x_fp8)

    @staticmethod
    def _norm_params(mod: Any) -> tuple[torch.Tensor, float, bool] | None:
        """``(weight, eps, unit_offset)`` of an HF RMSNorm module; None for other norms."""
        if type(mod).__name__ == "Gemma3RMSNorm":
            return mod.weight, float(mod.eps), True
        if hasattr(mod, "variance_epsilon"):  # Llama / Mistral / Qwen2 / Qwen3 RMSNorm
            return mod.weight, float(mod.variance_epsilon), False
        return None

    def _norm(self, mod: Any, x: torch.Tensor) -> torch.Tensor:
        p = self._norm_params(mod)
        return mod(x) if p is None else self.ops.rms_norm(x, *p)

    def _add_norm(self, h: torch.Tensor, a: torch.Tensor | None, mod: Any, feeds: tuple[Any, ...] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add ``h + a`` (``a=None``: none) and ``mod``'s norm of the sum: one kernel
        on CUDA, which writes the sum into ``h``'s own buffer. ``feeds``: the q/k/v or gate/up group that reads
        the normed rows; where it runs as one FP8 copy the same kernel also quantizes the rows for it
        (:func:`kernels.fused_ops.add_rms_norm_fp8`: no separate quantization launch re-reading them)."""
        self._x_fp8 = None
        p = self._norm_params(mod)
        if p is None:
            h = h if a is None else h + a
            return h, mod(h)
        route = None if feeds is None else self.linears.group_route(feeds)
        if route is not None and route[0] in FP8_CHOICES:
            h, x, x_fp8 = self.ops.add_rms_norm_fp8(h, a, *p)
            self._x_fp8 = (x, x_fp8)
            return h, x
        return self.ops.add_rms_norm(h, a, *p)

    def _layer_stack(self, h: torch.Tensor, attend: Any) -> torch.Tensor:
        """Every decoder layer over ``h [N, T, hidden]`` -> the final-normed hidden ``[N, T, hidden]``.

        ``attend(li, layer, x)`` is the pass's attention (prefill, step or tree: their caches
        differ): input-normed ``x [N, T, hidden]`` -> output before o_proj ``[N, T, H * D]``. Each
        residual add is fused with the norm that reads its sum (the next layer's input norm too):
        two row-wise kernels per layer besides the GEMMs, attention, rotary and the activation."""
        h, x = self._add_norm(h, None, self.layers[0].input_layernorm, self._qkv_group(self.layers[0]))
        for li, layer in enumerate(self.layers):
            a = self.linears.linear(layer.self_attn.o_proj, attend(li, layer, x))
            if self.gemma:  # sandwich norms: the branch output is normed before the residual add
                h, x = self._add_norm(h, self._norm(layer.post_attention_layernorm, a), layer.pre_feedforward_layernorm,
                                      self._gate_up_group(layer))
            else:
                h, x = self._add_norm(h, a, layer.post_attention_layernorm, self._gate_up_group(layer))
            m = self._mlp(layer.mlp, x)
            if self.gemma:
                m = self._norm(layer.post_feedforward_layernorm, m)
            if li + 1 < len(self.layers):
                nxt = self.layers[li + 1]
                h, x = self._add_norm(h, m, nxt.input_layernorm, self._qkv_group(nxt))
            else:
                h, x = self._add_norm(h, m, self.dec.norm)
        return x

    def _split_heads(self, layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._projections(self._qkv_group(layer), x)

    def _qkv(self, layer: Any, x: torch.Tensor, rope: dict[str, tuple], li: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [N, T, hidden]`` -> q ``[N, H, T, D]``, k/v ``[N, kv, T, D]`` (rotary applied)."""
        attn = layer.self_attn
        N, T, _ = x.shape
        D = self.head_dim
        q, k, v = self._split_heads(layer, x)
        q = q.reshape(N, T, self.n_heads, D).transpose(1, 2)
        k = k.reshape(N, T, self.n_kv, D).transpose(1, 2)
        v = v.reshape(N, T, self.n_kv, D).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        cos, sin = rope[self.layer_types[li]]
        return fo.apply_rotary_reference(q, cos, sin), fo.apply_rotary_reference(k, cos, sin), v

    def _qkv_store(self, layer: Any, x: torch.Tensor, rope: dict[str, tuple], li: int, k_out: torch.Tensor,
                   v_out: torch.Tensor, t0: torch.Tensor | None) -> torch.Tensor:
        """CUDA, models without q/k norms: projections, then one kernel for rotary + the K/V cache
        write (``k_out/v_out`` as :func:`kernels.fused_ops.rotary_store` takes them). Returns
        q ``[N, T, H, D]``."""
        q, k, v = self._split_heads(layer, x)
        cos, sin = rope[self.layer_types[li]]
        return fo.rotary_store(q, k, v, cos, sin, k_out, v_out, t0)

    def _mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._projections((mlp.gate_proj, mlp.up_proj), x)
        hidden = mlp.act_fn(gate) * up if self.act is None else self.ops.gated_act(gate, up, self.act)
        return self.linears.linear(mlp.down_proj, hidden)

    def _rope_all(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str, tuple]:
        return {t: self._rotary(h, pos, t) for t in set(self.layer_types)}

    def head_lse(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [N, H]`` (final-normed) -> ``(logits [N, V], lse Float32[N])``."""
        logits = self.linears.linear(self.head, hidden)
        if self.ops.fused:  # the kernel reads the logits' own dtype: no float32 temporary
            return logits, self.ops.rows_lse(logits)
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, LSE_CHUNK):  # chunks bound the float32 temporary
            lse[s:s + LSE_CHUNK] = self.ops.rows_lse(logits[s:s + LSE_CHUNK])
        return logits, lse

    # -------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], beams: int, suffix: int, pad_id: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Compute the prompt region for ``Q`` prompts (left-padded) and reset the suffix.

        Returns ``(logits [Qb, V], lse Float32[Qb], Qb)``: the next-token distribution after each
        prompt (rows ``Q..Qb-1`` are padding; valid until the next prefill), ``Qb`` the query bucket
        the steps run at. On CUDA the pass is captured at a bucket's first use and replayed after: an
        eager prefill of the default model at 256 x 48 tokens is host-bound (~400 launches; 22 ms
        wall for ~8 ms of GPU work, H200).

        The pass runs at these prompts' own width (the longest, rounded up to ``PROMPT_BUCKET``), the last
        columns of the reserved region, not at the widest prompt the engine has reserved for: the columns
        left of it are masked (bias -inf), so one long prompt (or the cost model's calibration) does not make
        every later prefill pay for its width. (It did: an 8B search at 1,024 queries of 32 tokens prefilled
        64 columns after the calibration, 62 % of its time; H100, 2026-12-06.)
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        Q, width = len(prompts), max(len(p) for p in prompts)
        self.reserve(Q, beams, width, suffix)
        Qb, Lp = self.bucket(Q), self.Lp
        Lw = min(Lp, _round_up(width, PROMPT_BUCKET))  # this batch's columns: the last Lw of the region
        # left-padded ids in one host array and one copy (-1 = padding); padding queries get one
        # visible (pad) key, which keeps their rows finite
        ids = np.full((Qb, Lp), -1, dtype=np.int64)
        for i, p in enumerate(prompts):  # once per prompt at prefill, not per step
            ids[i, Lp - len(p):] = p
        ids[Q:, -1] = pad_id
        self.in_prompt[:Qb].copy_(torch.from_numpy(ids))
        if not self.graphs_enabled:
            return (*self._prefill_body(Qb, Lw, pad_id), Qb)
        key = ("prefill", Qb, Lw, pad_id)
        g = self._graphs.get(key)
        if g is not None:  # the graph holds the routing it was captured with: nothing to route per call
            g.graph.replay()
            return g.logits, g.lse, Qb
        # the pass run now (and captured) chooses each compressed layer's copy at its own row count's bucket
        self.linears.route_bucket(bucket_queries(Qb * Lw))
        logits, lse = self._prefill_body(Qb, Lw, pad_id)  # this IS the prefill; captured for the next ones
        self._capture_into(key, lambda: self._prefill_body(Qb, Lw, pad_id), "_prefill_pool")
        return logits, lse, Qb

    def _prefill_body(self, Qb: int, Lw: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt pass over the last ``Lw`` columns of ``in_prompt[:Qb]`` (the prompts are left-padded:
        every token is there); the columns left of them are masked for the steps and tree passes.
        Graph-safe: fixed shapes, no host syncs."""
        Lp, dev = self.Lp, self.device
        c0 = Lp - Lw
        raw = self.in_prompt[:Qb, c0:]
        valid = raw >= 0
        ids = torch.where(valid, raw, pad_id)
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        self.prompt_len[:Qb] = valid.sum(1)
        self.prompt_pos[:Qb, :c0] = 0
        self.prompt_pos[:Qb, c0:] = pos
        self.prompt_bias[:Qb, :c0] = NEG_INF
        self.prompt_bias[:Qb, c0:] = torch.where(valid, 0.0, NEG_INF)
        self.anc.copy_(self.slot_ids[:, None].expand_as(self.anc))  # every row its own path
        causal = torch.ones(Lw, Lw, dtype=torch.bool, device=dev).tril()
        vis = causal[None] & valid[:, None, :]
        vis |= torch.eye(Lw, dtype=torch.bool, device=dev)[None]  # padding queries see themselves
        h = self._embed(ids)
        rope = self._rope_all(h, pos)

        def attend(li: int, layer: Any, x: torch.Tensor) -> torch.Tensor:
            k, v = self.kp[li][:Qb, :, c0:], self.vp[li][:Qb, :, c0:]  # [Qb, kv, Lw, D] views of the region
            if self.store_fused:
                q = self._qkv_store(layer, x, rope, li, k, v, None).transpose(1, 2)
            else:
                q, k_new, v_new = self._qkv(layer, x, rope, li)
                k.copy_(k_new)
                v.copy_(v_new)
            m = vis
            if self.window[li]:
                m = vis & ((pos[:, :, None] - pos[:, None, :]) < self.window[li])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], scale=self.scaling[li],
                                               enable_gqa=self.n_kv != self.n_heads)
            return o.transpose(1, 2).reshape(Qb, Lw, -1)

        return self.head_lse(self._layer_stack(h, attend)[:, -1])

    @torch.no_grad()
    def compact(self, keep: torch.Tensor) -> int:
        """Keep query rows ``keep: Long[Qn]`` (in that order) of the prompt region, at the front.
        The suffix region follows at the next :meth:`step` through its parent rows (ancestry). Returns the new
        query bucket (rows past ``Qn`` are padding)."""
        Qn = int(keep.numel())
        Qb = self.bucket(Qn)
        src = torch.cat([keep, keep[-1:].expand(Qb - Qn)]) if Qb > Qn else keep
        for li in range(len(self.layers)):
            self.kp[li][:Qb] = self.kp[li][src]
            self.vp[li][:Qb] = self.vp[li][src]
        self.prompt_len[:Qb] = self.prompt_len[src]
        self.prompt_pos[:Qb] = self.prompt_pos[src]
        self.prompt_bias[:Qb] = self.prompt_bias[src]
        return Qb

    # -------------------------------------------------------------- decode step
    def _attend(self, li: int, q: torch.Tensor, Qb: int, t: int | None, rows: RowGather | None
                ) -> torch.Tensor:
        """Layer ``li``'s one-token attention of slot rows (``rows``: a subset, eager CPU steps;
        None: all ``Qb * B``): ``q [n, H, D]`` -> ``[n, H, D]`` over the query's prompt row and the
        row's path ``[0, t]`` (K/V at ``t`` already written). ``t``: host int, None = ``in_t``."""
        if rows is not None:  # CPU row steps: the step's indices are shared by every layer
            return decode_attention_rows(q, self.kp[li][:Qb], self.vp[li][:Qb], self.prompt_bias[:Qb],
                                         self.prompt_pos[:Qb], self.prompt_len[:Qb], self.ks[li],
                                         self.vs[li], rows, self.scaling[li], self.window[li])
        args = (q, self.kp[li][:Qb], self.vp[li][:Qb], self.prompt_bias[:Qb], self.prompt_pos[:Qb],
                self.prompt_len[:Qb], self.ks[li], self.vs[li], self.anc)
        if self.device.type == "cuda":
            return decode_attention(*args, self.in_t, self.B, self.scaling[li], self.window[li])
        t = int(self.in_t) if t is None else t
        return decode_attention_reference(*args, t, self.B, self.scaling[li], self.window[li])

    def _one_token_forward(self, tokens: torch.Tensor, pos: torch.Tensor, Qb: int, t: int | None,
                           rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens: Long[n]`` at positions ``pos: Long[n, 1]`` (suffix position ``t``; None:
        ``in_t``, graph-safe) to slot ``rows`` (None: all ``Qb * B``): their K/V are stored at
        ``t``; returns ``(logits [n, V], lse Float32[n])``."""
        n, H, D = tokens.shape[0], self.n_heads, self.head_dim
        h = self._embed(tokens[:, None])                                       # [n, 1, hidden]
        rope = self._rope_all(h, pos)
        # CPU row steps: the rows' gather indices, once for all layers (K/V at t written per layer)
        gather = None if rows is None else row_gather(self.anc, rows, t, self.B, Qb)

        def attend(li: int, layer: Any, x: torch.Tensor) -> torch.Tensor:
            if rows is None and self.store_fused:  # rotary + K/V write at in_t: one kernel
                q = self._qkv_store(layer, x, rope, li, self.ks[li][:, :n].permute(1, 2, 0, 3),
                                    self.vs[li][:, :n].permute(1, 2, 0, 3), self.in_t)
            else:
                q, k, v = self._qkv(layer, x, rope, li)                        # [n, H, 1, D]
                if rows is None:  # t on the device: one graph serves every step
                    self.ks[li, :, :n].index_copy_(0, self.in_t, k.transpose(1, 2).reshape(1, n, self.n_kv, D))
                    self.vs[li, :, :n].index_copy_(0, self.in_t, v.transpose(1, 2).reshape(1, n, self.n_kv, D))
                else:
                    self.ks[li, t, rows] = k[:, :, 0]
                    self.vs[li, t, rows] = v[:, :, 0]
            return self._attend(li, q.reshape(n, H, D), Qb, t, gather).reshape(n, 1, H * D)

        return self.head_lse(self._layer_stack(h, attend)[:, 0])

    def _step_body(self, Qb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per slot row ``R = Qb * B`` from the static inputs ``in_tokens / in_parent /
        in_t``. Graph-safe: no host syncs, fixed shapes, ``t`` read on the device."""
        R = Qb * self.B
        # Row r continues the path of in_parent[r]: its ancestry is the parent's (an integer gather
        # of [R, S]; the K/V stay where they were written), plus its own slot at t.
        self.anc[:R] = self.anc[self.in_parent[:R]]
        self.anc[:R].index_copy_(1, self.in_t, self.slot_ids[:R, None])
        pos = (self.prompt_len[:Qb].repeat_interleave(self.B) + self.in_t)[:, None]   # [R, 1]
        return self._one_token_forward(self.in_tokens[:R], pos, Qb, None, None)

    @torch.no_grad()
    def step_rows(self, tokens: torch.Tensor, t: int, rows: torch.Tensor, parent: torch.Tensor, Qb: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager step over a subset of slot rows (CPU, where padding rows cost compute and there are
        no graphs to keep shapes fixed for): row ``rows[i]`` (distinct) continues the path of row
        ``parent[i]`` and is fed ``tokens[i]`` at position ``t`` (``Qb``: the query rows in use). Returns ``(logits [n, V], lse
        [n])`` in ``rows`` order."""
        if t >= self.S:
            raise ValueError(f"suffix position {t} beyond the reserved {self.S}")
        self.anc[rows] = self.anc[parent]
        self.anc[rows, t] = rows.to(torch.int32)
        pos = self.prompt_len[rows // self.B][:, None] + t
        return self._one_token_forward(tokens, pos, Qb, t, rows)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, t: int, Qb: int, parent: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens: Long[Qb * B]`` at suffix position ``t``; slot row ``r`` continues the path
        of row ``parent[r]`` (default: its own). Returns ``(logits [R, V], lse [R])``, valid until
        the next call."""
        R = Qb * self.B
        if t >= self.S:
            raise ValueError(f"suffix position {t} beyond the reserved {self.S}")
        self.in_tokens[:R].copy_(tokens)
        if parent is None:
            self.in_parent[:R].copy_(self.slot_ids[:R])
        else:
            self.in_parent[:R].copy_(parent)
        self.in_t.fill_(t)
        if not self.graphs_enabled:
            return self._step_body(Qb)
        key = (Qb, self.Lp)
        g = self._graphs.get(key)
        if g is not None:
            g.graph.replay()
            return g.logits, g.lse
        # First use of this shape: choose each compressed layer's path at this row count, run the
        # step eagerly (this IS the step: its ancestry update and K/V writes are real), then capture
        # it for the next uses (capture records kernels, it does not run them). Every step graph
        # shares one memory pool (they replay one at a time).
        self.linears.route_bucket(R)
        out = self._step_body(Qb)
        self._capture_into(key, lambda: self._step_body(Qb), "_pool")
        return out

    # -------------------------------------------------------------- the caller's step work
    def run_captured(self, key: tuple, fn: Any, inputs: dict[str, torch.Tensor],
                     read_only: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
        """``fn(**inputs)`` (a tuple of tensors, graph-safe: fixed shapes, no host syncs) replayed
        as a CUDA graph per ``key`` (the caller's shape key): the beam search's per-step selection
        is ~60 small ops whose launches cost more than their math at beam-search row counts.

        ``inputs`` are copied into the graph's own buffers before each replay. ``read_only``:
        tensors ``fn`` reads in place (e.g. a step graph's logits), named in the key by address, so a
        replay reads whatever those buffers hold now. The outputs are the graph's buffers, valid
        until the next replay of this key. CPU, and the first two uses of a key, run ``fn`` eagerly; a
        key whose capture fails stays eager (logged once)."""
        gkey = ("captured", key, tuple((t.data_ptr(), tuple(t.shape)) for t in read_only))
        if not self.graphs_enabled or gkey in self._eager_keys:
            return fn(**inputs)
        g = self._graphs.get(gkey)
        if g is not None:
            for name, t in inputs.items():
                g.inputs[name].copy_(t)
            g.graph.replay()
            return g.outputs
        out = fn(**inputs)  # eager (also warms any lazily initialised kernels)
        # captured at a key's second use: a step's first use of a shape returns its eager outputs,
        # whose address (in the key) never recurs, and a graph for it would only hold memory
        self._seen_keys[gkey] = self._seen_keys.get(gkey, 0) + 1
        if self._seen_keys[gkey] < 2:
            return out
        static = {name: t.clone() for name, t in inputs.items()}
        captured = self._try_capture(gkey, lambda: fn(**static), "_host_pool")
        if captured is not None:
            self._graphs[gkey] = _Graph(captured[0], None, None, static, captured[1])
        return out

    def _capture_into(self, key: tuple, body: Any, pool: str, inputs: dict[str, torch.Tensor] | None = None) -> None:
        """Capture a forward ``body() -> (logits, lse)`` under ``key`` (a step, prefill or tree pass;
        ``inputs``: a tree pass's static inputs), unless its capture failed before."""
        if key in self._eager_keys:
            return
        captured = self._try_capture(key, body, pool)
        if captured is not None:
            graph, (logits, lse) = captured
            self._graphs[key] = _Graph(graph, logits, lse, inputs)

    def _try_capture(self, key: tuple, body: Any, pool: str) -> tuple[Any, Any] | None:
        """Capture ``body()`` as a CUDA graph in the engine's memory pool named ``pool``
        (``"_pool"`` / ``"_prefill_pool"`` / ``"_tree_pool"`` / ``"_host_pool"``, created by the first
        capture in it). Returns ``(graph,
        body's outputs)``; None when capture fails (e.g. an attention backend that cannot be
        captured): the key then stays eager, logged once."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=getattr(self, pool)):
                outs = body()
        except RuntimeError as exc:
            log.warning("%s not captured (%s); it runs eagerly", key, exc)
            self._eager_keys.add(key)
            torch.cuda.synchronize(self.device)
            return None
        if getattr(self, pool) is None:
            setattr(self, pool, graph.pool())
        self.capture_seconds += time.perf_counter() - t0
        return graph, outs

    # -------------------------------------------------------------- tree pass
    def tree_width(self, fed: int, steps: int = 1) -> int:
        """Tree tokens per beam a pass runs at: where passes are graph-captured (few shapes), ``fed`` rounded
        up to one of ``steps`` widths per octave (1: a power of two; 4: 4, 5, 6, 7 x a power of two, <= 25 %
        padding), at least 4; ``fed`` itself in eager mode. Callers pad their trees to it."""
        if not self.graphs_enabled:
            return fed
        if fed <= 4:
            return 4
        octave = 1 << (fed - 1).bit_length() - 1  # the power of two below fed
        step = max(octave // steps, 1)
        return -(-fed // step) * step

    @torch.no_grad()
    def tree_forward(self, rows: torch.Tensor, t: int, tokens: torch.Tensor, pos: torch.Tensor,
                     tree_vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Score token trees hanging below slot rows, without touching the cache.

        Args:
            rows: ``Long[V]`` slot row whose path ``[0, t)`` is each tree's prefix (the row's
                query prompt comes first).
            tokens: ``Long[V, F]`` tree tokens; ``pos: Long[V, F]`` their positions.
            tree_vis: ``Bool[V, F, F]`` which tree tokens each tree token sees (ancestor-or-self).
        Returns:
            ``(logits [V*F, vocab], lse Float32[V*F])`` at every tree token.

        On CUDA each shape (``V`` rounded up to a power of two, ``F``, ``Lp``) is captured once as a
        CUDA graph and replayed (``t`` read on the device; the suffix keys past it masked): an eager
        pass of the 8B shape launched ~1,240 kernels and took 53-67 ms of host time even for 32 tree
        tokens (bench/results/step_profile_8b_engine3_sweep.md), which priced verification out at
        small batches. Padding rows score a one-token tree below slot 0 and are dropped.
        """
        V, Fn = tokens.shape
        if not self.graphs_enabled:
            return self._tree_body(rows, t, tokens, pos, tree_vis)
        Vb = bucket_queries(V)
        key = ("tree", Vb, Fn, self.Lp)
        g = self._graphs.get(key)
        if g is None:
            inputs = {"rows": torch.zeros(Vb, dtype=torch.long, device=self.device),
                      "tokens": torch.zeros(Vb, Fn, dtype=torch.long, device=self.device),
                      "pos": torch.zeros(Vb, Fn, dtype=torch.long, device=self.device),
                      "vis": torch.eye(Fn, dtype=torch.bool, device=self.device)[None].repeat(Vb, 1, 1),
                      "t": torch.zeros(1, dtype=torch.long, device=self.device)}
        else:
            inputs = g.inputs
        inputs["rows"][:V].copy_(rows)
        inputs["tokens"][:V].copy_(tokens)
        inputs["pos"][:V].copy_(pos)
        inputs["vis"][:V].copy_(tree_vis)
        inputs["t"].fill_(t)
        n = V * Fn
        if g is not None:
            g.graph.replay()
            return g.logits[:n], g.lse[:n]
        self.linears.route_bucket(bucket_queries(Vb * Fn))
        body = lambda: self._tree_body(inputs["rows"], inputs["t"], inputs["tokens"], inputs["pos"], inputs["vis"])  # noqa: E731
        out = body()  # the first pass of this shape runs eagerly, then is captured for the next
        # tree graphs have their own pool: a tree pass must not overwrite the step's outputs
        self._capture_into(key, body, "_tree_pool", inputs)
        return out[0][:n], out[1][:n]

    def _tree_body(self, rows: torch.Tensor, t: int | torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                   tree_vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree pass over ``[V, F]`` tree tokens. ``t``: a host int (eager: the suffix keys
        ``[0, t)`` are gathered), or ``Long[1]`` on the device (graph-safe: all ``S`` suffix
        positions are gathered and those at or past ``t`` masked)."""
        V, Fn = tokens.shape
        q_of = rows // self.B
        Lp, dev = self.Lp, self.device
        if isinstance(t, torch.Tensor):
            n_suf = self.S
            s_vis = (torch.arange(n_suf, device=dev) < t)[None, None, :].expand(V, Fn, n_suf)
        else:
            n_suf = t
            s_vis = torch.ones(V, Fn, t, dtype=torch.bool, device=dev)
        p_vis = (self.prompt_bias[q_of] == 0)[:, None, :].expand(V, Fn, Lp)
        vis = torch.cat([p_vis, s_vis, tree_vis], -1)[:, None]                # [V, 1, F, Lp+S+F]
        key_pos = torch.cat([self.prompt_pos[q_of],
                             self.prompt_len[q_of][:, None] + torch.arange(n_suf, device=dev), pos], 1)
        h = self._embed(tokens)
        rope = self._rope_all(h, pos)

        def attend(li: int, layer: Any, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(layer, x, rope, li)
            kk = torch.cat([self.kp[li].index_select(0, q_of), gather_suffix(self.ks[li], self.anc, rows, n_suf), k], 2)
            vv = torch.cat([self.vp[li].index_select(0, q_of), gather_suffix(self.vs[li], self.anc, rows, n_suf), v], 2)
            m = vis
            if self.window[li]:
                m = vis & ((pos[:, None, :, None] - key_pos[:, None, None, :]) < self.window[li])
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m, scale=self.scaling[li],
                                               enable_gqa=self.n_kv != self.n_heads)
            return o.transpose(1, 2).reshape(V, Fn, -1)

        return self.head_lse(self._layer_stack(h, attend).reshape(V * Fn, -1))


# model -> its engines by LinearFormats, the last one used first (a bench or a caller that switches formats
# keeps both engines' graphs and copies instead of rebuilding them at every switch)
_ENGINES: "weakref.WeakKeyDictionary[Any, dict[LinearFormats, DecodeEngine]]" = weakref.WeakKeyDictionary()


def weights_signature(model: Any, modules: list[Any] | None = None) -> tuple:
    """Where every parameter / buffer lives and its in-place version counter: changes when the model
    is trained further, moved, cast or reloaded (the engine's fused copies and graphs would be stale). Read
    from each module's own dicts (:func:`adbatch.models.submodules`; ``modules``: that walk, where the caller
    has it), not ``parameters()`` / ``buffers()``: 2.7 -> 0.78 ms a call on a 32-layer model of 1,193 tensors
    (CPU; every search call pays it)."""
    return tuple((t.data_ptr(), t._version) for m in (submodules(model) if modules is None else modules)
                 for d in (m._parameters, m._buffers) for t in d.values() if t is not None)


def engine_for(model: Any, formats: LinearFormats | None = None, modules: list[Any] | None = None) -> DecodeEngine:
    """The model's engine for ``formats`` (buffers, captured graphs and linear plan are kept across calls
    while the weights are unchanged; a changed model gets new engines). ``formats`` None: the engine used
    last for this model, else one with :data:`DEFAULT_LINEAR_FORMATS`.

    An engine built under ``torch.inference_mode`` holds inference tensors, which nothing may write outside that
    mode: a caller outside it gets a new engine (built in its own mode; it then serves both modes).
    ``modules``: ``submodules(model)`` where the caller walked the tree already (:func:`serving_engine`)."""
    engines = _ENGINES.get(model)
    sig = weights_signature(model, modules)
    if engines is None or any(e.signature != sig for e in engines.values()):
        engines = {}
        _ENGINES[model] = engines
        _MODEL_COPIES.pop(model, None)  # copies of the old weights
    if formats is None:
        formats = next(iter(engines), DEFAULT_LINEAR_FORMATS)
    formats = LinearFormats(formats)
    eng = engines.pop(formats, None)
    inference = torch.is_inference_mode_enabled()
    if eng is not None and eng.inference_tensors and not inference:
        eng = None  # its weight copies are only read: the new engine keeps them
    if eng is None:
        eng = DecodeEngine(model, formats=formats)
        eng.signature = sig
        eng.inference_tensors = inference
    _ENGINES[model] = {formats: eng, **engines}
    return eng


@contextlib.contextmanager
def serving_engine(model: Any, formats: LinearFormats | None = None) -> Iterator[DecodeEngine]:
    """:func:`engine_for` ``(model, formats)``, with ``model`` in :func:`adbatch.models.eval_mode` inside the block:
    one walk of the module tree serves both (a search call's fixed host cost: each walk is ~0.2 ms on the default
    model, CPU)."""
    modules = submodules(model)
    engine = engine_for(model, formats, modules)
    with eval_mode(model, modules):
        yield engine


def warm_up_search(model: Any, config: TargetSearchConfig, queries: int, prompt_tokens: int,
                   tree_tokens: int | None = None) -> list[int]:
    """:meth:`DecodeEngine.warm_up` of ``model``'s engine for target searches under ``config`` (its beams per
    query and linear formats) in batches of up to ``queries`` prompts of up to ``prompt_tokens`` tokens, with tree
    passes of up to ``tree_tokens`` tokens (None: ``config.max_tokens_per_pass`` where it verifies, else none;
    pass more where exact scoring runs larger ones: ``adbatch.decoding.tree_verify.SCORE_PASS_TOKENS``). Outside
    ``torch.inference_mode``: such an engine also serves searches inside it. Returns the buckets routed."""
    if tree_tokens is None:
        tree_tokens = 0 if config.verify is VerifyMode.OFF else config.max_tokens_per_pass
    with serving_engine(model, config.linear_formats) as engine:
        return engine.warm_up(queries, config.pool_size, prompt_tokens, tree_tokens)


def exact_logprobs_of(logits: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None,
                      tokens: torch.Tensor) -> torch.Tensor:
    """Exact log-probs at chosen entries: ``logits[rows, tokens].float() - lse[rows]``.

    ``rows``/``tokens``: Long tensors of one shape (``rows=None``: ``tokens`` is ``[N, C]`` and row
    ``i`` of it reads row ``i``); negative tokens read token 0 (mask them afterwards).
    """
    tok = tokens.clamp(min=0)
    if rows is None:
        return logits.gather(1, tok).float() - lse[:, None]
    return logits[rows, tok].float() - lse[rows]


__all__ = ["DecodeEngine", "LinearPlan", "LinearFormats", "LinearChoice", "engine_for", "warm_up_search",
           "exact_logprobs_of", "check_supported",
           "bucket_queries", "model_device", "model_dtype", "decoder_of",
           "SUPPORTED_MODEL_TYPES"]

