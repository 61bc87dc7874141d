import dataclasses
import enum
import json
from pathlib import Path

import pytest

from adbatch.config import ConfigBase, ConfigError, load_config_file


class Mode(str, enum.Enum):
    A = "a"
    B = "b"


@dataclasses.dataclass
class Inner(ConfigBase):
    k: int = 10

    def validate(self) -> None:
        if self.k < 2:
            raise ConfigError("Inner.k must be >= 2")


@dataclasses.dataclass
class Outer(ConfigBase):
    path: Path = Path("x")
    mode: Mode = Mode.A
    ratio: float = 0.5
    flag: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_json_round_trip_keeps_types():
    cfg = Outer(path=Path("a/b"), mode=Mode.B, ratio=0.25, flag=True, inner=Inner(k=3))
    back = Outer.from_json(cfg.to_json())
    assert back == cfg
    assert isinstance(back.mode, Mode) and isinstance(back.path, Path)
    assert json.loads(cfg.to_json())["version"] == Outer.CONFIG_VERSION


def test_validation_and_unknown_fields():
    with pytest.raises(ConfigError, match="Inner.k"):
        Outer.from_dict({"inner": {"k": 1}})
    with pytest.raises(ConfigError, match="unknown field"):
        Outer.from_dict({"nope": 1})
    with pytest.raises(ConfigError, match="not one of"):
        Outer.from_dict({"mode": "c"})
    with pytest.raises(ConfigError, match="expected int"):
        Inner.from_dict({"k": "ten"})


def test_config_files_and_cli_precedence(tmp_path):
    from jobs.config_cli import add_config_arguments, config_from_args
    import argparse

    toml = tmp_path / "c.toml"
    toml.write_text('[stage]\nratio = 0.75\nmode = "b"\n[stage.inner]\nk = 7\n')
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("ratio: 0.1\n")
    assert load_config_file(yaml_file) == {"ratio": 0.1}
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_config_arguments(p, Outer)
    args = p.parse_args(["--config", str(toml), "--inner.k", "9", "--flag", "true"])
    cfg = config_from_args(Outer, args, section="stage")
    assert cfg.ratio == 0.75 and cfg.mode is Mode.B and cfg.inner.k == 9 and cfg.flag is True
    with pytest.raises(ConfigError):
        load_config_file(tmp_path / "missing.toml")


def test_wrong_types_are_refused_naming_the_key():
    """A scalar for a table, a fraction for an int, a string for a list, a list for a string and an
    empty path are refused (they used to be accepted, truncated or iterated character by character)."""
    from jobs.nightly_refresh import RefreshConfig

    bad = {"train": False, "compress": "off"}
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=f"RefreshConfig.{key}: expected a table"):
            RefreshConfig.from_dict({key: value})
    with pytest.raises(ConfigError, match="TrainJobConfig.num_workers: expected int"):
        RefreshConfig.from_dict({"train": {"config": {"num_workers": 1.5}}})
    with pytest.raises(ConfigError, match="RefreshConfig.force: expected a list"):
        RefreshConfig.from_dict({"force": "train"})
    with pytest.raises(ConfigError, match="verify_modes: expected a list"):
        RefreshConfig.from_dict({"eval": {"config": {"targeting": {"verify_modes": "off"}}}})
    with pytest.raises(ConfigError, match="RefreshConfig.model: expected str"):
        RefreshConfig.from_dict({"model": ["a"]})
    with pytest.raises(ConfigError, match="IndexJobConfig.ads: expected a path"):
        RefreshConfig.from_dict({"index": {"config": {"ads": 5}}})
    with pytest.raises(ConfigError, match="IndexJobConfig.ads: required"):
        RefreshConfig.from_dict({"index": {"config": {"ads": ""}}})
    # still accepted: integral floats (TOML 1e3), numeric strings, and "" = None for an optional path
    cfg = RefreshConfig.from_dict({"train": {"config": {"num_workers": 2.0, "train": {"max_steps": 1e3}}},
                                   "generate": {"creatives_requests": "", "config": {"batch_size": "4"}}})
    assert cfg.train.config.num_workers == 2 and cfg.train.config.train.max_steps == 1000
    assert cfg.generate.creatives_requests is None and cfg.generate.config.batch_size == 4


def test_subcommand_table_vs_nested_table_of_the_same_name(tmp_path):
    """`adbatch train --config f.toml` where `[train]` holds TrainConfig settings (the same shape as
    `--train.epochs`): the top-level keys and the nested table are both used."""
    import argparse

    from jobs.config_cli import add_config_arguments, config_from_args
    from pipelines.train import TrainJobConfig

    def parse(text):
        (tmp_path / "t.toml").write_text(text)
        p = argparse.ArgumentParser()
        p.add_argument("--config")
        add_config_arguments(p, TrainJobConfig)
        return config_from_args(TrainJobConfig, p.parse_args(["--config", str(tmp_path / "t.toml")]),
                                section="train")

    nested = parse('index = "i"\nout = "m"\n[train]\nepochs = 2.0\n')
    assert nested.index == Path("i") and nested.out == Path("m") and nested.train.epochs == 2.0
    # a file shared by several subcommands: its [train] table is this subcommand's
    shared = parse('[index]\nads = "a"\n[train]\nindex = "i2"\nout = "m2"\n[train.train]\nepochs = 3.0\n')
    assert shared.index == Path("i2") and shared.out == Path("m2") and shared.train.epochs == 3.0


@pytest.mark.parametrize("command", ["index", "train", "compress", "generate", "eval", "refresh"])
def test_every_subcommand_help_renders(command, capsys):
    """argparse %-formats help strings: a help text with a literal % used to crash `--help`."""
    from jobs.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0 and "--config" in capsys.readouterr().out
