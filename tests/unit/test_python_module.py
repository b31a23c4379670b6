"""``inferd.python_module``: how inferd starts Python (the build child, ``inferd
selftest``'s daemon and ``verify``, the acceptance scenarios' child) runs a module
as ``python -m`` would, but never imports from the working directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

import inferd
from inferd.python_module import python_module


def test_a_package_planted_in_the_working_directory_is_never_imported(tmp_path: Path) -> None:
    planted = tmp_path / "planted-code-ran"
    (tmp_path / "inferd").mkdir()
    (tmp_path / "inferd" / "__init__.py").write_text(f"open({str(planted)!r}, 'w').close()\n")
    done = subprocess.run(
        [*python_module("inferd.cli"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert inferd.__version__ in done.stdout
    assert not planted.exists(), "python_module imported from the working directory"


def test_the_module_runs_as_main_with_the_arguments_after_it(tmp_path: Path) -> None:
    script = tmp_path / "lib" / "probe"
    script.mkdir(parents=True)
    (script / "__init__.py").write_text("")
    (script / "__main__.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    done = subprocess.run(
        [*python_module("probe"), "a", "--b"],
        env={"PYTHONPATH": str(tmp_path / "lib")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "__main__ ['a', '--b']"
