"""Packaging (pyproject.toml): every package folder is installed; the library (``hpczeco``, ``.collectives``,
``.gpu``, ``.base``) needs only numpy, numba and mpi4py; h5py, tqdm and matplotlib are the ``drivers`` extra,
and a command of the CLI that lacks one says so in one line naming ``pip install 'hpczeco[drivers]'``, without
a traceback.

A missing package is simulated with ``sys.modules[name] = None`` (every ``import name`` then fails with
``ModuleNotFoundError``), in a child process where a whole import is tried.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hpczeco.drivers import cli

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("base", "collectives", "gpu", "hpczeco")  # the folders installed as the library (not drivers/)
EXTRA = ("h5py", "tqdm", "matplotlib")
BLOCK = "import sys\nfor _m in {extra!r}: sys.modules[_m] = None\n"


def _run_without_extra(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", BLOCK.format(extra=EXTRA) + code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def test_the_extra_is_what_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]}
    assert core == {"numpy", "numba", "mpi4py"}
    drivers = {d.split(">")[0].strip() for d in meta["optional-dependencies"]["drivers"]}
    assert drivers == set(EXTRA) == set(cli.DRIVERS_EXTRA)
    assert "hpczeco[drivers]" in meta["optional-dependencies"]["test"]  # `make test` / `make run` install it


def test_every_package_folder_is_installed():
    """pyproject.toml lists its packages one by one: a new package folder (``__init__.py`` in it and in every
    folder above it) must be among them, or a wheel (a non-editable install) lacks it."""
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for pkg, folder in tool["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if all((root.joinpath(*rel.parts[:i]) / "__init__.py").is_file() for i in range(len(rel.parts))):
                found.add(".".join([pkg, *rel.parts]))
    assert "hpczeco.drivers.checkpoint" in found
    missing = sorted(found - set(tool["packages"]))
    assert not missing, f"package folders missing from pyproject.toml's packages: {missing}"


def test_the_library_never_imports_the_extra():
    """Every import statement of the library (module level and inside functions) is checked, by ast."""
    found = []
    files = [f for folder in LIBRARY for f in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 50
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(REPO)}:{node.lineno} {m}" for m in mods if m.split(".")[0] in EXTRA]
    assert not found, f"the library imports the drivers extra: {found}"


def test_the_library_imports_without_the_extra():
    code = ("import hpczeco, hpczeco.base, hpczeco.collectives, hpczeco.gla, hpczeco.daaf, hpczeco.zeco\n"
            "from hpczeco import ZeCOGLA, chunk_gla\n"
            "print('imported')\n")
    run = _run_without_extra(code)
    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stderr


def test_a_command_without_the_extra_says_so_in_one_line():
    run = _run_without_extra("from hpczeco.drivers.cli import main\nsys.exit(main(['train', '--steps', '1']))")
    assert run.returncode == 2, run.stderr
    assert run.stderr == ("hpczeco train: error: MissingExtraError: h5py, tqdm are not installed (the drivers "
                          "extra): pip install 'hpczeco[drivers]'\n")


def test_info_runs_without_the_extra():
    run = _run_without_extra("from hpczeco.drivers.cli import main\nsys.exit(main(['info']))")
    assert run.returncode == 0, run.stderr
    assert ("HDF5 mode       none: h5py is not installed; checkpoints need it: pip install 'hpczeco[drivers]'"
            in run.stdout), run.stdout


def test_needs_names_real_commands():
    names = set(cli.COMMANDS) | {f"bench {b}" for b in cli.BENCHES}
    assert set(cli.NEEDS) <= names
    assert all(set(mods) <= set(cli.DRIVERS_EXTRA) for mods in cli.NEEDS.values())


@pytest.mark.parametrize("where", ["import", "run"])
def test_an_extra_missing_in_a_driver_is_a_user_error(tmp_path, monkeypatch, where):
    """A driver that imports a module of the extra -- when it is imported, or later while it runs (a plot at
    the end) -- ends with MissingExtraError, a one-line user error, whatever the NEEDS table says."""
    body = {"import": "import h5py\n\ndef main(argv, prog):\n    return 0\n",
            "run": "def main(argv, prog):\n    import matplotlib.pyplot\n    return 0\n"}[where]
    (tmp_path / "fake_driver_extra.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("h5py", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "fake_driver_extra", raising=False)
    with pytest.raises(cli.MissingExtraError, match=r"^(h5py|matplotlib) is not installed \(the drivers extra\): "
                                                    r"pip install 'hpczeco\[drivers\]'$") as err:
        cli._run_module("fake_driver_extra", [], "hpczeco fake")
    assert cli.is_user_error(err.value)
    assert err.value.missing == (["h5py"] if where == "import" else ["matplotlib"])
