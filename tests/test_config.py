"""Config loading, overrides, Megatron aliases, and every validation rule's message."""

import subprocess
import sys

import pytest
import torch.distributed as dist

from paratron.config import ConfigError, megatron_overrides, to_toml
from paratron.rules import build_config, load_config, validate


def cfg_with(*overrides):
    return load_config(None, list(overrides))


def test_overrides_are_typed_by_field():
    cfg = cfg_with("parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.lr=1e-3",
                   "model.num_query_groups=none", "data.data_path=0.7 a 0.3 b",
                   "parallel.pipeline_layout=1,2,1")
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.lr == 1e-3 and cfg.model.num_query_groups is None
    assert cfg.data.data_path == ["0.7", "a", "0.3", "b"]
    assert cfg.parallel.pipeline_layout == [1, 2, 1]


def test_overrides_parse_as_toml_values():
    """``--set key=[1,2,3]``, ``key="text"`` and ``key=true`` read as TOML values; the
    older forms (``1,2,3``, bare words) keep working."""
    cfg = cfg_with("parallel.pipeline_layout=[2,0,3,3]", "data.data_path=[\"a\", \"0.5\", \"b\"]",
                   "train.sample_prompt=\"KING: \"", "parallel.sequence_parallel=true",
                   "data.json_key='content'")
    assert cfg.parallel.pipeline_layout == [2, 0, 3, 3]
    assert cfg.data.data_path == ["a", "0.5", "b"]
    assert cfg.train.sample_prompt == "KING: " and cfg.parallel.sequence_parallel is True
    assert cfg.data.json_key == "content"
    assert cfg_with("parallel.pipeline_layout=[ 2, 0 ]").parallel.pipeline_layout == [2, 0]
    assert cfg_with("data.data_path=[a, b]").data.data_path == ["a", "b"]  # bare words: not TOML
    with pytest.raises(ConfigError, match="must be an integer"):
        cfg_with("parallel.pipeline_layout=[1, \"x\"]")


def test_zbv_implies_two_virtual_stages(tmp_path):
    assert cfg_with("parallel.schedule=zbv").parallel.virtual_pipeline == 2
    p = tmp_path / "z.toml"
    p.write_text('[parallel]\nschedule = "zbv"\n')
    assert load_config(p).parallel.virtual_pipeline == 2
    # A value given explicitly stays, and validation refuses it with the rule.
    assert cfg_with("parallel.schedule=zbv", "parallel.virtual_pipeline=1").parallel.virtual_pipeline == 1
    validate(cfg_with("parallel.schedule=zbv", "parallel.pipeline=2", "model.num_layers=4"), 2)


def test_finetune_without_a_checkpoint_warns():
    from paratron.config.validators import config_warnings

    (line,) = config_warnings(cfg_with("checkpoint.finetune=true"))
    assert "checkpoint.finetune=true without checkpoint.load" in line
    assert config_warnings(cfg_with("checkpoint.finetune=true", "checkpoint.load=ckpt")) == []


def test_sequence_parallel_without_tensor_parallelism_warns():
    from paratron.config.validators import config_warnings

    (line,) = config_warnings(cfg_with("parallel.sequence_parallel=true"))
    assert "parallel.sequence_parallel=true with parallel.tensor=1" in line
    assert config_warnings(cfg_with("parallel.sequence_parallel=true", "parallel.tensor=2")) == []


