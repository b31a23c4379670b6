"""What README.md and docs/OPERATIONS.md tell a newcomer, held to what the code does
(review NC, D4-D8): the default endpoint chain, ``inferctl infer --random``'s fixed
seed, the inferctl options, the bug-report archive command and the acceptance
scenarios.  Each reads the docs and the code in process: no daemon."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from inferd.engine_build.acceptance.simulated_scenarios import SCENARIOS
from inferd.engine_build.acceptance.tensorrt_scenarios import TENSORRT_SCENARIOS
from inferd_client.cli import main as inferctl
from inferd_wire.endpoints import runtime_dir_and_origin
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
OPERATIONS = (REPO / "docs" / "OPERATIONS.md").read_text()


def _section(text: str, heading: str) -> str:
    """From ``heading`` (a whole line) to the next heading of any level."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = re.search(r"^#{1,6} ", text[start:], re.MULTILINE)
    return text[start : start + end.start()] if end else text[start:]


def _help(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as exited:
        inferctl([*command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", help_text)) - {"--help", "--json"}


def test_the_readme_names_the_default_runtime_dir_chain_in_the_clients_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The snippet's comment once named $XDG_RUNTIME_DIR alone: without it (root,
    # sudo, containers) both sides use $TMPDIR/inferd-<uid>.
    variables = ["INFERD_RUNTIME_DIR", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"]
    for variable in variables:
        monkeypatch.setenv(variable, str(tmp_path / variable))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches what it found
    chain = []
    for variable in variables:  # the first set one wins: unset each in turn
        chain.append(runtime_dir_and_origin()[1])
        monkeypatch.delenv(variable)
    assert runtime_dir_and_origin()[0] == tmp_path / f"inferd-{os.getuid()}"
    assert chain == ["$INFERD_RUNTIME_DIR", "$RUNTIME_DIRECTORY", "$XDG_RUNTIME_DIR/inferd"]
    said = (
        "$INFERD_RUNTIME_DIR, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/inferd, "
        "else $TMPDIR/inferd-<uid> (/tmp without TMPDIR)"
    )
    assert said in README.replace(",\n# ", ", ")
    assert "default: ipc://$XDG_RUNTIME_DIR/inferd/infer.sock" not in README


def test_random_inputs_are_said_to_repeat_without_a_seed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --seed defaults to 0: every --random call without it sends the same inputs.
    infer_help = " ".join(_help(capsys, "infer").split())
    assert "seed for --random (default 0: the same inputs each call)" in infer_help
    row = next(line for line in README.splitlines() if "--random [--seed N]`" in line)
    assert "the same inputs on every call unless `--seed` changes (default 0)" in row


def test_the_readme_names_every_option_of_infer_and_switch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = _section(README, "### inferctl")
    for command in ("infer", "switch"):
        missing = {o for o in _options(_help(capsys, command)) if o not in table}
        assert not missing, f"inferctl {command}: {sorted(missing)} not in README's table"
    assert "`inferctl CMD --help`" in table


def test_operations_names_every_option_of_build_start_and_cancel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The README's table points there for the build options.
    assert "docs/OPERATIONS.md#builds-run-by-the-daemon-inferctl-build" in README
    section = _section(OPERATIONS, "### Builds run by the daemon: `inferctl build`")
    for command in (("build", "start"), ("build", "cancel")):
        missing = {o for o in _options(_help(capsys, *command)) if o not in section}
        assert not missing, f"inferctl {' '.join(command)}: {sorted(missing)} not in its section"


@pytest.mark.skipif(shutil.which("tar") is None or shutil.which("find") is None, reason="no tar")
def test_the_bug_report_archive_command_works_without_build_summaries(tmp_path: Path) -> None:
    # Where TensorRT's checks are skipped there is no *.build.json: the documented
    # tar of a `*/*.build.json` glob then exited 2.
    section = _section(OPERATIONS, "### Attaching a run to a bug")
    block = section[section.index("```sh\n") + len("```sh\n") :]
    lines = block[: block.index("```")].splitlines()
    assert lines[0].startswith(".venv/bin/inferd selftest --json --work-dir /tmp/inferd-selftest")
    work = tmp_path / "inferd-selftest"
    (work / "daemon-onnx").mkdir(parents=True)
    (work / "daemon-onnx" / "inferd.log").write_text("{}\n")
    (work / "models").mkdir()
    (work / "models" / "demo.onnx").write_bytes(b"x")
    (tmp_path / "selftest.json").write_text("{}\n")
    (tmp_path / "selftest.stderr").write_text("")
    script = "\n".join(lines[1:]).replace("/tmp/inferd-selftest", str(work))

    def archive() -> list[str]:
        done = subprocess.run(
            ["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        with tarfile.open(tmp_path / "selftest.tgz") as archived:
            return sorted(Path(name).name for name in archived.getnames())

    assert archive() == ["inferd.log", "selftest.json", "selftest.stderr"]
    (work / "engines").mkdir()  # with TensorRT: the build summaries go too
    (work / "engines" / "demo.engine.b1-00.build.json").write_text("{}\n")
    assert archive() == [
        "demo.engine.b1-00.build.json",
        "inferd.log",
        "selftest.json",
        "selftest.stderr",
    ]


def test_operations_lists_the_acceptance_scenarios_that_run() -> None:
    section = _section(OPERATIONS, "### Acceptance scenarios: `inferd acceptance stuck-build`")
    named = set(re.findall(r"`([a-z_]+)`", section)) - {"simulated"}  # the builder's label
    assert named == set(SCENARIOS) | set(TENSORRT_SCENARIOS)
    assert f"runs {len(SCENARIOS)} stuck-build scenarios" in " ".join(section.split())
