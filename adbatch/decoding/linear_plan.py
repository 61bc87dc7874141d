"""The per-bucket linear plan: which copy of each of the model's linears serves a decode pass at a row bucket.

The decode engine (:mod:`adbatch.decoding.engine`) owns the KV buffers and the step; this module indexes the
model's linear modules. Per row bucket a :class:`LinearPlanner` times the packed kernel against a dense
copy of each compressed layer shape and keeps the faster, so a compressed model is never slower than its dense
form at any bucket it serves. At large buckets (>= :data:`SPARSE_MIN_ROWS` rows: many queries x beams on a large
model, where no weight-only kernel can win) a 2:4 or 1:4 layer is also timed as a semi-structured sparse copy on
Hopper's / Ampere's sparse tensor cores (:func:`semi_structured_copy`). With :attr:`LinearFormats.FP8` (at every
bucket) two compute formats join: an FP8 copy (per-channel weight scales, per-row dynamic activation scales;
:mod:`kernels.fp8_linear`) and, for 2:4 / 1:4 layers, a 2:4 FP8 copy on the sparse tensor cores -- each only
where its output passes :data:`FP8_MAX_REL_ERROR` against the bf16 copy on the timing input, and served only
where it is :data:`FP8_MIN_SPEEDUP` faster than the fastest exact format. Projections that read one input (q/k/v,
gate/up) and are all compressed are one plan unit: one GEMM of their concatenated copies (one activation
quantization for FP8), or one launch over their packed weights stacked.

The engine asks :meth:`LinearPlanner.route_bucket` to route a pass's bucket before the pass, then runs every
projection through the planner (:meth:`LinearPlanner.linear`, :meth:`LinearPlanner.projections`: the copy that
serves it, :func:`run_copy`); :meth:`LinearPlanner.group_route` tells its norm where an FP8 copy reads the rows.
Dense q/k/v and gate/up run as one GEMM of their concatenated weights at every bucket, through the same call a
compressed unit served by its bf16 copy makes (:class:`GroupCall`): where the plan serves every unit bf16, a
compressed model runs the dense model's calls. Measurements are kept in :class:`LinearPlan` (``engine.plan``); the
copies are shared by a model's engines (:data:`_MODEL_COPIES`).

**Saved plans.** Timing a bucket's candidates costs seconds per bucket (a trained 135M model's first 297 queries
ran at 22.6 q/s, later ones at 2,122; H200), and every process -- each Ray actor of a night -- would pay it inside
its work. A plan is therefore saved as JSON beside the kernel tuner's configs (:func:`kernels.int4_tuner.cache_dir`),
one file per :func:`plan_identity` (device name, torch / Triton / torchao / kernel versions, dtype, the formats
planned among and the rules a choice follows), and read by every planner of a compressed model on CUDA when it is built:
:meth:`LinearPlanner.route_bucket` then finds its choices without timing. Planning a bucket holds the file's lock,
so the actors of one host time it once and read one plan (their outputs do not depend on which of them timed).
:meth:`LinearPlanner.warm` routes given buckets before the work (``DecodeEngine.warm_up``).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import torch
import torch.nn.functional as F

from adbatch.decoding.config import LinearFormats, TargetSearchConfig
from kernels.fp8_linear import (Fp8Layout, fp8_linear, fp8_supported, quantize_rows_fp8, quantize_weight_fp8,
                                relative_error)
from kernels.nm_int4 import concat_packed, dequantize_nm_int4
from kernels.packed_linear import nm_int4_linear

log = logging.getLogger(__name__)

#: buckets from which a 2:4 / 1:4 layer is also timed as a semi-structured sparse copy. cuSPARSELt on the
#: H200 vs cuBLAS fp16 at 8192x28672 (issue 20's measurements): 0.37x at 256 rows, 1.17x at 1,024, 1.44x at
#: 4,096; below 512 rows building and timing the copy costs and never pays
SPARSE_MIN_ROWS = 512
#: layer patterns a semi-structured (2:4) copy can hold: 1:4 is 2:4 with one more zero per group of four
SPARSE_PATTERNS = ("2:4", "1:4")
#: largest relative error (Frobenius, vs the layer's bf16 copy on the timing input) an FP8 copy may have to
#: be served; e4m3 with per-channel / per-row scales lands near 0.03-0.04 on Gaussian inputs (the public
#: 2:4 FP8 kernel: 0.038), a broken scale or an outlier-ridden layer far above
FP8_MAX_REL_ERROR = 0.08
#: an FP8 format is served only where it is at least this much faster than the fastest format that keeps the
#: INT4 model's numerics (packed, a bf16 / 2:4 bf16 copy): it changes them, and a lead inside the timer's noise
#: lost in place -- the 135M shape's plan took FP8 for gate/up by 3-12 % (10,240 rows: 57.5 vs 60.8 us) and its
#: search ran at 0.91x / 0.96x dense at 1,024 / 2,048 queries (H100, 2026-12-06)
FP8_MIN_SPEEDUP = 1.10


class LinearChoice(str, enum.Enum):
    """How one compressed layer runs at one bucket."""

    PACKED = "packed"        #: the packed INT4 / N:M kernel (kernels.packed_linear); a q/k/v or gate/up unit of
    #: one pattern runs as one launch over its members stacked (kernels.nm_int4.concat_packed)
    DENSE = "dense"          #: a bf16 / fp16 copy of the dequantized weight (cuBLAS)
    SPARSE = "sparse"        #: a semi-structured 2:4 copy in the activation dtype (cuSPARSELt / CUTLASS)
    FP8 = "fp8"              #: an FP8 copy, activations quantized per row (torch._scaled_mm)
    SPARSE_FP8 = "sparse_fp8"  #: a 2:4 FP8 copy on the sparse tensor cores (torchao's CUTLASS kernel)


#: the formats that quantize activations (accuracy-checked, and served only by FP8_MIN_SPEEDUP)
FP8_CHOICES = (LinearChoice.FP8, LinearChoice.SPARSE_FP8)

#: what the engine plans among when its caller names nothing: TargetSearchConfig.linear_formats's default (the knob)
DEFAULT_LINEAR_FORMATS: LinearFormats = TargetSearchConfig.__dataclass_fields__["linear_formats"].default

#: a unit's route in a pass: its format and the copy that serves it (None: the members' own packed weights)
Route = tuple[LinearChoice, Any]

#: the saved plans' layout (:meth:`LinearPlan.to_json`); bump it when what an entry means changes in a way
#: :func:`plan_identity` does not name (older files are then not read)
PLAN_FILE_VERSION = 1


class GroupCall(NamedTuple):
    """One GEMM / launch that serves a q/k/v or gate/up group in a pass: a dense model's concatenated weights, or a
    compressed unit's copy in its routed format; its output ``[..., sum(sizes)]`` splits into the members'."""

    route: Route
    bias: torch.Tensor | None     # the members' biases concatenated ``[sum(sizes)]`` (all or none have one)
    sizes: tuple[int, ...]        # out_features per member


@dataclass
class LinearPlan:
    """Per compressed layer shape and row bucket: which :class:`LinearChoice`, by measurement.

    ``choice[(N, K, pattern, rows)]`` is a :class:`LinearChoice`; ``timings`` keeps the measured
    microseconds per candidate (graph-replayed medians, the kernel tuner's own timer) behind each choice,
    and ``errors`` the FP8 candidates' relative errors vs the bf16 copy (a candidate over
    :data:`FP8_MAX_REL_ERROR` is not served, whatever its time).
    """

    choice: dict[tuple, LinearChoice] = field(default_factory=dict)
    timings: dict[tuple, dict[LinearChoice, float]] = field(default_factory=dict)
    errors: dict[tuple, dict[LinearChoice, float]] = field(default_factory=dict)

    def to_json(self) -> list[dict[str, Any]]:
        """One dict per key: ``n, k, pattern, rows, choice`` and the ``timings_us`` / ``errors`` by format value."""
        return [{"n": key[0], "k": key[1], "pattern": key[2], "rows": key[3], "choice": choice.value,
                 "timings_us": {c.value: t for c, t in self.timings.get(key, {}).items()},
                 "errors": {c.value: e for c, e in self.errors.get(key, {}).items()}}
                for key, choice in self.choice.items()]

    def update_from_json(self, entries: list[dict[str, Any]], shapes: set[tuple] | None = None) -> None:
        """Add :meth:`to_json`'s ``entries`` (those of the unit shapes ``(N, K, pattern)`` in ``shapes``; None:
        all). Raises ``KeyError`` / ``ValueError`` / ``TypeError`` on a malformed entry, before adding any."""
        parsed = [((int(e["n"]), int(e["k"]), str(e["pattern"]), int(e["rows"])), LinearChoice(e["choice"]),
                   {LinearChoice(c): float(t) for c, t in e["timings_us"].items()},
                   {LinearChoice(c): float(v) for c, v in e["errors"].items()}) for e in entries]
        for key, choice, timings, errors in parsed:
            if shapes is None or key[:3] in shapes:
                self.choice[key], self.timings[key], self.errors[key] = choice, timings, errors


def plan_identity(device: torch.device, formats: LinearFormats, dtype: torch.dtype) -> dict[str, Any]:
    """What a saved plan's choices depend on besides their keys ``(N, K, pattern, rows)``: the GPU (``device``,
    CUDA) and the software timed on it, the activations' ``dtype``, the formats planned among, and the rules a
    choice follows (a changed threshold plans again). Plans are saved and read per identity."""
    import importlib.metadata

    import triton

    from kernels.int4_tuner import KERNEL_VERSION, cuda_device_name

    try:  # the optional 2:4 FP8 kernel's package: a plan that serves it needs it to build its copies
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {"version": PLAN_FILE_VERSION, "device": cuda_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__, "torchao": torchao, "kernel_version": KERNEL_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
            "formats": [c.value for c in LinearChoice if formats is LinearFormats.FP8 or c not in FP8_CHOICES],
            "sparse_min_rows": SPARSE_MIN_ROWS, "fp8_max_rel_error": FP8_MAX_REL_ERROR,
            "fp8_min_speedup": FP8_MIN_SPEEDUP}


def plan_path(identity: dict[str, Any]) -> Path:
    """The saved plan of ``identity``: ``linear_plan_<device>_<hash of the identity>.json`` in the kernel tuner's
    cache directory."""
    from adbatch.artifacts import sha256_json
    from kernels.int4_tuner import cache_dir, file_safe

    return cache_dir() / f"linear_plan_{file_safe(identity['device'])}_{sha256_json(identity)[:16]}.json"


def read_saved_plan(path: Path, identity: dict[str, Any], into: LinearPlan, shapes: set[tuple] | None = None) -> int:
    """Add the plan saved at ``path`` for ``identity`` (the entries of the unit ``shapes``; None: all) to ``into``;
    returns how many entries were added. A missing file adds nothing; an unreadable one, or one saved for another
    identity, is ignored with a warning (it is planned again, and overwritten by the next save)."""
    if not path.is_file():
        return 0
    try:
        raw = json.loads(path.read_text())
        if raw["identity"] != identity:
            log.warning("ignoring the linear plan %s: saved for %s, not %s", path, raw["identity"], identity)
            return 0
        before = len(into.choice)
        into.update_from_json(raw["entries"], shapes)
        return len(into.choice) - before
    except (OSError, ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        log.warning("ignoring unreadable linear plan %s: %s", path, exc)
        return 0


def save_plan(path: Path, identity: dict[str, Any], plan: LinearPlan) -> None:
    """Write ``plan`` to ``path`` (atomically), merged over what the file holds for ``identity``: other models'
    unit shapes stay, this plan's entries win. The caller holds :func:`_plan_lock`."""
    from adbatch.artifacts import write_json_atomic

    merged = LinearPlan()
    read_saved_plan(path, identity, merged)
    merged.choice.update(plan.choice)
    merged.timings.update(plan.timings)
    merged.errors.update(plan.errors)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"identity": identity, "entries": merged.to_json()})


