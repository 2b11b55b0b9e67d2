"""The shell commands that README.md and docs/*.md show, as the docs test runs them.

A fenced block is a shell block when its info string is `bash`, `sh` or `console`. In a block
with `$ ` prompts only the prompted lines are commands and the lines after one are the output
it prints: a transcript, which the docs test compares with what the command prints. Otherwise
every line is a command, with `\\` continuations joined, and a `# prints: TEXT` line under a
command marks a key line its output must hold. A shown line matches a printed line equal to
it (surrounding spaces aside) where `...` stands for any text; a line that is only `...`
stands for any number of lines; shown lines must appear in the order shown.

A `python` block runs too (python3 in the scratch copy, after the page's blocks above it): a
block of `>>> ` lines as a doctest (each expression's printed value compared, `...` again any
text), any other as a script that must exit 0.

Blocks run in PAGE_ORDER, each page's blocks top to bottom, in one scratch copy of the
repository, so a later page may use what an earlier one made (README's set-up trains
runs/default, which most pages then use).

What is not run, and why, each said where it is decided:
- a block whose first line is `# not run by the docs test: REASON` (multi-node launches, a
  Slurm script, a client of a server left running): the reason must be given;
- the `pip install` steps of a command: the test runs after the README's set-up, which
  installed the package with every extra, and reinstalling from a scratch copy would point
  the environment's editable install at it;
- `python3 -m pytest`: the suite the docs test is part of.

`python3 tests/doc_commands.py` prints what would run, page by page.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# README first (its set-up trains runs/default), then the pages in the order a reader takes
# the model through its life; every docs/*.md page must be named here (the test checks).
PAGE_ORDER = [
    "README.md", "docs/training.md", "docs/runs.md", "docs/parallel.md", "docs/zero.md",
    "docs/pipeline.md", "docs/context.md", "docs/moe.md", "docs/expert.md",
    "docs/memory-wall.md", "docs/fp8.md", "docs/fp8-allgather.md", "docs/planner.md",
    "docs/planner-table.md",
    "docs/planner-validation.md", "docs/benchmarks.md", "docs/lora.md",
    "docs/quantization.md", "docs/awq-outliers.md", "docs/evaluation.md", "docs/serving.md",
    "docs/development.md",
]

SHELL_LANGS = {"bash", "sh", "console"}
NOT_RUN = "# not run by the docs test:"
FENCE = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
# A line that starts a command in an unmarked block: the docs test refuses such a block, so a
# command cannot hide from it by leaving out the info string.
COMMAND_START = re.compile(r"^\s*(\$ |fivefold |torchrun |python3? |TORCH_\w+=)")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
PIP = re.compile(r"^(python3? -m )?pip install\b")
PYTEST = re.compile(r"^python3? -m pytest\b")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        first = self.body.lstrip().splitlines()[0] if self.body.strip() else ""
        if first.startswith(NOT_RUN):
            return first[len(NOT_RUN):].strip()
        return None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for m in FENCE.finditer(text):
        lang = m.group(2).strip().split(" ")[0].lower()
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, lang, m.group(3)))
    return found


def shell_blocks(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL_LANGS]


def runnable_blocks(page: str) -> list[Block]:
    """The shell and python blocks, top to bottom: what the docs test runs of a page."""
    return [b for b in blocks(page) if b.lang in SHELL_LANGS or b.lang == "python"]


def unmarked_command_blocks(page: str) -> list[Block]:
    """Blocks with no info string (or a non-shell one other than code) whose lines look like
    commands: the test refuses them, so every command shown is either run or says why not."""
    code_langs = {"python", "toml", "json", "text", "yaml", "ini", "mermaid", "diff"}
    return [b for b in blocks(page)
            if b.lang not in SHELL_LANGS and b.lang not in code_langs
            and any(COMMAND_START.match(line) for line in b.body.splitlines())]


EXIT_NOTE = re.compile(r"#\s*exit (?:code )?(\d+)\b[^\n]*$")


PRINTS = "# prints:"


@dataclass
class Command:
    text: str
    exit_code: int  # 0; 2 where a transcript shows its refusal ("error: ..."); N for "# exit N"
    shown: tuple[str, ...] = ()  # the output lines the page shows for it


def shown_line(line: str) -> re.Pattern | None:
    """A shown output line as a pattern for one printed line; None for a bare `...`."""
    text = line.strip()
    if text == "...":
        return None
    return re.compile(".*".join(re.escape(part.strip()) for part in text.split("...")))


def missing_lines(shown: tuple[str, ...], printed: str) -> list[str]:
    """The shown lines the printed output lacks, taking them in order: each must match a
    printed line after the one the previous shown line matched."""
    lines = [ln.strip() for ln in printed.splitlines()]
    at, missing = 0, []
    for line in shown:
        pattern = shown_line(line)
        if pattern is None:
            continue
        hit = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def commands(block: Block) -> list[Command]:
    """The block's commands, continuations joined, pip and pytest steps dropped."""
    lines = block.body.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    joined: list[list] = []  # [text, output lines shown]
    current, heredoc_end = "", None
    for line in lines:
        if heredoc_end is not None:  # a here-document's lines belong to its command
            current += "\n" + line
            if line.strip() != heredoc_end:
                continue
            heredoc_end = None
            joined.append([current, []])
            current = ""
            continue
        if prompted and not line.startswith("$ ") and not current:
            if joined and line.strip():
                joined[-1][1].append(line)  # a line the command before printed
            continue
        if not prompted and not current and line.strip().startswith(PRINTS):
            if joined:  # a key line of the command before's output
                joined[-1][1].append(line.strip()[len(PRINTS):].strip())
            continue
        current = (current + "\n" + line) if current else (line[2:] if prompted else line)
        if current.endswith("\\"):
            continue
        heredoc = HEREDOC.search(line)
        if heredoc:
            heredoc_end = heredoc.group(1)
            continue
        joined.append([current, []])
        current = ""
    if current:
        joined.append([current, []])
    out = []
    for text, shown in joined:
        steps = [s.strip() for s in text.split("&&")]
        kept = [s for s in steps if s and not PIP.match(s) and not PYTEST.match(s)]
        text = " && ".join(kept)
        if text.strip() and not text.strip().startswith("#"):  # comments are prose
            note = EXIT_NOTE.search(text.splitlines()[-1])
            refused = bool(shown and shown[0].startswith("error:"))
            out.append(Command(text, int(note.group(1)) if note else 2 if refused else 0,
                               tuple(shown)))
    return out


