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
