"""The shipped assets (contracts, model, basis receipts) resolve through importlib.resources, and
a missing one is a one-line refusal with exit 2 from every command that needs it.

An installed wheel is imitated without building one: a copy of the package on ``PYTHONPATH`` with
the assets under ``qualify/_shipped/`` (where pyproject.toml's package-dir mapping puts them), run
from a directory outside the checkout. tools/test.sh also builds and installs the real wheel.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qualify import UNKNOWN_VERSION, harness_version
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.run.run_contract import default_identity_path

PYPROJECT = tomllib.loads((assets.REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
LANE_IDENTITIES = sorted(assets.CONTRACTS_DIR.glob("*-identity-v1.json"))
NATIVE_TEXT_IDENTITY = default_identity_path("native-text").relative_to(assets.ASSET_ROOT).as_posix()


def _installed_copy(root: Path) -> Path:
    """A wheel's layout under ``root/site``: the package, and the assets under qualify/_shipped."""
    site = root / "site"
    shutil.copytree(assets.REPO_ROOT / "qualify", site / "qualify", ignore=shutil.ignore_patterns("__pycache__"))
    for name in assets.ASSET_DIRS:
        shutil.copytree(assets.REPO_ROOT / name, site / "qualify" / "_shipped" / name)
    return site


def _qualify(site: Path, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``qualify ARGS`` run from ``cwd`` (outside the checkout) with only the copy importable as qualify."""
    env = dict(os.environ, PYTHONPATH=str(site), QUALIFY_DEBUG="")
    return subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _basis_run_id(identity: str) -> str:
    document = json.loads((assets.REPO_ROOT / identity).read_text(encoding="utf-8"))
    return str(document["onboarding_qualification"]["basis"]).removeprefix("receipt://").partition("/")[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _installed_copy(tmp_path_factory.mktemp("wheel-layout"))


def test_a_checkout_resolves_its_own_top_level_folders() -> None:
    assert assets.ASSET_SOURCE == "checkout"
    assert assets.ASSET_ROOT == assets.REPO_ROOT
    assert assets.require_asset("model/config.json") == assets.MODEL_DIR / "config.json"
    assert assets.asset_relpath(assets.MODEL_DIR / "nvfp4" / "model.safetensors") == "model/nvfp4/model.safetensors"


def test_an_installed_copy_resolves_assets_through_importlib_resources(installed: Path, tmp_path: Path) -> None:
    probe = ("import importlib.resources, qualify; from qualify.core import assets; "
             "print(assets.ASSET_SOURCE); print(assets.ASSET_ROOT); print(importlib.resources.files('qualify._shipped')); "
             "print(assets.require_asset('model/nvfp4/model.safetensors')); print(qualify.__file__)")
    env = dict(os.environ, PYTHONPATH=str(installed))
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    source, root, resources, checkpoint, package = done.stdout.splitlines()
    shipped = installed / "qualify" / "_shipped"
    assert (source, Path(root), Path(resources)) == ("installed", shipped, shipped)
    assert Path(checkpoint) == shipped / "model" / "nvfp4" / "model.safetensors"
    assert Path(package).parent == installed / "qualify"


@pytest.mark.parametrize("relpath", ["../pyproject.toml", "/etc/passwd", "model/../../x", "", "model//config.json"])
def test_an_asset_name_that_is_not_a_plain_relative_path_is_refused(relpath: str) -> None:
    with pytest.raises(Refused, match="not a plain relative path"):
        assets.asset_path(relpath)


def test_a_missing_asset_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(assets.AssetMissing) as refused:
        assets.require_asset("model/no-such-checkpoint.safetensors")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("asset model/no-such-checkpoint.safetensors: missing; the harness cannot run without it")


def _hide(site: Path, relpath: str) -> None:
    (site / "qualify" / "_shipped" / relpath).unlink()


def _one_refusal_line(done: subprocess.CompletedProcess[str], relpath: str) -> str:
    """The single stderr line naming ``relpath``; asserts no traceback and none of the wrong verdicts."""
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "internal error" not in output
    assert "not caught" not in output and "tampered" not in output and "FAIL" not in done.stdout
    (line,) = [line for line in done.stderr.splitlines() if f"asset {relpath}: missing" in line]
    return line


def test_verify_with_a_schema_missing_from_the_install_exits_2_naming_it(tmp_path: Path) -> None:
    site = _installed_copy(tmp_path)
    relpath = "contracts/receipt-manifest.v2.schema.json"
    _hide(site, relpath)
    receipt = site / "qualify" / "_shipped" / "receipts" / _basis_run_id(NATIVE_TEXT_IDENTITY)
    done = _qualify(site, tmp_path, "receipts", "verify", str(receipt))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "reinstall trust-ladder" in _one_refusal_line(done, relpath)


def test_a_recipe_with_a_checkpoint_missing_from_the_install_exits_2_naming_it(tmp_path: Path) -> None:
    site = _installed_copy(tmp_path)
    relpath = "model/nvfp4/model.safetensors"
    _hide(site, relpath)
    done = _qualify(site, tmp_path, "--recipe", "native-text", "--receipts", str(tmp_path / "receipts"))
    assert done.returncode == 2, done.stdout + done.stderr
    _one_refusal_line(done, relpath)


def test_a_recipe_with_its_basis_receipt_missing_from_the_install_exits_2_naming_it(tmp_path: Path) -> None:
    site = _installed_copy(tmp_path)
    relpath = f"receipts/{_basis_run_id(NATIVE_TEXT_IDENTITY)}/manifest.json"
    _hide(site, relpath)
    done = _qualify(site, tmp_path, "--recipe", "native-text", "--receipts", str(tmp_path / "receipts"))
    assert done.returncode == 2, done.stdout + done.stderr
    _one_refusal_line(done, relpath)


def test_selftest_with_a_checkpoint_missing_from_the_install_exits_2_naming_it(tmp_path: Path) -> None:
    site = _installed_copy(tmp_path)
    relpath = "model/config.json"  # every lane reads it: the first fault lane is refused
    _hide(site, relpath)
    done = _qualify(site, tmp_path, "selftest", "--receipts", str(tmp_path / "receipts"))
    assert done.returncode == 2, done.stdout + done.stderr
    _one_refusal_line(done, relpath)


def test_the_wheel_packages_are_the_package_tree_plus_the_shipped_folders() -> None:
    found = {".".join(init.parent.relative_to(assets.REPO_ROOT).parts)
             for init in (assets.REPO_ROOT / "qualify").rglob("__init__.py")}
    shipped = {f"qualify._shipped.{name}" for name in assets.ASSET_DIRS}
    data_packages = {name for name in SETUPTOOLS["package-data"] if name.startswith("qualify._shipped.")}
    # the recipes stay at the checkout's top level and ship as qualify.recipes
    assert set(SETUPTOOLS["packages"]) == found | shipped | data_packages | {"qualify.recipes"}
    assert SETUPTOOLS["package-dir"] == {f"qualify._shipped.{name}": name for name in assets.ASSET_DIRS} | {
        "qualify.recipes": "recipes"}


def _package_data_files() -> set[str]:
    """The asset names pyproject.toml's package-data patterns select (minus exclude-package-data)."""
    selected: set[str] = set()
    for package, patterns in SETUPTOOLS["package-data"].items():
        if not package.startswith("qualify._shipped."):
            continue
        relative = package.removeprefix("qualify._shipped.").replace(".", "/")
        excluded = SETUPTOOLS.get("exclude-package-data", {}).get(package, [])
        for pattern in patterns:
            for path in assets.ASSET_ROOT.joinpath(relative).glob(pattern):
                name = path.relative_to(assets.ASSET_ROOT / relative).as_posix()
                if path.is_file() and not any(fnmatch.fnmatch(name, rule) for rule in excluded):
                    selected.add(f"{relative}/{name}")
    return selected


def test_the_wheel_ships_every_file_a_shipped_lane_reads() -> None:
    needed = {path.relative_to(assets.ASSET_ROOT).as_posix() for path in assets.CONTRACTS_DIR.glob("*.json")}
    needed |= {path.relative_to(assets.ASSET_ROOT).as_posix() for path in assets.PROMPTS_DIR.glob("*.json")}
    needed.add("model/tokenizer.json")
    for identity in LANE_IDENTITIES:
        document = json.loads(identity.read_text(encoding="utf-8"))
        needed |= set(document["checkpoint"]["files"])
        basis = assets.RECEIPTS_DIR / _basis_run_id(f"contracts/{identity.name}")
        needed |= {path.relative_to(assets.ASSET_ROOT).as_posix() for path in basis.rglob("*") if path.is_file()}
    assert LANE_IDENTITIES and needed - _package_data_files() == set()


def _stale_metadata(place: Path, version: str) -> Path:
    """A ``trust_ladder.egg-info`` naming ``version`` in ``place`` (what any setuptools build leaves)."""
    stale = place / "trust_ladder.egg-info"
    stale.mkdir()
    (stale / "PKG-INFO").write_text(f"Metadata-Version: 2.4\nName: trust-ladder\nVersion: {version}\n", encoding="utf-8")
    return stale


def test_in_a_checkout_the_version_is_not_a_build_left_in_the_checkout(tmp_path: Path) -> None:
    """Python started in the checkout (``""`` first on sys.path) would find its stale egg-info
    before the installed metadata."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\nname = 'trust-ladder'\n", encoding="utf-8")
    _stale_metadata(checkout, "9.9.9")
    elsewhere = tmp_path / "site-packages"
    elsewhere.mkdir()
    _stale_metadata(elsewhere, "1.2.3")
    assert harness_version(checkout.resolve(), [str(checkout), str(elsewhere)]) == "1.2.3"
    assert harness_version(checkout.resolve(), [str(checkout)]) == UNKNOWN_VERSION


def test_installed_from_a_wheel_the_version_is_the_metadata_beside_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel's package sits in site-packages with no pyproject.toml: its own dist-info names the
    version, not an egg-info in the working directory (the wheel once reported ``0+unknown``)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "trust_ladder-2.0.1.dist-info").mkdir()
    (site / "trust_ladder-2.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: trust-ladder\nVersion: 2.0.1\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    _stale_metadata(work, "9.9.9")
    monkeypatch.chdir(work)
    assert harness_version(site.resolve(), ["", str(work)]) == "2.0.1"
    assert harness_version(work.resolve() / "nothing-installed-here") == UNKNOWN_VERSION


def test_this_checkouts_version_is_a_real_version() -> None:
    import qualify

    assert qualify.__version__ != UNKNOWN_VERSION and qualify.__version__[0].isdigit(), qualify.__version__
