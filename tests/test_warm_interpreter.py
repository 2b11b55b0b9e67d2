"""tests/warm_interpreter.py: a child forked from the warm process behaves as the fresh
`python -c` / `python -m` it replaces, for what tests/common.py `run_interpreted` reads."""

import os
import subprocess

import pytest
import warm_interpreter
from common import run_interpreted

pytest.importorskip("triton")

PROBE = r"""
import json, os, sys
import triton

@triton.jit
def kernel(x):
    pass

print("noise before the report")
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "interpret": os.environ.get("TRITON_INTERPRET"),
                  "extra": os.environ.get("WARM_PROBE"), "unset": "HOME" in os.environ,
                  "main": __name__, "interpreted": type(kernel).__name__}))
"""


def test_a_forked_child_is_a_fresh_python_c(tmp_path):
    got = run_interpreted(["-c", PROBE, "a", "b"], cwd=tmp_path, env={"WARM_PROBE": "1"},
                          unset=("HOME",))
    assert got == {"argv": ["-c", "a", "b"], "path0": "", "cwd": str(tmp_path),
                   "interpret": "1", "extra": "1", "unset": False, "main": "__main__",
                   "interpreted": "InterpretedFunction"}
    again = run_interpreted(["-c", PROBE])  # the next child: none of the last one's state
    assert again["argv"] == ["-c"] and again["unset"] and again["extra"] is None


def test_python_m_runs_the_module_as_main(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    got = run_interpreted(["-m", "probe_module", "x"], cwd=tmp_path)
    assert got["argv"] == [str(tmp_path / "probe_module.py"), "x"]
    assert got["path0"] == str(tmp_path) and got["main"] == "__main__"


@pytest.mark.parametrize("code, status", [("import sys; sys.exit(3)", 3),
                                          ("raise ValueError('broken check')", 1),
                                          ("import sys; sys.exit('said why')", 1),
                                          ("import os, signal; os.kill(os.getpid(), 9)", -9)])
def test_a_child_ends_with_its_code_stdout_and_stderr(tmp_path, code, status):
    env = {"TRITON_INTERPRET": "1"}
    got = warm_interpreter.run(["-c", f"print('out', flush=True); {code}"], env,
                               str(tmp_path), 60)
    assert got[:2] == (status, "out\n")
    if status == 1:
        assert "broken check" in got[2] or "said why" in got[2], got[2]


def test_run_interpreted_fails_on_a_failed_child_with_its_stderr():
    with pytest.raises(AssertionError, match="ValueError: broken check"):
        run_interpreted(["-c", "raise ValueError('broken check')"])


def test_a_child_past_its_timeout_is_killed_and_the_next_one_runs():
    with pytest.raises(subprocess.TimeoutExpired):
        run_interpreted(["-c", "import time; time.sleep(60)"], timeout=1)
    assert run_interpreted(["-c", "print('{\"after\": 1}')"]) == {"after": 1}


def test_children_are_forked_from_the_warm_process():
    """Not from this process, which may have defined its kernels compiled: the warm one
    started with TRITON_INTERPRET=1 (the kernels above are interpreted)."""
    got = run_interpreted(["-c", "import json, os; print(json.dumps(os.getppid()))"])
    (warm,) = warm_interpreter._WARM
    assert got == warm.proc.pid != os.getpid()
