"""Compressed checkpoints: safetensors shards + recipe.json + manifest.json (sha256 per shard).

Layout of ``DIR``::

    config.json, tokenizer files      the HF model config and tokenizer (save_pretrained)
    dense.safetensors                 every tensor not in a CompressedLinear (embeddings, norms,
                                      lm_head unless tied), cast to ``config.dense_dtype``
    packed-00000.safetensors, ...     CompressedLinear tensors: ``{layer}.{qweight|qpos|scale_zero|
                                      group_ptr|group_shift|bias}``, layers in model order
    recipe.json                       CompressionRecipe (per layer: pattern, group sizes, packed metadata)
    manifest.json                     stage manifest; ``shards``: file -> {sha256, bytes, tensors:
                                      {key: [dtype, shape]}}

Loading verifies every shard's size (truncation), sha256 (edits) and every tensor's dtype/shape
against the manifest and the model built from config.json, and the sha256 of recipe.json, config.json,
generation_config.json and the tokenizer files, and fails naming the file and tensor.
No pickle anywhere: safetensors and JSON only.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from adbatch.artifacts import atomic_path, build_manifest, read_manifest, sha256_file, write_json_atomic
from adbatch.compress.linear import CompressedLinear, _set_module
from adbatch.compress.recipe import CompressionRecipe
from adbatch.models import refuse_custom_code, serving_dtype
from kernels.nm_int4 import PackedNMInt4

log = logging.getLogger(__name__)

__all__ = ["save_compressed", "load_compressed", "verify_checkpoint", "CheckpointError",
           "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "adbatch.compressed/1"
DENSE_SHARD = "dense.safetensors"
RECIPE_NAME = "recipe.json"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CheckpointError(ValueError):
    """A compressed checkpoint is missing, truncated, edited or does not match its model."""


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": CHECKPOINT_FORMAT})
    return {
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
        "tensors": {k: [_dtype_name(v), list(v.shape)] for k, v in sorted(tensors.items())},
    }


def save_compressed(model: nn.Module, tokenizer: Any, recipe: CompressionRecipe, directory: str | Path,
                    extra_manifest: dict[str, Any] | None = None, folders: Mapping[str, Path] | None = None
                    ) -> dict[str, Any]:
    """Write a compressed model (after :func:`compress_`) to ``directory``; returns the manifest.

    ``folders``: name -> a folder of the source model copied in under that name (the tuned query embedder),
    every file hashed in the manifest like the side files.

    The manifest is written last, so a directory without one is an unfinished checkpoint.
    """
    t0 = time.perf_counter()
    if tokenizer is None:  # load_compressed always loads one: a checkpoint without it could not be opened
        raise ValueError("save_compressed needs the model's tokenizer")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    compressed = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLinear)}
    if not compressed:
        raise ValueError("model has no CompressedLinear layers: run compress_ first")
    recipe_names = [x.name for x in recipe.layers]
    if sorted(recipe_names) != sorted(compressed):
        raise ValueError("recipe layers and the model's CompressedLinear layers differ")
    dense_dtype = _DTYPES[recipe.config.dense_dtype]
    # dense remainder, deduplicating tied tensors (safetensors refuses shared storage; tie on load)
    dense: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    tied_keys: dict[str, str] = {}
    prefixes = tuple(n + "." for n in compressed)
    for key, t in model.state_dict(keep_vars=False).items():
        if key.startswith(prefixes):
            continue
        ptr = t.data_ptr()
        if ptr in seen and t.numel() > 0:
            tied_keys[key] = seen[ptr]
            continue
        seen[ptr] = key
        dense[key] = t.to(dense_dtype) if t.is_floating_point() else t
    shards: dict[str, Any] = {DENSE_SHARD: _save_shard(dense, out / DENSE_SHARD)}
    # packed layers, in model order, cut into shards of at most shard_max_bytes
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for rec in recipe.layers:
        mod = compressed[rec.name]
        tensors = {f"{rec.name}.{k}": getattr(mod, k) for k in CompressedLinear.PACKED_KEYS}
        if mod.bias is not None:
            tensors[f"{rec.name}.bias"] = mod.bias
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if groups[-1] and size + nbytes > recipe.config.shard_max_bytes:
            groups.append({})
            size = 0
        groups[-1].update(tensors)
        size += nbytes
        rec.packed_metadata = dict(mod.packed.metadata())
    for i, tensors in enumerate(groups):
        name = f"packed-{i:05d}.safetensors"
        shards[name] = _save_shard(tensors, out / name)
        for rec in recipe.layers:
            if f"{rec.name}.qweight" in tensors:
                rec.shard = name
    side_files = []  # what save_pretrained writes beside the shards: hashed like them
    if hasattr(model, "config"):
        model.config.save_pretrained(out)
        side_files.append("config.json")
    if getattr(model, "generation_config", None) is not None:
        # extra EOS ids (e.g. Llama-3 / Qwen2.5 instruct <|eot_id|>), pad id, sampling defaults
        model.generation_config.save_pretrained(out)
        side_files.append("generation_config.json")
    # the tokenizer decides what every token id means: an edited tokenizer.json must not load silently
    side_files += [Path(f).name for f in tokenizer.save_pretrained(out) if Path(f).parent == out]
    for name, folder in (folders or {}).items():
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(folder, out / name)
        side_files += sorted(str(p.relative_to(out)) for p in (out / name).rglob("*") if p.is_file())
    write_json_atomic(out / RECIPE_NAME, recipe.to_dict())
    hashed = {RECIPE_NAME: sha256_file(out / RECIPE_NAME)}
    for name in side_files:
        if (out / name).is_file():
            hashed[name] = sha256_file(out / name)
    manifest = build_manifest(
        stage="compress",
        config=recipe.config,
        inputs={},
        outputs={name: s["sha256"] for name, s in shards.items()} | hashed,
        counts={"compressed_layers": len(recipe.layers), "shards": len(shards)},
        timings={"save": time.perf_counter() - t0},
        extra={"format": CHECKPOINT_FORMAT, "shards": shards, "tied_keys": tied_keys, **(extra_manifest or {})},
    )
    write_json_atomic(out / "manifest.json", manifest)
    return manifest


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Check every shard's presence, size and sha256 and the hashes of recipe.json, config.json and the
    other listed side files (generation config, tokenizer); returns the manifest.

    Raises :class:`CheckpointError` naming the first bad file.
    """
    d = Path(directory)
    try:
        manifest = read_manifest(d)
    except FileNotFoundError as exc:
        raise CheckpointError(str(exc)) from None
    except ValueError as exc:  # json.JSONDecodeError: an edited or truncated manifest
        raise CheckpointError(f"{d}/manifest.json: not valid JSON ({exc})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{d}/manifest.json: format {manifest.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    if not isinstance(manifest.get("shards"), dict) or not isinstance(manifest.get("outputs"), dict):
        raise CheckpointError(f"{d}/manifest.json: no 'shards' / 'outputs' tables: not a compressed checkpoint manifest")
    # hashes listed by the manifest prove only that the files are the ones it was written with, not who
    # wrote it: a config.json / tokenizer_config.json declaring custom code is refused all the same
    refuse_custom_code(d)
    for name, info in manifest["shards"].items():
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in manifest.json is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, manifest.json says {info['bytes']} (truncated or replaced)")
        digest = sha256_file(path)
        if digest != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 {digest[:16]}... != manifest {info['sha256'][:16]}... (file was modified)")
    for name in (RECIPE_NAME, "config.json"):
        if name not in manifest["outputs"]:
            raise CheckpointError(f"{d}/manifest.json has no sha256 for {name}")
    # recipe, config, generation config, tokenizer files (those of checkpoints written before the
    # tokenizer was hashed are not listed, so not checked)
    for name, expect in manifest["outputs"].items():
        if name in manifest["shards"]:
            continue
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in manifest.json)")
        if sha256_file(path) != expect:
            raise CheckpointError(f"{path}: sha256 differs from manifest.json (file was modified)")
    return manifest


