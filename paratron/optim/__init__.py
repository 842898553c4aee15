"""Data parallelism and the optimizer: grad buffers and buckets (DDP), ZeRO stages 1-3, mixed precision,
loss scaling, global clipping, LR schedules. See each module's docstring."""

from .ddp import DistributedDataParallel
from .finalize import finalize_grads
from .lr import LRScheduler, build_lr_scheduler
from .optimizer import Optimizer, StepResult, build_optimizer
from .precision import precision_dtype
from .scaler import ConstantLossScaler, DynamicLossScaler
from .zero import model_state_bytes_per_rank

__all__ = ["DistributedDataParallel", "finalize_grads", "LRScheduler", "build_lr_scheduler",
           "Optimizer", "StepResult", "build_optimizer", "precision_dtype", "ConstantLossScaler", "DynamicLossScaler",
           "model_state_bytes_per_rank"]