@contextlib.contextmanager
def _plan_lock(path: Path) -> Iterator[None]:
    """The saved plan's file lock (``<path>.lock``), as the decode cost model's calibration takes one: the actors of
    one host plan a bucket once, the others then read it."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def semi_structured_copy(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` (fp16 / bf16 ``[N, K]`` on CUDA, at most 2 nonzeros in every 4 consecutive columns) as a
    :func:`torch.sparse.to_sparse_semi_structured` tensor (cuSPARSELt where torch has it, else CUTLASS):
    half the values plus 2-bit metadata, ~0.56x of the dense copy's bytes. ``F.linear(x, copy)`` then
    runs on the sparse tensor cores. None where this GPU / torch / shape cannot (the reason is logged)."""
    try:
        from torch.sparse import to_sparse_semi_structured

        return to_sparse_semi_structured(w.contiguous())
    except (RuntimeError, ValueError, NotImplementedError, ImportError, AttributeError) as exc:
        log.info("no semi-structured sparse copy of a %s %s weight: %s", tuple(w.shape), w.dtype, exc)
        return None


def run_copy(route: Route, x: torch.Tensor, bias: torch.Tensor | None,
             x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x [..., K]`` through a unit's copy in its format -> ``[..., N]`` (rows contiguous); ``x_fp8``: ``x``'s
    rows already quantized for an FP8 copy (see :func:`kernels.fp8_linear.fp8_linear`)."""
    choice, copy = route
    if choice is LinearChoice.PACKED:  # a unit's members stacked into one packed weight
        return nm_int4_linear(x, copy, bias)
    if choice is LinearChoice.DENSE:
        return F.linear(x, copy, bias)
    if choice is LinearChoice.SPARSE:  # the sparse GEMM's result is a transposed view: the fused ops need rows
        y = F.linear(x.reshape(-1, x.shape[-1]), copy, bias)
        return y.contiguous().reshape(*x.shape[:-1], -1)
    return fp8_linear(x, copy, x_fp8=x_fp8)  # FP8 / SPARSE_FP8 (the bias lives in the copy)


def _is_packed(mod: Any) -> bool:
    return hasattr(mod, "packed") and hasattr(mod, "qweight")


def _pattern(mod: Any) -> str:
    """A packed module's N:M pattern as its string value (``"2:4"``)."""
    return str(getattr(mod.pattern, "value", mod.pattern))


def group_bias(group: tuple[Any, ...]) -> tuple[bool, torch.Tensor | None]:
    """Whether ``group``'s projections can run as one GEMM as far as their biases go (all or none have one),
    and the concatenated bias (None: none)."""
    biases = [getattr(m, "bias", None) for m in group]
    if all(b is None for b in biases):
        return True, None
    if any(b is None for b in biases):
        return False, None
    return True, torch.cat([b.detach() for b in biases], 0)


@dataclass(eq=False)
class _Unit:
    """Compressed projections the plan times and routes as one: a group that reads one input (q/k/v or
    gate/up, every member compressed) runs as one GEMM of its members' concatenated copies -- one activation
    quantization for FP8 -- or its members' packed kernels; any other compressed layer is a unit of one."""

    mods: tuple[Any, ...]
    sizes: tuple[int, ...]          # out_features per member (the fused output's split)
    bias: torch.Tensor | None       # the members' biases concatenated (all or none have one)

    @property
    def key(self) -> tuple:
        """``(N, K, pattern)``: summed out_features, in_features, the members' patterns joined by '+'."""
        return (sum(self.sizes), int(self.mods[0].in_features), "+".join(_pattern(m) for m in self.mods))

    @property
    def sparse(self) -> bool:
        """Every member 2:4 or sparser: a semi-structured (2:4) copy holds the unit."""
        return all(_pattern(m) in SPARSE_PATTERNS for m in self.mods)

    @property
    def stackable(self) -> bool:
        """Several members of one pattern: their packed weights stack into one (one launch, not one per
        member: at 8 rows on the 8B shape q/k/v take 14.8 us stacked vs 28.4 us as three launches, H100)."""
        return len(self.mods) > 1 and len({_pattern(m) for m in self.mods}) == 1


#: per model, the copies of its compressed units its engines built (see LinearPlanner.copies)
_MODEL_COPIES: "weakref.WeakKeyDictionary[Any, dict[tuple[int, LinearChoice], Any]]" = weakref.WeakKeyDictionary()


class LinearPlanner:
    """Which copy serves each linear of one engine's model (see the module docstring): the dense q/k/v and gate/up
    concatenated, and for the compressed layers their units, the measured :attr:`plan`, the copies some bucket
    chose and the routing of the pass being run.

    ``groups``: the model's projections that read one input (each layer's q/k/v and gate/up), which run as one GEMM
    where every member is dense or every member compressed; ``device`` / ``dtype``: where the copies live and the
    activations' dtype. Holds no reference to the model itself (the engine cache keys engines by it weakly).
    """

    def __init__(self, model: Any, groups: list[tuple[Any, ...]], formats: LinearFormats | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        #: the formats the per-bucket plan may choose among (a compressed model's layers only)
        self.formats = LinearFormats(formats or DEFAULT_LINEAR_FORMATS)
        #: serve every compressed layer in this one format at every bucket, unplanned (accuracy
        #: measurements of a format; None = the measured plan)
        self.forced: LinearChoice | None = None
        self.device, self.dtype = device, dtype
        # copies of compressed units some bucket chose, by (id of the unit's first module, format); kept
        # across buckets (building one costs a dequantization, FP8 ones a quantization too) and shared by the
        # model's engines of other linear_formats (an 8B model's bf16 copies are 14 GB)
        self.copies: dict[tuple[int, LinearChoice], Any] = _MODEL_COPIES.setdefault(model, {})
        # the routing of the pass being run: id of a unit's first module -> (format, its copy or None)
        self.route: dict[int, Route] = {}
        self.routed_rows: int | None = None  # the bucket route was planned for
        self._fp8_refused: set[Fp8Layout] = set()
        #: each dense q/k/v and gate/up group's weights concatenated, by id of its first module
        self.fused: dict[int, GroupCall] = self._fuse_dense_projections(groups)
        #: the groups that run as one GEMM / launch in the pass being run, by id of their first module: the dense
        #: ones (every pass) and the compressed units routed to a copy of their members together
        self.group_calls: dict[int, GroupCall] = dict(self.fused)
        self.packed_modules = [m for m in model.modules() if _is_packed(m)]
        self.units = self._compressed_units(groups)
        self.unit_of = {id(u.mods[0]): u for u in self.units}
        self.plan = LinearPlan()
        #: the saved plan this planner reads and extends, and what it was saved for (None: nothing to plan, or no
        #: GPU to time on)
        self.plan_file: Path | None = None
        self._identity: dict[str, Any] | None = None
        if self.units and device.type == "cuda":
            self._identity = plan_identity(device, self.formats, dtype)
            self.plan_file = plan_path(self._identity)
            n = read_saved_plan(self.plan_file, self._identity, self.plan, {u.key for u in self.units})
            if n:
                log.info("linear plan: %d saved choices read from %s", n, self.plan_file)

    def _fuse_dense_projections(self, groups: list[tuple[Any, ...]]) -> dict[int, GroupCall]:
        """Each layer's dense q/k/v and gate/up weights concatenated into one matrix (one GEMM
        instead of three / two: at beam-search row counts the launches cost more than the math).
        A copy: the model's own parameters stay untouched. Compressed layers are planned as units."""
        fused = {}
        for group in groups:
            fusable, bias = group_bias(group)
            if fusable and all(type(m) is torch.nn.Linear for m in group):
                weight = torch.cat([m.weight.detach() for m in group], 0)
                fused[id(group[0])] = GroupCall((LinearChoice.DENSE, weight), bias,
                                                tuple(int(m.out_features) for m in group))
        return fused

    def _compressed_units(self, groups: list[tuple[Any, ...]]) -> list[_Unit]:
        """The compressed layers as plan units: each q/k/v or gate/up group whose members are all compressed
        (and all or none have a bias) is one unit, every other compressed layer a unit of its own."""
        packed = {id(m) for m in self.packed_modules}
        units, grouped = [], set()
        for group in groups:
            fusable, bias = group_bias(group)
            if fusable and all(id(m) in packed for m in group):
                units.append(_Unit(tuple(group), tuple(int(m.out_features) for m in group), bias))
                grouped.update(id(m) for m in group)
        units += [_Unit((m,), (int(m.out_features),), getattr(m, "bias", None))
                  for m in self.packed_modules if id(m) not in grouped]
        return units

    # -------------------------------------------------------------- what the engine asks
    def keys(self, rows: int) -> list[tuple]:
        """The :attr:`plan` keys ``(N, K, pattern, rows)`` a pass at ``rows`` rows routes by."""
        return list(dict.fromkeys(u.key + (rows,) for u in self.units))

    def group_route(self, group: tuple[Any, ...]) -> Route | None:
        """The route of ``group`` (q/k/v or gate/up) where it runs as one GEMM / launch in this pass, else None."""
        call = self.group_calls.get(id(group[0]))
        return None if call is None else call.route

    def linear(self, mod: Any, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)`` through the copy that serves ``mod`` in this pass (its own forward where none does)."""
        route = self.route.get(id(mod))
        if route is None or route[1] is None:  # not compressed, or packed in the module's own weight
            return mod(x)
        return run_copy(route, x, getattr(mod, "bias", None))

    def projections(self, group: tuple[Any, ...], x: torch.Tensor,
                    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The outputs of ``group``'s members (q/k/v or gate/up) for ``x [..., K]``: one GEMM / launch of the
        group's copy where it has one, else one per member. ``x_fp8``: ``x``'s rows already quantized, for an
        FP8 copy of the group (see :func:`run_copy`)."""
        call = self.group_calls.get(id(group[0]))
        if call is None:  # a compressed group whose members run their own packed weights, or a mixed one
            return [self.linear(m, x) for m in group]
        return list(run_copy(call.route, x, call.bias, x_fp8).split(call.sizes, dim=-1))

    def force(self, choice: LinearChoice | None) -> None:
        """Serve every unit as ``choice`` at every bucket from now on, unplanned (None: the measured plan again)."""
        self.forced = None if choice is None else LinearChoice(choice)
        self._set_route({}, None)

    def route_bucket(self, rows: int) -> None:
        """Route every compressed unit's calls for the pass that follows (a step being captured, a prefill or a
        tree pass: eager ones plan at their row count's power-of-two bucket) by the plan's choice at ``rows``
        rows: a saved or earlier choice, else its candidates timed now (graph-replayed, CUDA; the bucket's
        choices are then saved). On a CPU nothing is timed: units the plan has no choice for keep their own
        forward (a given plan only)."""
        if not self.units or rows == self.routed_rows:  # the routing depends on the bucket alone
            return
        if self.forced is None and self.device.type == "cuda":
            self._plan_bucket(rows)
        route: dict[int, Route] = {}
        planned = True
        for unit in self.units:
            key = unit.key + (rows,)
            if self.forced is not None:
                choice = self._forced_choice(unit)
            elif key in self.plan.choice:
                choice = LinearChoice(self.plan.choice[key])
            else:
                planned = False
                continue
            route[id(unit.mods[0])] = (choice, self._copy_for(unit, choice, rows))
        self._set_route(route, rows if planned else None)

    def warm(self, buckets: Iterable[int]) -> None:
        """Route each of ``buckets`` (rows) once, before the work: their choices are planned (read from the saved
        plan, else timed and saved) and their copies built, so no pass of the work pays either. The routing left
        behind is the last bucket's; every pass routes its own before it runs."""
        for rows in buckets:
            self.route_bucket(rows)

    def _plan_bucket(self, rows: int) -> None:
        """Make sure the plan has a choice for every unit shape at ``rows`` rows: time the missing ones under the
        saved plan's lock, after reading what another process saved meanwhile, and save the bucket's choices."""
        missing = {u.key: u for u in self.units if u.key + (rows,) not in self.plan.choice}
        if not missing:
            return
        with _plan_lock(self.plan_file):
            read_saved_plan(self.plan_file, self._identity, self.plan, set(missing))
            timed = [u for key, u in missing.items() if key + (rows,) not in self.plan.choice]
            for unit in timed:
                self.time_unit(unit, unit.key + (rows,), rows)
            if timed:
                save_plan(self.plan_file, self._identity, self.plan)

    def _copy_for(self, unit: _Unit, choice: LinearChoice, rows: int) -> Any:
        """The copy that serves ``unit`` as ``choice``: kept, else built now (None: a packed unit whose members run
        their own weights). A plan read from disk builds its copies here, at a bucket's first routing: a
        dequantization (plus a quantization for FP8), far cheaper than the timing it saves."""
        if choice is LinearChoice.PACKED:
            copy_ = self._packed_copy(unit)  # None: the members run their own packed weights
        else:
            copy_ = self.copies.get((id(unit.mods[0]), choice))
            if copy_ is None:  # a saved or given plan, another unit of the same shape, or a forced format
                copy_ = self._make_copy(unit, choice, self._unit_weight(unit))
                if copy_ is None:
                    raise RuntimeError(f"the plan serves {unit.key} at {rows} rows as a {choice.value} copy, "
                                       "which this device cannot build")
        if copy_ is not None:
            self.copies[(id(unit.mods[0]), choice)] = copy_
        return copy_

    def _set_route(self, route: dict[int, Route], rows: int | None) -> None:
        """Make ``route`` the pass's routing (planned for ``rows``; None: not a whole bucket's) and rebuild
        :attr:`group_calls`: the dense groups, and each multi-member unit that runs one copy of its members."""
        self.route, self.routed_rows = route, rows
        calls = dict(self.fused)
        for key, (choice, copy_) in route.items():
            unit = self.unit_of[key]
            if len(unit.mods) > 1 and copy_ is not None:
                calls[key] = GroupCall((choice, copy_), unit.bias, unit.sizes)
        self.group_calls = calls

    # -------------------------------------------------------------- copies, candidates, timing
    def _unit_weight(self, unit: _Unit) -> torch.Tensor:
        """The unit's dequantized weight ``[sum N, K]`` in the engine's dtype."""
        ws = [dequantize_nm_int4(m.packed, self.dtype) for m in unit.mods]
        return ws[0] if len(ws) == 1 else torch.cat(ws, 0)

    def _make_copy(self, unit: _Unit, choice: LinearChoice, w: torch.Tensor) -> Any:
        """``unit``'s copy in ``choice``'s format from its dequantized weight ``w``; None where this device
        cannot (the reason is logged once per format). Packed units: :meth:`_packed_copy`."""
        if choice is LinearChoice.DENSE:
            return w
        if choice is LinearChoice.SPARSE:
            return semi_structured_copy(w)
        layout = Fp8Layout.DENSE if choice is LinearChoice.FP8 else Fp8Layout.SPARSE_24
        why = fp8_supported(self.device, layout)
        if why is None:
            try:
                return quantize_weight_fp8(w, layout, unit.bias)
            except (RuntimeError, ValueError, ImportError) as exc:
                why = str(exc).splitlines()[0]
        if layout not in self._fp8_refused:
            self._fp8_refused.add(layout)
            log.info("no %s copies of compressed layers: %s", layout.value, why)
        return None

    def _packed_copy(self, unit: _Unit) -> Any:
        """A stackable unit's members' packed weights stacked into one (the kept copy, else a new one: the
        caller keeps it where the plan serves it); None for a unit that runs its members' own weights."""
        if not unit.stackable:
            return None
        stacked = self.copies.get((id(unit.mods[0]), LinearChoice.PACKED))
        return concat_packed([m.packed for m in unit.mods]) if stacked is None else stacked

    def _candidates(self, unit: _Unit, rows: int) -> list[LinearChoice]:
        """The formats ``unit`` may run in at ``rows`` rows under :attr:`formats`."""
        out = [LinearChoice.PACKED, LinearChoice.DENSE]
        if unit.sparse and rows >= SPARSE_MIN_ROWS:
            out.append(LinearChoice.SPARSE)
        # FP8 at every bucket: at 8 rows (one 8B query's beams) 2:4 FP8 beat the packed 2:4 INT4 kernel on
        # q/k/v, gate/up and down (10.9 / 33.4 / 21.3 vs 16.1 / 55.1 / 28.9 us; H100, 2026-12-06), although
        # it reads ~1.6x the bytes: the GEMV's dequantization, not HBM, bounds it there
        if self.formats is LinearFormats.FP8:
            out += [LinearChoice.FP8] + ([LinearChoice.SPARSE_FP8] if unit.sparse else [])
        return out

    def time_unit(self, unit: _Unit, key: tuple, rows: int) -> None:
        """Time every candidate format of ``unit`` at ``rows`` rows (graph-replayed, random normal input)
        and record the fastest accurate one in :attr:`plan` (copies of the winner are kept)."""
        from kernels.int4_tuner import time_graphed_ms

        x = torch.randn(rows, key[1], device=self.device, dtype=self.dtype)
        w = self._unit_weight(unit)
        timed: dict[LinearChoice, float] = {}
        errors: dict[LinearChoice, float] = {}
        kept: dict[LinearChoice, Any] = {}
        ref = x_fp8 = None
        for choice in self._candidates(unit, rows):
            if choice is LinearChoice.PACKED:
                stacked = self._packed_copy(unit)
                fn = ((lambda: [m(x) for m in unit.mods]) if stacked is None else
                      (lambda r=(choice, stacked): run_copy(r, x, unit.bias)))
                if stacked is not None:
                    kept[choice] = stacked
            else:
                copy_ = self.copies.get((id(unit.mods[0]), choice))
                copy_ = self._make_copy(unit, choice, w) if copy_ is None else copy_
                if copy_ is None:
                    continue
                # a q/k/v or gate/up unit served FP8 reads its rows quantized by the norm before it (the engine's
                # _add_norm): time what runs, the GEMM on rows quantized beforehand (once per unit); a unit of one
                # quantizes its own
                if choice in FP8_CHOICES and len(unit.mods) > 1 and x_fp8 is None:
                    x_fp8 = quantize_rows_fp8(x)
                xq = x_fp8 if choice in FP8_CHOICES else None
                fn = (lambda r=(choice, copy_), xq=xq: run_copy(r, x, unit.bias, xq))
                kept[choice] = copy_
            if choice in FP8_CHOICES:
                ref = F.linear(x, w, unit.bias) if ref is None else ref
                try:
                    errors[choice] = relative_error(fn(), ref)
                except RuntimeError as exc:
                    log.info("%s copy of %s not run: %s", choice.value, key[:3], str(exc).splitlines()[0])
                    continue
                if not errors[choice] <= FP8_MAX_REL_ERROR:  # also refuses nan
                    log.info("%s copy of %s refused: relative error %.4f > %.2f", choice.value, key[:3],
                             errors[choice], FP8_MAX_REL_ERROR)
                    continue
            try:
                timed[choice] = 1e3 * time_graphed_ms(fn, "warm")
            except RuntimeError as exc:  # e.g. a kernel that cannot be graph-captured
                log.info("%s copy of %s not timed: %s", choice.value, key[:3], str(exc).splitlines()[0])
        best = min(timed, key=timed.get)
        exact = {c: t for c, t in timed.items() if c not in FP8_CHOICES}
        if best not in exact and exact and timed[best] * FP8_MIN_SPEEDUP > min(exact.values()):
            best = min(exact, key=exact.get)
        self.plan.timings[key], self.plan.errors[key], self.plan.choice[key] = timed, errors, best
        if best in kept:
            self.copies[(id(unit.mods[0]), best)] = kept[best]
        log.info("linear %s at %d rows: %s -> %s", key[:3], rows,
                 ", ".join(f"{c.value} {t:.1f} us" for c, t in timed.items()), best.value)

    def _forced_choice(self, unit: _Unit) -> LinearChoice:
        choice = self.forced
        if not unit.sparse and choice is LinearChoice.SPARSE_FP8:
            return LinearChoice.FP8  # a dense-pattern layer has no 2:4 form
        if not unit.sparse and choice is LinearChoice.SPARSE:
            return LinearChoice.DENSE
        return choice


__all__ = ["LinearPlanner", "LinearPlan", "LinearChoice", "GroupCall", "FP8_CHOICES", "DEFAULT_LINEAR_FORMATS",
           "SPARSE_MIN_ROWS", "SPARSE_PATTERNS", "FP8_MAX_REL_ERROR", "FP8_MIN_SPEEDUP", "PLAN_FILE_VERSION",
           "semi_structured_copy", "run_copy", "group_bias", "plan_identity", "plan_path", "read_saved_plan",
           "save_plan"]
