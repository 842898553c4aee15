"""Rules whose owner is a package above the config, each a call of the owner's pure check (the
same check its constructor runs once process groups exist): the token dispatcher
(:mod:`paratron.models.moe.dispatcher`), the learning-rate schedule (:mod:`paratron.optim.lr`),
the loss scaler (:mod:`paratron.optim.scaler`), the ZeRO level (:mod:`paratron.optim.zero`) and
the checkpoint manager (:mod:`paratron.checkpoint.manager`).

Each rule takes ``(cfg, world_size_or_None)`` and raises :class:`ConfigError` with the owner's
message, which names the field.
"""

from __future__ import annotations

from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import check_checkpoint_config
from paratron.config.sections import Config
from paratron.errors import ConfigError
from paratron.models.moe.dispatcher import check_dispatcher_config, get_dispatcher
from paratron.models.moe.prefetch import check_expert_tensor
from paratron.optim.lr import check_lr_config
from paratron.optim.scaler import check_loss_scale_config
from paratron.optim.zero import check_zero_level


def _owned(check, *args) -> None:
    """Run an owner's check, its error as a :class:`ConfigError` (the message is the owner's)."""
    try:
        check(*args)
    except ConfigError:
        raise
    except (ValueError, CheckpointError) as e:
        raise ConfigError(str(e)) from None


def _lr_schedule(cfg: Config, world: int | None) -> None:
    _owned(check_lr_config, cfg.optimizer, cfg.train.train_iters)


def _loss_scale(cfg: Config, world: int | None) -> None:
    if cfg.train.precision == "fp16":  # the one precision that builds a DynamicLossScaler
        _owned(check_loss_scale_config, cfg.optimizer)


def _zero(cfg: Config, world: int | None) -> None:
    _owned(check_zero_level, cfg.parallel.zero)


def _checkpoint(cfg: Config, world: int | None) -> None:
    _owned(check_checkpoint_config, cfg.checkpoint)


def _dispatcher(cfg: Config, world: int | None) -> None:
    if cfg.model.num_experts:
        # The token dispatcher's own rules (e.g. alltoall_chunked refuses padding to capacity).
        check_dispatcher_config(cfg.model)
        if cfg.model.moe_token_dispatcher == "prefetch":  # its one rule on the parallel section
            check_expert_tensor(cfg.parallel.expert_tensor)


def _moe_fb_overlap(cfg: Config, world: int | None) -> None:
    if not cfg.parallel.overlap_moe_expert_parallel_comm:
        return
    name = cfg.model.moe_token_dispatcher
    if not cfg.model.num_experts:
        raise ConfigError("parallel.overlap_moe_expert_parallel_comm=true overlaps one microbatch's MoE "
                          "all-to-alls with another's backward, but model.num_experts=0 has none")
    if cfg.parallel.zero == 3:
        # ZeRO-3 frees a layer's gathered params after its forward and after its backward, which
        # assumes one microbatch at a time in a layer; a pair runs another's backward mid-forward.
        raise ConfigError("parallel.overlap_moe_expert_parallel_comm=true runs one microbatch's backward "
                          "in the middle of another's forward, but parallel.zero=3 frees each layer's "
                          "params after its forward and backward: use parallel.zero <= 2")
    if not getattr(get_dispatcher(name), "overlaps_microbatches", False):
        raise ConfigError(f"parallel.overlap_moe_expert_parallel_comm=true needs a token dispatcher that runs "
                          f"the other microbatch's work while its all-to-alls are in flight; "
                          f"model.moe_token_dispatcher={name!r} does not (use 'alltoall')")
