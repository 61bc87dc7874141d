"""scripts/device_carry.py without a GPU: a plan's payload laid out over calls that each fit the device's
64 MiB (here shrunk), then every call replayed as the device sees it (a fresh checkout holding only that call's
carried paths, /tmp kept between calls): the plan reports ready only after its last call, with the joined
file byte-exact, the carried package importable and the folders of earlier calls still there."""

from __future__ import annotations

import importlib.util
import io
import lzma
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _load():
    """scripts/device_carry.py as a module (registered: its dataclass resolves annotations through sys.modules)."""
    spec = importlib.util.spec_from_file_location("device_carry", REPO / "scripts" / "device_carry.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_carry"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def kit(tmp_path, monkeypatch):
    mod = _load()
    here, root = tmp_path / "here", tmp_path / "device_tmp"
    monkeypatch.setattr(mod, "REPO", here)
    monkeypatch.setattr(mod, "CARRY", here / ".carry")
    monkeypatch.setattr(mod, "CALL_BYTES", 3 * MiB)
    monkeypatch.setattr(mod, "SPARE_BYTES", 0)
    for name, sub in (("ROOT", ""), ("SITE", "site"), ("PYSITE", "pysite"), ("PKGSITE", "pkgsite"),
                      ("STAGED", "carried")):
        monkeypatch.setattr(mod, name, root / sub if sub else root)
    monkeypatch.setitem(mod.PLANS, "test", mod.Plan("a test plan", gguf=True, minilm=True, folders=("bundle",),
                                                    imports=("smokepkg",)))
    return mod, here, root


def _payloads(here: Path) -> tuple[Path, bytes, Path]:
    """A 4 MiB incompressible 'GGUF' and a tarball holding an importable package, both xz'd, and a bundle."""
    (here / ".carry" / "bundle").mkdir(parents=True)
    (here / ".carry" / "bundle" / "prepare.json").write_bytes(b"{}" + b" " * (MiB // 2))
    model = os.urandom(4 * MiB)
    gguf = here / "model.gguf.xz"
    gguf.write_bytes(lzma.compress(model, preset=0))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"VALUE = 42\n"
        info = tarfile.TarInfo("smokepkg/__init__.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    pkg = here / "smokepkg.tar.xz"
    pkg.write_bytes(lzma.compress(buf.getvalue(), preset=0))
    return gguf, model, pkg


def test_calls_fit_and_the_plan_is_ready_only_after_its_last_call(kit, tmp_path):
    mod, here, root = kit
    gguf, model, pkg = _payloads(here)
    calls = mod.layout("test", [here / ".carry" / "bundle"], [(gguf, "adbatch_files", "file"),
                                                             (pkg, "pkgsite", "tarball")], tree=0)
    assert len(calls) == 2  # 0.5 MiB bundle + 4 MiB + a few bytes, 3 MiB a call
    for c in calls:
        assert sum(mod.folder_bytes(here / p) for p in c) <= 3 * MiB
    assert calls[0][0] == ".carry/bundle"
    rcs = []
    for i, carried in enumerate(calls):
        device = tmp_path / f"device_checkout_{i}"  # what this call sends: only its own carried paths
        for p in carried:
            shutil.copytree(here / p, device / p)
        rcs.append(mod.main(["setup", "--plan", "test", "--repo", str(device), "--env-file", str(root / "env.sh")]))
    assert rcs == [3, 0]
    assert (root / "adbatch_files" / "model.gguf").read_bytes() == model
    env = (root / "env.sh").read_text()
    assert f"ADBATCH_DEFAULT_GGUF={root / 'adbatch_files' / 'model.gguf'}" in env
    assert (root / "pkgsite" / "smokepkg" / "__init__.py").read_text() == "VALUE = 42\n"
    # the last call did not carry the bundle: it is linked from where the first call left it
    assert (tmp_path / "device_checkout_1" / ".carry" / "bundle" / "prepare.json").is_file()
    # a repeated call finds everything done and stays ready
    assert mod.main(["setup", "--plan", "test", "--repo", str(tmp_path / "device_checkout_1"),
                     "--env-file", str(root / "env.sh")]) == 0


def test_a_damaged_part_is_refused(kit, tmp_path):
    mod, here, root = kit
    gguf, _, pkg = _payloads(here)
    calls = mod.layout("test", [], [(gguf, "adbatch_files", "file")], tree=0)
    device = tmp_path / "device_checkout"
    shutil.copytree(here / calls[0][0], device / calls[0][0])
    part = next((device / calls[0][0]).glob("*.part*"))
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="damaged"):
        mod.main(["setup", "--plan", "test", "--repo", str(device), "--env-file", str(root / "env.sh")])


def test_a_build_is_stale_when_its_inputs_change(kit):
    mod, here, _ = kit
    src = here / "inputs"
    src.mkdir(parents=True)
    (src / "a.py").write_text("one")
    key = mod.inputs_key([src, "setting"])
    folder = here / "built"
    folder.mkdir()
    (folder / "BUILD_KEY").write_text(key + "\n")
    assert mod.is_fresh(folder, mod.inputs_key([src, "setting"]))
    (src / "a.py").write_text("two")
    assert not mod.is_fresh(folder, mod.inputs_key([src, "setting"]))
    assert not mod.is_fresh(folder, key[:-1] + "x")


def test_legacy_arguments_name_plans():
    mod = _load()
    assert {k: v for k, v in mod.LEGACY.items()} == {"": ("ray",), "--with-gguf": ("ray-model",),
                                                      "--trained-check": ("trained", "creatives")}
    assert all(p in mod.PLANS for plans in mod.LEGACY.values() for p in plans)
    # only the Ray plans build the Ray site; metric wheels only where creatives are scored
    assert [n for n, p in mod.PLANS.items() if p.ray_site] == ["ray", "ray-model"]
    assert [n for n, p in mod.PLANS.items() if "rouge-score" in p.wheels] == ["creatives"]


def test_device_only_wheels_take_their_pinned_version():
    """torchao runs only on the device (its torch, 2.11): the kit pins its version instead of asking this venv,
    which does not install it; the plan that carries it needs no MiniLM package (its benchmark reads the
    bundle's precomputed query vectors)."""
    mod = _load()
    assert mod.version("torchao") == mod.DEVICE_ONLY_VERSIONS["torchao"] == "0.18.0"
    assert mod.version("pytest") == pytest.__version__
    plan = mod.PLANS["formats"]
    assert "torchao" in plan.wheels and plan.gguf and not plan.minilm and plan.folders == ("bundle",)
    assert [n for n, p in mod.PLANS.items() if "torchao" in p.wheels] == ["formats"]
