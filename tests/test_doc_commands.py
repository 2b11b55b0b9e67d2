"""Every shell command that README.md and docs/*.md show runs as written.

The pages' shell and python blocks run in order (tests/doc_commands.py says which, and what
is left out and why) in one scratch copy of the repository, after the README's set-up, with
FIVEFOLD_MAX_STEPS shortening each training run: a page's command fails this test when it
exits non-zero (or, where the page shows a refusal, anything but 2), or when it does not
print a line the page shows for it (a transcript's output lines, a `# prints:` key line, a
doctest's values).

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
import tempfile
from pathlib import Path

import pytest
from doc_commands import (
    OUTPUT_DIR_ENV,
    PAGE_ORDER,
    ROOT,
    Block,
    commands,
    missing_lines,
    python_argv,
    runnable_blocks,
    script,
    unmarked_command_blocks,
)

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
    for block in runnable_blocks(page):
        reason = block.skip_reason
        assert reason is None or len(reason) > 10, f"{block.where}: say why it is not run"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A fresh copy of the repository, as a clone after the README's set-up would be."""
    dst = tmp_path_factory.mktemp("docs") / "fivefold"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"))
    return dst


def run_block(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """In a session of its own: whatever the block leaves running (a server it started
    before a command failed, a command past the time limit) is ended with it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def check_block(block: Block, cwd: Path, env: dict) -> str:
    """Run one block; what went wrong, or "" when it did what the page says."""
    with tempfile.TemporaryDirectory() as kept:
        if block.lang == "python":
            source = Path(kept) / "block.py"
            source.write_text(block.body)
            what = block.body
            proc = run_block(python_argv(block, str(source)), cwd, env)
        else:
            what = script(block)
            proc = run_block(["bash", "-c", what], cwd, {**env, OUTPUT_DIR_ENV: kept})
        problem = f"failed (exit {proc.returncode})" if proc.returncode else ""
        if not problem and block.lang != "python":
            for i, command in enumerate(commands(block)):
                if not command.shown:
                    continue
                printed = (Path(kept) / str(i)).read_text()
                missing = missing_lines(command.shown, printed)
                if missing:
                    problem = (f"`{command.text.splitlines()[0]}` did not print the line(s) the "
                               f"page shows: {missing}; it printed:\n{printed[-2500:]}")
                    break
    if not problem:
        return ""
    return (f"{block.where} {problem}:\n{what}\n--- stdout (end)\n{proc.stdout[-2500:]}\n"
            f"--- stderr (end)\n{proc.stderr[-2500:]}")


def test_shown_lines_are_compared_with_what_a_command_prints(tmp_path):
    """The comparison can fail: a transcript's output lines and `# prints:` key lines are
    matched in order, `...` for any text; a wrong, missing or misordered line is reported,
    and so is a doctest's wrong value."""
    transcript = Block("page.md", 1, "console",
                       "$ printf 'a 1\\nb 22\\nc 3\\n'\na 1\n...\nc ...\n$ echo x\nx\n")
    assert [c.shown for c in commands(transcript)] == [("a 1", "...", "c ..."), ("x",)]
    assert check_block(transcript, tmp_path, dict(os.environ)) == ""
    for body, words in (("$ echo b\na\n", "['a']"),
                        ("$ printf 'c\\nb\\n'\nb\nc\n", "['c']"),
                        ("echo real output\n# prints: real ...put\necho q\n# prints: z\n",
                         "['z']")):
        problem = check_block(Block("page.md", 3, "bash", body), tmp_path, dict(os.environ))
        assert "did not print" in problem and words in problem, problem
    doctest_block = Block("page.md", 5, "python", ">>> 1 + 1\n3\n")
    assert "failed" in check_block(doctest_block, tmp_path, dict(os.environ))
    assert check_block(Block("page.md", 5, "python", ">>> 1 + 1\n2\n"), tmp_path,
                       dict(os.environ)) == ""
    assert "failed" in check_block(Block("page.md", 7, "python", "raise SystemExit(3)\n"),
                                   tmp_path, dict(os.environ))


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
    for block in runnable_blocks(page):
        if block.skip_reason is None:
            problem = check_block(block, scratch, env)
            assert not problem, problem
