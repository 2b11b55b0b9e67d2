"""The shell commands that README.md and docs/*.md show, as the docs test runs them.

A fenced block is a shell block when its info string is `bash`, `sh` or `console`. In a block
with `$ ` prompts only the prompted lines are commands (the rest is the output they print);
otherwise every line is, with `\\` continuations joined. Blocks run in PAGE_ORDER, each page's
blocks top to bottom, in one scratch copy of the repository, so a later page may use what an
earlier one made (README's set-up trains runs/default, which most pages then use).

What is not run, and why, each said where it is decided:
- a block whose first line is `# not run by the docs test: REASON` (multi-node launches, a
  Slurm script): the reason must be given;
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
    "docs/memory-wall.md", "docs/fp8.md", "docs/planner.md", "docs/planner-table.md",
    "docs/planner-validation.md", "docs/benchmarks.md", "docs/lora.md",
    "docs/quantization.md", "docs/evaluation.md", "docs/serving.md", "docs/development.md",
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


def unmarked_command_blocks(page: str) -> list[Block]:
    """Blocks with no info string (or a non-shell one other than code) whose lines look like
    commands: the test refuses them, so every command shown is either run or says why not."""
    code_langs = {"python", "toml", "json", "text", "yaml", "ini", "mermaid", "diff"}
    return [b for b in blocks(page)
            if b.lang not in SHELL_LANGS and b.lang not in code_langs
            and any(COMMAND_START.match(line) for line in b.body.splitlines())]


EXIT_NOTE = re.compile(r"#\s*exit (?:code )?(\d+)\b[^\n]*$")


@dataclass
class Command:
    text: str
    exit_code: int  # 0; 2 where a transcript shows its refusal ("error: ..."); N for "# exit N"


def commands(block: Block) -> list[Command]:
    """The block's commands, continuations joined, pip and pytest steps dropped."""
    lines = block.body.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    joined: list[list] = []  # [text, first output line]
    current, heredoc_end = "", None
    for line in lines:
        if heredoc_end is not None:  # a here-document's lines belong to its command
            current += "\n" + line
            if line.strip() != heredoc_end:
                continue
            heredoc_end = None
            joined.append([current, None])
            current = ""
            continue
        if prompted and not line.startswith("$ ") and not current:
            if joined and joined[-1][1] is None:
                joined[-1][1] = line  # the first line the command before printed
            continue
        current = (current + "\n" + line) if current else (line[2:] if prompted else line)
        if current.endswith("\\"):
            continue
        heredoc = HEREDOC.search(line)
        if heredoc:
            heredoc_end = heredoc.group(1)
            continue
        joined.append([current, None])
        current = ""
    if current:
        joined.append([current, None])
    out = []
    for text, first_output in joined:
        steps = [s.strip() for s in text.split("&&")]
        kept = [s for s in steps if s and not PIP.match(s) and not PYTEST.match(s)]
        text = " && ".join(kept)
        if text.strip() and not text.strip().startswith("#"):  # comments are prose
            note = EXIT_NOTE.search(text.splitlines()[-1])
            refused = bool(first_output and first_output.startswith("error:"))
            out.append(Command(text, int(note.group(1)) if note else 2 if refused else 0))
    return out


def script(block: Block) -> str:
    """One bash script for the block: stop at the first command that does not do what the
    page says (exit 0, 2 where the page shows its refusal, N where it says `# exit N`)."""
    lines = ["set -eo pipefail"]
    for c in commands(block):
        if c.exit_code:
            lines.append(f"set +e\n{c.text}\nrc=$?\nset -e\n"
                         f"[ $rc -eq {c.exit_code} ] || {{ echo \"exit $rc where the page says "
                         f"{c.exit_code}: {c.text.splitlines()[0]}\" >&2; exit 1; }}")
        else:
            lines.append(c.text)
        # Where the time goes, on stderr: the docs test is the suite's longest case.
        first = shlex.quote(c.text.splitlines()[0][:90].rstrip("\\ "))
        lines.append(f'echo "[docs test] $SECONDS s:" {first} >&2')
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for page in PAGE_ORDER:
        for b in shell_blocks(page):
            reason = b.skip_reason
            print(f"== {b.where}" + (f"  (not run: {reason})" if reason is not None else ""))
            if reason is None:
                for c in commands(b):
                    mark = f"  [must exit {c.exit_code}]" if c.exit_code else ""
                    print("   " + c.text.replace("\n", "\n   ") + mark)
    sys.exit(0)
