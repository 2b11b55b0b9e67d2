"""Every shell command that README.md and docs/*.md show runs as written.

The pages' shell blocks run in order (tests/doc_commands.py says which, and what is left out
and why) in one scratch copy of the repository, after the README's set-up, with
FIVEFOLD_MAX_STEPS shortening each training run: a page's command fails this test when it
exits non-zero (or, where the page shows a refusal, anything but 2).

The runs take minutes (each command starts Python and torch; the multi-rank ones start up to
eight), so they carry the `docs` marker: the README's `python3 -m pytest` leaves them out and
`python3 -m pytest -m docs` runs them (about 10 minutes on two cores; `.ci/run` runs it after
the suite).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from doc_commands import PAGE_ORDER, ROOT, script, shell_blocks, unmarked_command_blocks

# Each training run a page shows is cut to this many steps: enough for a checkpoint, a
# validation pass and the step lines, the paths the commands after it depend on.
MAX_STEPS = "4"
BLOCK_TIMEOUT_S = 420


def test_every_page_is_in_the_run_order():
    pages = {"README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))}
    assert pages == set(PAGE_ORDER), (
        f"add to or remove from tests/doc_commands.py PAGE_ORDER: {pages ^ set(PAGE_ORDER)}")


@pytest.mark.parametrize("page", PAGE_ORDER)
def test_no_command_hides_outside_a_shell_block(page):
    hidden = unmarked_command_blocks(page)
    assert not hidden, (f"{hidden[0].where}: a fence with commands needs the info string "
                        f"bash (run by the docs test) or a '# not run by the docs test: why' line")
    for block in shell_blocks(page):
        reason = block.skip_reason
        assert reason is None or len(reason) > 10, f"{block.where}: say why it is not run"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A fresh copy of the repository, as a clone after the README's set-up would be."""
    dst = tmp_path_factory.mktemp("docs") / "fivefold"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"))
    return dst


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGE_ORDER)
def test_page_commands_run_as_written(page, scratch):
    env = {**os.environ, "FIVEFOLD_MAX_STEPS": MAX_STEPS, "PYTHONUNBUFFERED": "1"}
    # `python3` and `fivefold` on PATH are this interpreter's, as after the README's set-up.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    # ...and import the scratch copy's package, as `pip install -e .` in that clone would:
    # not the tree the test runs from, which may change while the pages run.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch / "src"),
                                                      env.get("PYTHONPATH", "")]))
    for block in shell_blocks(page):
        if block.skip_reason is not None:
            continue
        # A session of its own: whatever the block leaves running (a server it started before
        # a command failed, a command past the time limit) is ended with it.
        proc = subprocess.Popen(["bash", "-c", script(block)], cwd=scratch, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n[docs test] killed after {BLOCK_TIMEOUT_S} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert proc.returncode == 0, (
            f"{block.where} failed (exit {proc.returncode}):\n{script(block)}\n"
            f"--- stdout (end)\n{proc.stdout[-2500:]}\n--- stderr (end)\n{proc.stderr[-2500:]}")
