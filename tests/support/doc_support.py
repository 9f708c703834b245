"""Running the docs' code blocks (tests/docs/test_docs.py): extraction, the marker convention, and
runners for shell lines and Python blocks against live daemons.

A block is a fenced code block (```lang). Its *marker* is an HTML comment on the line right
above the fence (invisible when rendered): ``<!-- not run: REASON -->`` says why the block
cannot run here; ``<!-- run: HOW -->`` is a runner's own instruction (docs/pytorch.md).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from feedline.procs import Child, wait_for
from feedline.scrape import scrape

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_CODE = ("text", "console")  # output and diagrams
_FENCE = re.compile(r"(?:^<!-- (.+?) -->\n)?^```([\w-]*)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str  # "" when the fence names none: shell, as the README's commands
    code: str
    marker: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """The reason given for not running it, or None."""
        return self.marker[len("not run:"):].strip() if self.marker.startswith("not run:") \
            else None

    @property
    def runnable(self) -> bool:
        return self.lang not in NOT_CODE and self.not_run is None


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, text[:m.start()].count("\n") + 1 + bool(m.group(1)), m.group(2),
                  m.group(3), m.group(1) or "") for m in _FENCE.finditer(text)]


def shell_lines(code: str) -> list[str]:
    """Logical lines of a shell block: continuations joined; blanks and comments dropped."""
    lines = [line.strip() for line in code.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def commands(line: str) -> list[list[str]]:
    """The simple commands of one line (``a && b`` is two), each as argv, comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lex:
        if token in ("&&", "||", ";", "|", "&"):
            out.append([])
        else:
            out[-1].append(token)
    return [argv for argv in out if argv]


def check_feedline_argv(argv: list[str]) -> str | None:
    """None if ``feedline`` accepts ``argv`` (argv[0] is 'feedline'), else argparse's error.
    Parsed in a subprocess so that argparse's exit and the environment stay there."""
    code = ("import sys; from feedline.commands.main import build_parser; "
            "build_parser().parse_args(sys.argv[1:])")
    r = subprocess.run([sys.executable, "-c", code, *argv[1:]], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    return None if r.returncode == 0 else r.stderr.strip().splitlines()[-1]


def check_script_flags(argv: list[str]) -> str | None:
    """None if every ``--flag`` of ``python SCRIPT ...`` is in the script's --help."""
    script = next(a for a in argv if a.endswith(".py"))
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        return f"{script} --help failed: {r.stderr.strip()[-300:]}"
    missing = [a.split("=")[0] for a in argv if a.startswith("--")
               and a.split("=")[0] not in r.stdout]
    return f"{script} has no {missing}" if missing else None


@dataclass
class Session:
    """Where a doc's blocks run: a scratch directory, the text substitutions that point the
    doc's addresses and paths at live daemons, and the background daemons it started."""

    cwd: Path
    subst: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    daemon_env: dict[str, dict[str, str]] = field(default_factory=dict)  # by subcommand
    background: list[Child] = field(default_factory=list)

    def text(self, code: str) -> str:
        for old, new in self.subst.items():
            code = code.replace(old, new)
        return code

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Child:
        """A background ``feedline ARGV`` (stopped by :meth:`close`)."""
        child = Child([sys.executable, "-m", "feedline.commands", *argv], self.cwd / f"{name}.log",
                      env={"PYTHONPATH": str(ROOT), **self.env, **(env or {})}, cwd=self.cwd)
        self.background.append(child)
        return child

    def close(self) -> None:
        for c in reversed(self.background):
            c.stop()

    # ------------------------------------------------------------------------- shell
    def run_shell(self, block: Block, ready: Callable[[list[str]], Callable[[], bool]]) -> None:
        """Run each command of a shell block; ``feedline broker|producer`` start in the
        background (ready when ``ready(argv)()`` is true), the rest must exit 0."""
        for line in shell_lines(self.text(block.code)):
            for argv in commands(line):
                if argv[:2] in (["feedline", "broker"], ["feedline", "producer"]):
                    log = self.cwd / f"{argv[1]}-{len(self.background)}.log"
                    child = Child([sys.executable, "-m", "feedline.commands", *argv[1:]], log,
                                  env={"PYTHONPATH": str(ROOT), **self.env,
                                       **self.daemon_env.get(argv[1], {})}, cwd=self.cwd)
                    self.background.append(child)
                    wait_for(lambda c=child, a=argv: ready(a)() or not c.alive(), 60,
                             what=f"{block.where}: {shlex.join(argv)}")
                    assert child.alive(), f"{block.where}: {argv}\n{child.log_text()}"
                    continue
                assert argv[0] in ("feedline", "mkdir", "cp", "mv"), (
                    f"{block.where}: tests/docs/test_docs.py does not run `{argv[0]}`; mark the "
                    "block <!-- not run: why --> or teach the test")
                if argv[0] == "feedline":
                    argv = [sys.executable, "-m", "feedline.commands", *argv[1:]]
                r = subprocess.run(argv, cwd=self.cwd, capture_output=True, text=True,
                                   timeout=300, env={**_env(), **self.env})
                assert r.returncode == 0, f"{block.where}: {line}\n{r.stdout}\n{r.stderr}"

    # ------------------------------------------------------------------------ python
    def run_python(self, block: Block, prelude: str, progress: Callable[[int], float],
                   enough: float, timeout: float = 240) -> str:
        """Run a Python block in a subprocess. It passes if it exits 0, or if it is still
        running, without a traceback, once ``progress(pid)`` (a broker counter) has grown by
        ``enough`` since it started: a training loop runs until stopped."""
        script = self.cwd / f"block_{block.doc.stem}_{block.line}.py"
        script.write_text(prelude + "\n" + self.text(block.code))
        log = self.cwd / f"{script.stem}.log"
        child = Child([sys.executable, str(script)], log, cwd=self.cwd,
                      env={"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", **self.env})
        start = progress(child.pid)

        def ran() -> bool:
            return (progress(child.pid) - start >= enough
                    and "Traceback" not in child.log_text())

        try:
            wait_for(lambda: not child.alive() or ran(), timeout, interval=0.2,
                     what=f"{block.where} to run")
            if child.alive():  # still training, having taken `enough` batches
                return child.log_text()
            code = child.proc.poll()
            assert code == 0, (f"{block.where}: exit status {code} "
                               f"(progress {progress(child.pid) - start:.0f}/{enough:.0f})\n"
                               f"{child.log_text()[-4000:]}")
            return child.log_text()
        finally:
            child.stop()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def counter(metrics_port: int, name: str, producer_pid: int | None = None) -> float:
    """A broker counter summed over its series (of one producer process: its default id ends
    with ``-PID``); 0 while the broker does not answer."""
    s = scrape(metrics_port, timeout=2.0)
    if s.error:
        return 0.0
    if producer_pid is None:
        return s.total(name)
    return sum(v for pid, v in s.by_label(name, "producer").items()
               if pid.endswith(f"-{producer_pid}"))
