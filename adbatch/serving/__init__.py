"""The generate stage's library side: request validation (``requests``), the prompts a model reads
for targeting, creatives and query generation (``prompts``; training renders the same ones), and the
per-batch generators a generate actor runs (``generators``). See docs/generate.md. Members load at
first access (PEP 562): the driver validates requests without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adbatch.lazy import lazy_members

#: public name -> the submodule that defines it (imported at first access)
_LAZY = {
    "GenerateTask": "requests", "RequestValidationConfig": "requests", "validate_requests": "requests",
    "list_request_files": "requests",
    "CreativePrompt": "prompts", "encode_targeting_prompt": "prompts", "encode_targeting_prompts": "prompts",
    "encode_creative_prompt": "prompts",
    "GenerateConfig": "generators", "ModelSpec": "generators", "TargetGenerator": "generators",
    "CreativeGenerator": "generators", "load_model": "generators",
}

if TYPE_CHECKING:
    from adbatch.serving.generators import CreativeGenerator, GenerateConfig, ModelSpec, TargetGenerator, load_model
    from adbatch.serving.prompts import (CreativePrompt, encode_creative_prompt, encode_targeting_prompt,
                                         encode_targeting_prompts)
    from adbatch.serving.requests import GenerateTask, RequestValidationConfig, list_request_files, validate_requests

__getattr__ = lazy_members(__name__, _LAZY)

__all__ = sorted(_LAZY)
