"""Knowledge distillation for the sparse phase: the student also matches a frozen dense teacher.

Progressive 2:4/1:4 masks cost the DSI model 5-7 points of recall@10 on Home Depot even with the
quantization-aware phase (bench/results/train.md rounds 3-4); the cross-entropy on the one target
token of each position is a thin signal for re-learning what the pruned weights held. Distilling
from the converged dense model of the same index gives the student the teacher's whole next-token
distribution at every target position (Hinton et al. 2015, "Distilling the Knowledge in a Neural
Network"; the recipe pruning work such as Sparse-Llama/SquareHead uses to recover sparse models).

The loss at each target position is ``(1 - alpha) * CE(student, target) + alpha * T^2 *
KL(softmax(teacher / T) || softmax(student / T))`` (the ``T^2`` keeps the soft term's gradient scale
independent of the temperature). The teacher is a frozen copy of the model the run *starts from*,
so the run must start from a model already trained on this index (``init_model`` = yesterday's or a
dense run's output): a teacher that never saw the index would pull the student back to not knowing it.
Cost: one extra forward of the teacher per micro-batch (no backward), one more model in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from adbatch.config import ConfigBase, ConfigError


@dataclass
class DistillConfig(ConfigBase):
    """Distillation from a frozen copy of the starting model (off by default)."""

    enabled: bool = field(default=False, metadata={"help": "distil from a frozen copy of the starting model"})
    alpha: float = field(default=0.5, metadata={"help": "weight of the soft (teacher) term; 1 - alpha on the labels"})
    temperature: float = field(default=2.0, metadata={"help": "softmax temperature of both distributions"})

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"DistillConfig.alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise ConfigError(f"DistillConfig.temperature must be > 0, got {self.temperature}")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 config: DistillConfig) -> torch.Tensor:
    """Mean over the ``n`` target positions of the mixed loss in the module docstring.

    ``student_logits`` / ``teacher_logits``: float ``[n, V]`` (the teacher's without grad);
    ``targets``: int64 ``[n]``. Returns a scalar.
    """
    ce = F.cross_entropy(student_logits, targets)
    if config.alpha == 0.0:
        return ce
    t = config.temperature
    soft = F.kl_div(F.log_softmax(student_logits / t, -1), F.log_softmax(teacher_logits / t, -1),
                    log_target=True, reduction="batchmean") * (t * t)
    return (1.0 - config.alpha) * ce + config.alpha * soft