OUTPUT_DIR_ENV = "DOCS_TEST_OUTPUT"  # where a command whose output a page shows writes it


def script(block: Block) -> str:
    """One bash script for the block: stop at the first command that does not do what the
    page says (exit 0, 2 where the page shows its refusal, N where it says `# exit N`). The
    output of command i that the page shows is kept in $DOCS_TEST_OUTPUT/i as well."""
    lines = ["set -eo pipefail"]
    for i, c in enumerate(commands(block)):
        text = c.text
        if c.shown:  # a group, not a subshell: a `cd` or a variable carries on as written
            text = (f'{{ {text}\n}} > "${OUTPUT_DIR_ENV}/{i}" 2>&1; rc=$?; '
                    f'cat "${OUTPUT_DIR_ENV}/{i}"; (exit $rc)')
        first = shlex.quote(c.text.splitlines()[0][:90].rstrip("\\ "))
        if c.exit_code or c.shown:
            lines.append(f"set +e\n{text}\nrc=$?\nset -e\n"
                         f"[ $rc -eq {c.exit_code} ] || {{ echo \"exit $rc where the page says "
                         f"{c.exit_code}:\" {first} >&2; exit 1; }}")
        else:
            lines.append(text)
        # Where the time goes, on stderr: the docs test is the suite's longest case.
        lines.append(f'echo "[docs test] $SECONDS s:" {first} >&2')
    return "\n".join(lines) + "\n"


DOCTEST_RUNNER = """
import doctest, sys
text, name, line = open(sys.argv[1]).read(), sys.argv[2], int(sys.argv[3])
test = doctest.DocTestParser().get_doctest(text, {"__name__": "__main__"}, name, name, line)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
runner.run(test)
sys.exit(1 if runner.summarize(verbose=False).failed else 0)
"""


def is_doctest(block: Block) -> bool:
    return any(line.startswith(">>> ") for line in block.body.splitlines())


def python_argv(block: Block, source_file: str) -> list[str]:
    """The command that runs a python block written to `source_file`: a doctest of its
    `>>> ` lines, or the block as a script."""
    if is_doctest(block):
        return ["python3", "-c", DOCTEST_RUNNER, source_file, block.page, str(block.line)]
    return ["python3", source_file]


if __name__ == "__main__":
    for page in PAGE_ORDER:
        for b in runnable_blocks(page):
            reason = b.skip_reason
            print(f"== {b.where}" + (f"  (not run: {reason})" if reason is not None else ""))
            if reason is not None:
                continue
            if b.lang == "python":
                print("   python " + ("doctest" if is_doctest(b) else "script"))
                continue
            for c in commands(b):
                mark = f"  [must exit {c.exit_code}]" if c.exit_code else ""
                mark += f"  [shows {len(c.shown)} line(s)]" if c.shown else ""
                print("   " + c.text.replace("\n", "\n   ") + mark)
    sys.exit(0)
