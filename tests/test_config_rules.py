"""Every rule before rendezvous, written once: a rule owned by the optimizer, the loss scaler or
the checkpoint manager is a pure check that the config rules (:mod:`paratron.rules`) and the
owner's constructor both call, so ``paratron train`` refuses a bad value before any process
group exists, with the message that names the field."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from paratron import cli
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.config import CheckpointConfig, ConfigError
from paratron.optim.lr import build_lr_scheduler
from paratron.optim.scaler import DynamicLossScaler
from paratron.rules import load_config, validate

BAD = {
    "optimizer.lr_wsd_decay_iters": (["optimizer.lr_decay_style=wsd", "train.train_iters=100",
                                      "optimizer.lr_warmup_iters=10", "optimizer.lr_wsd_decay_iters=95"],
                                     r"optimizer.lr_wsd_decay_iters=95 must be in \(0, lr_decay_iters - "
                                     r"lr_warmup_iters = 90\]"),
    "optimizer.min_loss_scale": (["train.precision=fp16", "optimizer.min_loss_scale=0"],
                                 r"optimizer.min_loss_scale=0.0 must be > 0"),
    "checkpoint.keep_last": (["checkpoint.keep_last=-1"], r"checkpoint.keep_last=-1 must be >= 0"),
}


@pytest.fixture
def no_groups(monkeypatch):
    """Fails the test on any process group (the default one or a new one)."""
    made = []

    def refuse(name):
        def fn(*args, **kwargs):
            made.append(name)
            raise AssertionError(f"{name} called before the config was refused")
        return fn

    monkeypatch.setattr(dist, "init_process_group", refuse("init_process_group"))
    monkeypatch.setattr(dist, "new_group", refuse("new_group"))
    return made


@pytest.mark.parametrize("field", sorted(BAD))
def test_train_refuses_before_any_process_group(field, no_groups, capsys, tmp_path, monkeypatch):
    overrides, message = BAD[field]
    # As rank 0 of a 2-rank torchrun: past validation the command would set up its process groups.
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(k, v)
    argv = ["train", "--run-dir", str(tmp_path / "run")]
    for o in overrides:
        argv += ["--set", o]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "config error" in err and field in err, err
    assert no_groups == [] and not dist.is_initialized()
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides), 2)


def test_the_constructors_run_the_same_checks():
    cfg = load_config(None, BAD["optimizer.lr_wsd_decay_iters"][0])
    with pytest.raises(ValueError, match=BAD["optimizer.lr_wsd_decay_iters"][1]):
        build_lr_scheduler(cfg.optimizer, cfg.train.train_iters)
    with pytest.raises(ValueError, match=BAD["optimizer.min_loss_scale"][1]):
        DynamicLossScaler(min_scale=0.0)
    with pytest.raises(CheckpointError, match=BAD["checkpoint.keep_last"][1]):
        CheckpointManager(CheckpointConfig(keep_last=-1), None, None)


def test_loss_scale_rules_apply_to_fp16_only():
    validate(load_config(None, ["optimizer.min_loss_scale=0"]), 1)  # fp32 builds no dynamic scaler
    with pytest.raises(ConfigError, match="optimizer.min_loss_scale=131072.0 must be <= optimizer.initial_loss_scale"):
        validate(load_config(None, ["train.precision=fp16", "optimizer.min_loss_scale=131072"]), 1)


def test_config_error_has_one_home():
    from paratron import errors, registry
    from paratron.config import errors as config_errors

    assert config_errors.ConfigError is errors.ConfigError is ConfigError
    with pytest.raises(errors.ConfigError, match="not a registered thing"):
        registry.Registry("thing", "x.thing").get("nope")
