"""The config reference generated from the dataclasses: ``docs/config.md`` is current, every field
has a docstring, ``paratron config --list`` / ``--show``, and ``--help`` texts without reST markup."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from paratron import markup
from paratron.cli import COMMANDS, main
from paratron.config import SECTIONS, Config, from_dict
from paratron.rules import load_config
from paratron.config.reference import MARKDOWN_COMMAND, field_docs, keys, markdown_reference, section_classes

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_the_generated_text():
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == markdown_reference(), f"docs/config.md is stale: regenerate it with `{MARKDOWN_COMMAND}`"


def test_markdown_is_deterministic():
    assert markdown_reference() == markdown_reference()


def test_every_config_field_has_a_docstring():
    missing = [f"{cls.__name__}.{f.name}" for cls in [Config, *section_classes().values()]
               for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name, "").strip()]
    assert not missing, "fields without a docstring (a string literal on the line under the field): " + \
        ", ".join(missing)


@dataclass
class _Sample:
    a: int = 1
    """First line.

    Second paragraph."""
    b: str = "x"
    # a comment, not a docstring
    c: float = 0.5
    """C's doc."""


def test_field_docs_are_the_literals_under_each_field():
    assert field_docs(_Sample) == {"a": "First line.\n\nSecond paragraph.", "c": "C's doc."}


def test_list_prints_type_default_megatron_flag_and_doc(capsys):
    assert main(["config", "--list", "parallel"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[parallel]\n") and "[model]" not in out
    assert "  tensor: int = 1    (Megatron: --tensor-model-parallel-size)\n      Tensor-parallel size." in out
    assert '  context_algorithm: "ring" | "all2all" = "ring"' in out
    assert "  pipeline_layout: list[int] | none = none" in out
    assert "(Megatron: --sequence-parallel (true))" in out
    for f in dataclasses.fields(section_classes()["parallel"]):
        assert f"\n  {f.name}: " in out
    assert "``" not in out and ":func:" not in out  # reST rendered for the terminal


def test_list_of_every_section_and_an_unknown_one(capsys):
    assert main(["config", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("[")] == [f"[{s}]" for s in SECTIONS]
    assert len(keys()) == sum(len(dataclasses.fields(c)) for c in section_classes().values())
    assert main(["config", "--list", "modle"]) == 2
    assert "unknown config section 'modle'" in capsys.readouterr().err


def test_show_marks_defaults_and_implied_values_and_reads_back(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\npipeline = 2\nschedule = "zbv"\n[model]\nnum_layers = 4\n')
    assert main(["config", "--show", str(path), "--set", "train.train_iters=3"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if "=" in line}
    assert lines["pipeline"] == "pipeline = 2" and lines["train_iters"] == "train_iters = 3"
    assert lines["virtual_pipeline"].split("#")[1].strip() == "implied"  # zbv runs 2 chunks per rank
    assert lines["tensor"].split("#")[1].strip() == "default"
    assert lines["# max_position_embeddings"].split("# default:")[1].strip() == "None means seq_length"
    # The output is TOML for the same config (unset keys are comments).
    assert from_dict(tomllib.loads(out)) == load_config(path, ["train.train_iters=3"])


def test_show_errors_name_the_problem(tmp_path, capsys):
    assert main(["config", "--show", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml' does not exist" in capsys.readouterr().err
    assert main(["config", "--show", "--set", "parallel.tensr=2"]) == 2
    assert "unknown config key 'parallel.tensr'" in capsys.readouterr().err


# ---- --help without reST markup ------------------------------------------------------------
def test_markup_plain_and_markdown():
    text = "Run ``paratron plan``; see :func:`~paratron.planner.search.plan` and :mod:`.sections`.\n\nUsage::"
    assert markup.plain(text) == "Run paratron plan; see plan and .sections.\n\nUsage:"
    assert markup.markdown(text) == "Run `paratron plan`; see `plan` and `.sections`.\n\nUsage:"
    assert markup.plain(":class:`the title <paratron.config.Config>`") == "the title"


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in COMMANDS])
def test_help_texts_have_no_rest_markup(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help of a subcommand
        code = e.code
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: paratron")
    assert "``" not in out and not any(role in out for role in (":func:`", ":mod:`", ":class:`"))
    if argv == ["--help"]:
        assert "The paratron command: train | preprocess" in out
