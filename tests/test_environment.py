"""The installed environment does not shadow our top-level packages.

Our Triton kernels live in the top-level package ``kernels`` (the repository's fixed layout). Hugging Face
publishes a distribution with the same import name, which transformers >= 5.25 requires. With both installed,
transformers finds that distribution's version but imports *our* package under its name, and every
``AutoConfig`` / ``AutoTokenizer`` / model load fails with ``cannot import name 'CUDAProperties' from
'kernels'`` (CI, 2026-12-03). pyproject.toml pins transformers below 5.25 and scripts/setup_env.sh removes a
stale copy; these tests name the cause if either ever regresses.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_no_foreign_kernels_distribution_is_installed():
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    pytest.fail(
        f"Hugging Face's `kernels` {version} is installed: its import name collides with this repository's "
        "kernels/ package, so transformers imports ours in its place. Pin transformers below 5.25 "
        "(pyproject.toml) and `pip uninstall kernels` (scripts/setup_env.sh does)."
    )


def test_kernels_imports_from_this_repository_and_transformers_does_not_take_it_for_hub_kernels():
    import kernels
    from transformers.utils import import_utils

    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert not import_utils.is_kernels_available()


def test_a_tokenizer_and_config_load_with_our_kernels_package_on_the_path(tmp_path):
    """The failing call in CI: AutoConfig resolving a model type (it imports the modeling integrations)."""
    from transformers import AutoConfig, LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(str(tmp_path), local_files_only=True).model_type == "llama"


def test_lazy_package_members_load_on_first_access_and_unknown_names_still_fail():
    """adbatch.decoding / adbatch.training defer their torch modules (adbatch.lazy): a deferred name
    resolves to the submodule's object, and a misspelt one is an AttributeError, not None."""
    import adbatch.decoding as decoding
    import adbatch.training as training
    from adbatch.decoding.beam_search import search_targets
    from adbatch.training.trainer import TrainConfig

    assert decoding.search_targets is search_targets and training.TrainConfig is TrainConfig
    with pytest.raises(AttributeError, match="no attribute 'search_target'"):
        decoding.search_target  # noqa: B018
    assert set(decoding.__all__) <= set(dir(decoding)) | set(decoding._LAZY)
