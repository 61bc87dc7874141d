"""Train the ad index into the model (DSI), optionally with progressive N:M sparsity.

Public verb: :func:`train_on_index` (index + ad texts + labelled queries -> trained model folder), in
:mod:`.index_training` with the rest of the stage's logic (model preparation, examples, the query-embedder
tuning and the fusion fit). Pieces: :mod:`.data` (examples), :mod:`.trainer` (loop, :class:`TrainConfig`),
:mod:`.sparsity` (progressive N:M), :mod:`.vocab` (code tokens), :mod:`.checkpoint` (folder + index binding).
This file is the package's face: it only re-exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adbatch.lazy import lazy_members
from adbatch.training.checkpoint import (IndexMismatchError, check_index_compat, load_masks,
                                         read_training_record, save_trained)
from adbatch.training.index_training import (TrainSummary, check_index_tokenizer, default_ad_texts, index_examples,
                                             prepare_model_for_index, scheme_name, train_on_index)

# The configs below live beside the torch code that reads them. They load at first access (PEP 562),
# so a process that only checks a model's training record (a generate job's driver imports
# adbatch.training.checkpoint) does not import torch.
_LAZY = {"DistillConfig": "distill", "QuantAwareConfig": "quant_aware", "RankLossConfig": "rank_loss",
         "SparsityScheduleConfig": "sparsity", "TrainConfig": "trainer"}

if TYPE_CHECKING:
    from adbatch.training.distill import DistillConfig
    from adbatch.training.quant_aware import QuantAwareConfig
    from adbatch.training.rank_loss import RankLossConfig
    from adbatch.training.sparsity import SparsityScheduleConfig
    from adbatch.training.trainer import TrainConfig

__getattr__ = lazy_members(__name__, _LAZY)

__all__ = ["TrainConfig", "SparsityScheduleConfig", "QuantAwareConfig", "DistillConfig", "RankLossConfig",
           "train_on_index", "TrainSummary",
           "check_index_compat",
           "IndexMismatchError", "read_training_record", "load_masks", "save_trained", "scheme_name"]
