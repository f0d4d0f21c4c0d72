"""Every command the README and docs/ show runs as written.

The shell blocks (```bash) of README.md and docs/*.md are read as a shell would: comments
dropped, backslash continuations joined, ``VAR=value`` prefixes and ``$ `` prompts skipped. Each
``splitrl ...`` command found is checked without running it: the CLI's own argument parser
takes its arguments, every ``a.b.c=value`` override names a config key that exists (with a
value of the right type), and a ``--config`` file or a checkpoint that ships in the repository
loads with those overrides. A ``python``/``bash`` command's script must exist. Commands are
found, never listed here by hand, so a doc added tomorrow is checked too.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from splitrl.config import Config, ConfigError, load_config, parse_override
from splitrl.config_base import _annotation_at, _section
from splitrl_app import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)
ENV_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the shell blocks of a markdown text, each as its words."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        logical = re.sub(r"\\\n", " ", block)  # backslash continuations
        for line in logical.splitlines():
            line = line.strip()
            line = line[2:] if line.startswith("$ ") else line
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, ";"]:
                if word in ("&&", "||", ";", "|"):
                    if command:
                        commands.append(command)
                    command = []
                else:
                    command.append(word)
    return commands


def _argv(words: list[str]) -> list[str] | None:
    """The arguments after ``splitrl`` (None for a command of another program)."""
    while words and ENV_PREFIX.match(words[0]):
        words = words[1:]
    for prefix in (["splitrl"], [".venv/bin/splitrl"], ["python", "-m", "splitrl"],
                   ["python3", "-m", "splitrl"], [".venv/bin/python", "-m", "splitrl"]):
        if words[:len(prefix)] == prefix:
            return words[len(prefix):]
    return None


def _found() -> list[tuple[str, list[str]]]:
    return [(f"{doc.relative_to(REPO)}: {shlex.join(words)}", words)
            for doc in DOCS for words in shell_commands(doc.read_text())]


COMMANDS = _found()
SPLITRL = [(where, argv) for where, words in COMMANDS if (argv := _argv(words)) is not None]


def test_the_docs_show_splitrl_commands():
    assert len(SPLITRL) > 30  # the extraction finds them (README and docs/ show dozens)
    assert shell_commands("```bash\nsplitrl up \\\n  --config a.yaml  # run\nmake demo\n```\n") == [
        ["splitrl", "up", "--config", "a.yaml"], ["make", "demo"]]


def _key_exists(key: str) -> bool:
    """Whether ``a.b.c`` names a config key (anything under a dict-typed key is free-form)."""
    loc = tuple(key.split("."))
    for i in range(1, len(loc) + 1):
        holder = _section(_annotation_at(Config, loc[:i - 1]))
        if holder is None:
            return i > 1  # inside a mapping (mesh.axes, options): its keys are the user's
        if loc[i - 1] not in holder.model_fields:
            return False
    return True


def problem(argv: list[str]) -> str | None:
    """Why ``splitrl ARGV`` would not run as written (None: it parses and its config loads)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = cli._parse(cli.build_parser(), argv)
            if args.command == "k8s" and args.k8s_args:
                from splitrl_app import k8s

                k8s.build_parser().parse_args(args.k8s_args)
        except SystemExit as e:
            return None if e.code == 0 else err.getvalue().strip()  # --help exits 0
    overrides = getattr(args, "overrides", None) or []
    for text in overrides:
        key, _ = parse_override(text)
        if not _key_exists(key):
            return f"no config key {key!r}"
    config = getattr(args, "config", None)
    if config and (REPO / config).is_file():
        try:
            load_config(REPO / config, overrides)
        except ConfigError as e:
            return str(e)
    return None


def test_the_check_finds_what_would_fail():
    assert "unrecognized arguments: --confg" in problem(["up", "--confg", "a.yaml"])
    assert problem(["up", "trainer.stpes=3"]) == "no config key 'trainer.stpes'"
    assert "expected int" in problem(["up", "--config", "splitrl/configs/demo.yaml",
                                      "trainer.steps=ten"])
    assert problem(["plan", "--config", "docs/plan/llama-3.1-8b.yaml", "--help"]) is None


@pytest.mark.parametrize("where,argv", SPLITRL, ids=[w for w, _ in SPLITRL])
def test_each_splitrl_command_of_the_docs_parses(where, argv):
    assert problem(argv) is None, where


SCRIPTS = [(where, words[1]) for where, words in COMMANDS
           if len(words) > 1 and Path(words[0]).name in ("python", "python3", "bash", "sh")
           and words[1].endswith((".py", ".sh"))]


@pytest.mark.parametrize("where,script", SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_each_script_a_doc_runs_exists(where, script):
    assert (REPO / script).is_file(), f"{where}: no {script} in the repository"


MAKE = [(where, target) for where, words in COMMANDS if words[0] == "make"
        for target in words[1:] if "=" not in target and not target.startswith("-")]


def test_each_make_target_a_doc_names_exists():
    targets = set(re.findall(r"^([\w./-]+):", (REPO / "Makefile").read_text(), re.M))
    assert ("README.md: make demo", "demo") in MAKE and ("README.md: make test", "test") in MAKE
    assert [(where, t) for where, t in MAKE if t not in targets] == []