def test_warmup_longer_than_the_run_warns_once(capsys, monkeypatch):
    from paratron.config.validators import config_warnings
    from paratron.launch.command import print_config_warnings

    cfg = validate(cfg_with("train.train_iters=4", "optimizer.lr_warmup_iters=30"), 1)
    (line,) = config_warnings(cfg)
    assert "optimizer.lr_warmup_iters=30 > train.train_iters=4" in line
    assert config_warnings(cfg_with("train.train_iters=40", "optimizer.lr_warmup_iters=30")) == []
    monkeypatch.delenv("PARATRON_CONFIG_WARNED", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    print_config_warnings(cfg, launching=True)  # the launcher prints, its ranks stay quiet
    monkeypatch.setenv("RANK", "0")
    print_config_warnings(cfg, launching=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paratron: warning: optimizer.lr_warmup_iters=30")


def test_public_override_keys_exist():
    keys = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.virtual_pipeline=1",
            "parallel.expert=1", "parallel.context=1", "parallel.sequence_parallel=false",
            "parallel.zero=1", "parallel.schedule=zbv", "train.train_iters=3", "train.seed=7",
            "train.micro_batch_size=2", "train.global_batch_size=8", "checkpoint.save=/tmp/x",
            "checkpoint.load=/tmp/y", "checkpoint.interval=5"]
    cfg = cfg_with(*keys)
    assert cfg.parallel.schedule == "zbv" and cfg.checkpoint.interval == 5


def test_toml_round_trip(tmp_path):
    cfg = cfg_with("model.num_layers=6", "train.callbacks=a:B", "parallel.pipeline_layout=2,4")
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    again = load_config(p)
    assert again == cfg


@pytest.mark.parametrize("override,msg", [
    ("model.num_layer=3", "unknown config key 'model.num_layer' (did you mean 'model.num_layers'?)"),
    ("modle.num_layers=3", "unknown config section 'modle' (did you mean 'model'?)"),
    ("train.tensor=2", "unknown config key 'train.tensor' (did you mean 'parallel.tensor'?)"),
    ("parallel.tensor=two", "parallel.tensor='two' must be an integer"),
    ("parallel.sequence_parallel=maybe", "must be true or false"),
    ("model.normalization=batchnorm", "must be one of 'layernorm', 'rmsnorm'"),
])
def test_override_errors(override, msg):
    with pytest.raises(ConfigError) as e:
        cfg_with(override)
    assert msg in str(e.value)


def test_unknown_key_in_toml_names_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[model]\nhidden_sizee = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown config key 'model.hidden_sizee' \(did you mean"):
        load_config(p)


@pytest.mark.parametrize("overrides,world,msg", [
    (["model.num_attention_heads=6", "model.hidden_size=48", "parallel.tensor=4"], 4,
     "model.num_attention_heads=6 is not divisible by parallel.tensor=4"),
    (["model.num_attention_heads=8", "model.num_query_groups=3"], 1,
     "model.num_attention_heads=8 is not divisible by model.num_query_groups=3"),
    (["model.num_attention_heads=8", "model.num_query_groups=2", "parallel.tensor=4"], 4,
     "model.num_query_groups=2 is not divisible by parallel.tensor=4"),
    (["parallel.tensor=2", "parallel.pipeline=2"], 6,
     "world size 6 is not divisible by parallel.tensor*parallel.context*parallel.pipeline = 2*1*2 = 4"),
    (["parallel.tensor=0"], 1, "parallel.tensor=0 must be a positive integer"),
    (["parallel.pipeline=-1"], 1, "parallel.pipeline=-1 must be a positive integer"),
    (["train.global_batch_size=6", "train.micro_batch_size=2"], 2,
     "train.global_batch_size=6 is not divisible by train.micro_batch_size*dp = 2*2"),
    (["parallel.sequence_parallel=true", "parallel.tensor=4", "model.seq_length=30"], 4,
     "model.seq_length=30 is not divisible by parallel.tensor=4"),
    (["model.num_layers=5", "parallel.pipeline=2"], 2,
     "model.num_layers=5 is not divisible by parallel.pipeline*virtual_pipeline = 2*1 = 2"),
    (["parallel.pipeline_layout=1,1"], 1, "has 2 entries; it needs parallel.pipeline*virtual_pipeline = 1"),
    (["parallel.schedule=zbv", "parallel.pipeline=2", "parallel.virtual_pipeline=3"], 2,
     "parallel.virtual_pipeline=3 was given: leave it unset or set parallel.virtual_pipeline=2"),
    (["parallel.schedule=1fb1"], 1, "parallel.schedule='1fb1' is not a registered schedule (did you mean '1f1b'?)"),
    (["parallel.virtual_pipeline=2", "model.num_layers=4"], 1, "schedule '1f1b' runs one model chunk per rank"),
    (["model.num_experts=6", "parallel.expert=4"], 4, "model.num_experts=6 is not divisible by parallel.expert=4"),
    (["parallel.expert=2"], 2, "parallel.expert=2 needs model.num_experts > 0"),
    (["parallel.zero=4"], 1, "parallel.zero=4 must be 0 (DDP), 1 (optimizer state sharded)"),
    (["data.split=9,x"], 1, "data.split='9,x' must be comma-separated numbers"),
])
def test_validation_errors_before_any_group(overrides, world, msg):
    cfg = cfg_with(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    assert msg in str(e.value)
    assert not dist.is_initialized()


def test_default_config_is_valid_for_one_rank():
    validate(cfg_with(), 1)


def test_megatron_aliases():
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2", "--sequence-parallel",
            "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2", "--data-path", "0.5", "a",
            "0.5", "b", "--lr", "1e-4", "--train-iters", "7", "--seed", "3", "--save", "/tmp/s",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--load", "/tmp/l",
            "--expert-model-parallel-size", "1", "--config", "x.toml"]
    overrides, rest = megatron_overrides(argv)
    assert rest == ["--config", "x.toml"]
    cfg = build_config(None, overrides)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.sequence_parallel) == (2, 2, True)
    assert cfg.parallel.virtual_pipeline == 2 and cfg.parallel.schedule == "interleaved"
    assert cfg.data.data_path == ["0.5", "a", "0.5", "b"]
    assert (cfg.optimizer.lr, cfg.train.train_iters, cfg.train.seed) == (1e-4, 7, 3)
    assert (cfg.checkpoint.save, cfg.checkpoint.load) == ("/tmp/s", "/tmp/l")
    assert (cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.seq_length) == (64, 4, 32)


@pytest.mark.parametrize("given,expected", [
    (["--cp-comm-type", "a2a"], "all2all"), (["--cp-comm-type=p2p"], "ring"),
    (["parallel.cp_comm_type=a2a"], "all2all"), (["parallel.context_algorithm=all2all"], "all2all"),
])
def test_megatron_cp_comm_type_names_context_algorithm(given, expected):
    overrides, rest = megatron_overrides(given)
    cfg = build_config(None, overrides + rest)
    assert cfg.parallel.context_algorithm == expected


def test_megatron_cp_comm_type_not_built_is_refused():
    with pytest.raises(ConfigError, match=r"context_algorithm='allgather' must be one of 'ring', 'all2all' "
                                          r"\(Megatron-Core's 'p2p' for 'ring', 'a2a' for 'all2all'"):
        build_config(None, megatron_overrides(["--cp-comm-type", "allgather"])[0])


def test_cli_reports_config_error_without_launching(tmp_path):
    # world = 3 ranks cannot hold tp=2: the launcher must refuse before starting torchrun.
    r = subprocess.run([sys.executable, "-m", "paratron", "train", "--nproc-per-node", "3",
                        "--set", "parallel.tensor=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "world size 3 is not divisible by parallel.tensor*parallel.context*parallel.pipeline" in r.stderr
    assert "torch.distributed.run" not in r.stderr


def test_toml_round_trip_of_strings_with_control_characters(tmp_path):
    """A prompt with a newline used to be written raw into a one-line TOML string: the run's and the
    checkpoint's config.toml could not be read back."""
    cfg = cfg_with('train.sample_prompt="ROMEO:\\nJULIET:\\t\\"hi\\" \\\\ \\u007f é"')
    assert cfg.train.sample_prompt == 'ROMEO:\nJULIET:\t"hi" \\ \x7f é'
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(p) == cfg