def _load_shard(path: Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    listed = info["tensors"]
    if sorted(tensors) != sorted(listed):
        extra = sorted(set(tensors) - set(listed))
        missing = sorted(set(listed) - set(tensors))
        raise CheckpointError(f"{path}: tensors differ from manifest.json (missing {missing[:5]}, extra {extra[:5]})")
    for key, t in tensors.items():
        dtype, shape = listed[key]
        if _dtype_name(t) != dtype or list(t.shape) != list(shape):
            raise CheckpointError(f"{path}: tensor {key} is {_dtype_name(t)} {list(t.shape)}, manifest.json says {dtype} {shape}")
    return tensors


def load_compressed(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """Load a compressed checkpoint into a ready ``(model, tokenizer)`` (eval mode, on ``device``).

    ``dtype`` of the dense remainder defaults to float32 on CPU and bfloat16 on CUDA. Raises
    :class:`CheckpointError` on a missing, truncated, edited or mismatched checkpoint.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = Path(directory)
    manifest = verify_checkpoint(d)
    recipe = CompressionRecipe.from_dict(json.loads((d / RECIPE_NAME).read_text()))
    if dtype is None:
        dtype = serving_dtype(device)
    hf_config = AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=False)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in manifest["shards"].items():
        tensors.update(_load_shard(d / name, info))
    for rec in recipe.layers:
        try:
            lin = model.get_submodule(rec.name)
        except AttributeError:
            raise CheckpointError(f"recipe layer {rec.name} does not exist in the model built from config.json") from None
        if not isinstance(lin, nn.Linear) or (lin.out_features, lin.in_features) != (rec.out_features, rec.in_features):
            raise CheckpointError(
                f"layer {rec.name}: checkpoint is [{rec.out_features}, {rec.in_features}], the model from "
                f"config.json has {type(lin).__name__} {getattr(lin, 'out_features', '?')}x{getattr(lin, 'in_features', '?')}")
        packed_t = {}
        for k in CompressedLinear.PACKED_KEYS:
            key = f"{rec.name}.{k}"
            if key not in tensors:
                raise CheckpointError(f"tensor {key} missing from the shards")
            packed_t[k] = tensors.pop(key)
        try:
            packed = PackedNMInt4.from_state_dict(packed_t, rec.packed_metadata)
        except ValueError as exc:
            raise CheckpointError(f"layer {rec.name}: packed tensors do not match the recipe ({exc})") from exc
        if packed.out_features != rec.out_features or packed.in_features != rec.in_features:
            raise CheckpointError(f"layer {rec.name}: packed metadata shape differs from the recipe")
        bias = tensors.pop(f"{rec.name}.bias", None)
        if (bias is None) != (lin.bias is None):
            raise CheckpointError(f"layer {rec.name}: bias presence differs from the model built from config.json")
        _set_module(model, rec.name, CompressedLinear(packed, None if bias is None else bias.to(dtype)))
    expected = model.state_dict()
    for key, t in tensors.items():
        if key not in expected:
            raise CheckpointError(f"{DENSE_SHARD}: tensor {key} is not in the model built from config.json")
        if tuple(expected[key].shape) != tuple(t.shape):
            raise CheckpointError(f"{DENSE_SHARD}: tensor {key} has shape {list(t.shape)}, model expects {list(expected[key].shape)}")
    tied = manifest.get("tied_keys", {})
    missing = [k for k in expected if k not in tensors and k not in tied
               and not any(k.startswith(r.name + ".") for r in recipe.layers)]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors {missing[:5]} the model needs")
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    model.load_state_dict(state, strict=False)
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()
    if (d / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(d, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return model, tokenizer
