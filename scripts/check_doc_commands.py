"""Check the commands in the docs against the code, so the docs cannot drift silently.

    python scripts/check_doc_commands.py     # README.md, docs/*.md, deploy/ and bench/README.md; exit 1 on problems
    python scripts/check_doc_commands.py docs/multi-host.md

The convention: a fenced block marked ```bash (or ```sh) holds commands a reader can type; usage synopses with
placeholders go in ```text blocks or inline code. In every ```bash block, one command per line (``\\`` joins
lines, ``#`` starts a comment, ``a$ `` names the host a line runs on, ``&&``, ``||``, ``;`` and ``|`` separate
commands):

- ``primerl SUB ...`` and ``primerl-ROLE ...`` (also after ``torchrun``, ``sudo``, ``.venv/bin/``): the command
  exists; a command that reads a config (``rl``, ``sft`` and the four daemons) is run with ``--dry-run``, which
  refuses an unknown flag or config key (an ``@ FILE`` the repository does not hold is replaced by a stand-in);
  for the others every ``-x`` / ``--flag`` must be one that ``--help`` lists;
- ``make TARGET VAR=...``: the target is in the Makefile and the variable is one it uses;
- ``python SCRIPT ...`` with a script of the repository: every flag is in what ``SCRIPT --help`` prints;
- any word whose first path part is a top-level entry of the repository (``examples/...``, ``deploy/...``) names
  a file or directory that exists; so does such an inline path of the prose with a file suffix or a final ``/``
  (unless ``->`` follows it: a path that moved).

A ```toml block is a fragment of a ``primerl rl`` config: layered after ``examples/reverse_text_rl.toml``, it must
pass ``--dry-run``. Markdown links to files of the repository (and their ``#anchors``) must resolve too.

All CLI calls run in one child process (``--cli-batch``), each subcommand's ``--help`` once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_LANGS = frozenset({"bash", "sh"})
# Commands that read a config: checked with --dry-run. An `@ FILE` missing from the repository gets a stand-in: for
# rl and sft the example config, for a daemon its file from `primerl rl @ RL_STAND_IN --dry-run --write DIR`.
RL_STAND_IN = "examples/reverse_text_rl.toml"
CONFIG_STAND_INS = {"rl": RL_STAND_IN, "sft": "examples/reverse_text_sft.toml"}
ROLE_FILES = {"broker": "broker.toml", "trainer": "trainer.toml", "infer": "inference.toml"}
ROLE_FILES["orchestrator"] = "orchestrator.toml"
CONFIG_COMMANDS = frozenset(CONFIG_STAND_INS) | frozenset(ROLE_FILES)
ENTRY_POINTS = {"primerl-broker": "broker", "primerl-trainer": "trainer", "primerl-infer": "infer"}
ENTRY_POINTS["primerl-orchestrator"] = "orchestrator"
# Flags of a config command that --dry-run must not see (they start things or only make sense in a live run).
DRY_RUN_DROPPED = frozenset({"--check", "--tmux", "--no-preflight", "--dry-run"})
# Guides being written beside this one; a link to one of them may dangle until it lands (then drop it here).
PENDING_DOCS: frozenset[str] = frozenset()  # docs linked before they land (excuses their dangling links only)
DEFAULT_DOCS = ("README.md", "docs/*.md", "deploy/README.md", "bench/README.md")
SKIPPED_DOCS = frozenset({"docs/config-reference.md"})  # generated from the config models


@dataclass(frozen=True)
class DocCommand:
    """One command of a ```bash block: where it is, the text as written, its words, and the variables that an
    `export NAME=VALUE` earlier in the block set."""

    where: str
    text: str
    argv: tuple[str, ...]
    exported: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Problem:
    where: str
    text: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}\n    {self.text}"


# --- reading the docs ---------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_HOST_PROMPT = re.compile(r"^(?:[\w.-]+)?\$\s+")
_WHICH = re.compile(r"\$\(which\s+([\w.-]+)\)")
_SEPARATORS = frozenset({"&&", "||", ";", "|", "&", "|&"})
_REDIRECT = re.compile(r"(?<!\S)\d*(?:>>?|<|&>)(?:&\d+|\s*[^\s|&;<>]+)")


def shell_blocks(markdown: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block marked bash or sh."""
    return fenced_blocks(markdown, SHELL_LANGS)


def fenced_blocks(markdown: str, langs: frozenset[str]) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block marked with one of ``langs``."""
    blocks, lines = [], markdown.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match.group(2), match.group(3).lower(), i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence[:3]):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in langs:
            blocks.append((start + 1, body))
    return blocks


def _logical_lines(first_line: int, lines: list[str]) -> Iterable[tuple[int, str]]:
    pending, start = "", first_line
    for offset, line in enumerate(lines):
        if not pending:
            start = first_line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: words without comments, redirections or host prompts."""
    line = _REDIRECT.sub(" ", _WHICH.sub(r"\1", _HOST_PROMPT.sub("", line.strip())))
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for word in lexer:
        if word in _SEPARATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    commands.append(words)
    return [words for words in commands if words]


def extract_commands(markdown: str, source: str) -> list[DocCommand]:
    """Every simple command in the ```bash blocks of one markdown text."""
    found = []
    for first_line, body in shell_blocks(markdown):
        exported: dict[str, str] = {}
        for line_no, line in _logical_lines(first_line, body):
            where = f"{source}:{line_no}"
            try:
                parts = split_commands(line)
            except ValueError as exc:
                found.append(DocCommand(where, line.strip(), ("<unparsable>", str(exc))))
                continue
            for words in parts:
                if words[0] == "export":
                    exported.update(word.split("=", 1) for word in words[1:] if "=" in word)
                    continue
                found.append(DocCommand(where, line.strip(), tuple(words), tuple(sorted(exported.items()))))
    return found


# --- what the repository holds ------------------------------------------------------------------------------------


def top_level_entries(repo: Path) -> frozenset[str]:
    """The names at the top of the repository that git tracks (what a path in the docs may start with)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True, timeout=30
        ).stdout.decode()
        names = {path.split("/", 1)[0] for path in listed.split("\0") if path}
    except (OSError, subprocess.SubprocessError):
        names = {p.name for p in repo.iterdir() if not p.name.startswith(".") and p.name not in ("runs", "outputs")}
    return frozenset(names - {"README.md"})


def makefile_names(repo: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(targets, variables) of the Makefile."""
    text = (repo / "Makefile").read_text()
    targets, variables = set(), set()
    for line in text.splitlines():
        if line.startswith(("\t", "#", " ")):
            continue
        assignment = re.match(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?|:|::|\+)?=", line)
        if assignment:
            variables.add(assignment.group(1))
            continue
        rule = re.match(r"^([^:=#]+?)\s*::?(?!=)", line)
        if rule:
            targets.update(name for name in rule.group(1).split() if not name.startswith((".", "$")))
    variables.update(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))
    return frozenset(targets), frozenset(variables)


# --- the CLI calls, run in one child process ----------------------------------------------------------------------


def _run_one(argv: list[str], exported: dict[str, str]) -> dict:
    from primerl.cli.main import main as primerl_main

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(exported)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = primerl_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - reported as the check's finding, with its type
            rc = 1
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    os.environ.clear()
    os.environ.update(saved)
    return {"rc": int(rc or 0), "stdout": out.getvalue(), "stderr": err.getvalue()}


def _cli_batch(calls_path: str, results_path: str) -> int:
    calls = json.loads(Path(calls_path).read_text())
    results = [_run_one(call["argv"], call["env"]) for call in calls]
    Path(results_path).write_text(json.dumps(results))
    return 0


def run_cli_batch(
    calls: Sequence[Sequence[str]], repo: Path, envs: Sequence[dict[str, str]] | None = None, timeout_s: float = 300
) -> list[dict]:
    """Run ``primerl ARGV`` for each call in one child process (cwd: the repository), with the call's extra
    environment variables; rc, stdout, stderr each."""
    if not calls:
        return []
    envs = envs or [{} for _ in calls]
    with tempfile.TemporaryDirectory(prefix="doc-commands-") as tmp:
        calls_path, results_path = Path(tmp, "calls.json"), Path(tmp, "results.json")
        calls_path.write_text(json.dumps([{"argv": list(c), "env": dict(e)} for c, e in zip(calls, envs)]))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.pop("PRIMERL_RUN_TOKEN", None)
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--cli-batch", str(calls_path), str(results_path)],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0 or not results_path.exists():
            raise RuntimeError(f"the CLI batch failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        return json.loads(results_path.read_text())


def run_script_help(script: Path, repo: Path, timeout_s: float = 120) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    done = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    return done.stdout + done.stderr


# --- checking -----------------------------------------------------------------------------------------------------

_INLINE_SUFFIX = re.compile(r"\.(py|md|toml|sh|proto|service|target|conf|json|jsonl|txt|cfg|ini|yaml|yml)$")
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)")


def options_in(help_text: str) -> frozenset[str]:
    return frozenset(match.rstrip(".,") for match in _OPTION.findall(help_text))


def _flag(word: str) -> str | None:
    """The option a word is (``--a=b`` -> ``--a``), or None for values and plain words."""
    if not word.startswith("-") or word in ("-", "--") or re.match(r"^-\d", word):
        return None
    return word.split("=", 1)[0]


@dataclass
class _PrimerlCall:
    command: DocCommand
    key: tuple[str, ...]  # ("rl",), ("env", "install"), () for bare `primerl`
    args: list[str]
    synopsis: bool = False  # an inline `primerl ...` of the prose: only its command and plain flags are checked
    toml_fragment: str | None = None  # a ```toml block: layered on the example run config, then --dry-run


def _strip_launcher(words: list[str]) -> list[str]:
    """Drop `sudo`, `VAR=value` prefixes, `.venv/bin/` and torchrun with its options."""
    words = list(words)
    while words and (words[0] in ("sudo", "exec", "env", "time") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words.pop(0)
    if words and Path(words[0]).name == "torchrun":
        for index, word in enumerate(words):
            if Path(word).name.startswith("primerl"):
                return [Path(word).name] + words[index + 1 :]
        return []
    if words and words[0].startswith((".venv/bin/", "./.venv/bin/")):
        words[0] = Path(words[0]).name
    return words


class DocChecker:
    """Checks markdown texts against one repository: its files, Makefile, scripts and the installed primerl CLI."""

    def __init__(self, repo: Path = REPO) -> None:
        self.repo = repo
        self.top_level = top_level_entries(repo)
        self.make_targets, self.make_variables = makefile_names(repo)
        self._script_help: dict[Path, str] = {}
        self._help: dict[tuple[str, ...], dict] = {}  # command -> its --help run (rc, stdout, stderr)

    def check_texts(self, texts: Sequence[tuple[str, str]]) -> list[Problem]:
        """Problems of (source name, markdown) pairs; source names are paths relative to the repository."""
        problems: list[Problem] = []
        calls: list[_PrimerlCall] = []
        for source, text in texts:
            problems += self.check_links(source, text)
            problems += self.check_inline_paths(source, text)
            for command in extract_commands(text, source):
                problems += self._check_command(command, calls)
            calls += self._synopses(source, text)
            problems += self._inline_make(source, text)
            calls += self._toml_fragments(source, text)
        problems += self._check_primerl_calls(calls)
        return problems

    def check_files(self, paths: Sequence[Path]) -> list[Problem]:
        texts = [(str(p.resolve().relative_to(self.repo)), p.read_text()) for p in paths]
        return self.check_texts(texts)

    # paths and links

    def _repo_path(self, word: str) -> str | None:
        """The repository path a word names, when its first part is a top-level entry (else None)."""
        word = word.removeprefix("./")
        if "/" not in word and word not in self.top_level:
            return None
        if any(ch in word for ch in "*?{}$<>[]") or word.startswith(("/", "~", "..")):
            return None
        first = word.split("/", 1)[0]
        return word if first in self.top_level else None

    def check_paths(self, command: DocCommand) -> list[Problem]:
        problems = []
        for word in command.argv:
            for candidate in (word, word.split("=", 1)[-1], word.lstrip("@")):
                path = self._repo_path(candidate)
                if path is not None:
                    if not (self.repo / path).exists():
                        problems.append(Problem(command.where, command.text, f"no such file in the repository: {path}"))
                    break
        return problems

    def check_inline_paths(self, source: str, text: str) -> list[Problem]:
        """Inline `dir/file.ext` and `dir/` spans of the prose name files that exist (a span followed by `->` is a
        path that moved, which may be gone)."""
        problems, in_fence = [], False
        for line_no, line in enumerate(text.splitlines(), 1):
            if _FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for match in re.finditer(r"`([^`\s]+)`(\s*->)?", line):
                span, moved = match.group(1), match.group(2)
                if moved or "/" not in span or not (span.endswith("/") or _INLINE_SUFFIX.search(span)):
                    continue
                path = self._repo_path(span)
                if path is not None and not (self.repo / path).exists():
                    problems.append(
                        Problem(f"{source}:{line_no}", line.strip(), f"no such file in the repository: {path}")
                    )
        return problems

    def check_links(self, source: str, text: str) -> list[Problem]:
        problems = []
        base = (self.repo / source).parent
        lines = text.splitlines()
        in_fence = False
        for line_no, line in enumerate(lines, 1):
            if _FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue
                path_part, _, anchor = target.partition("#")
                file = (base / path_part).resolve() if path_part else (self.repo / source).resolve()
                where = f"{source}:{line_no}"
                try:
                    relative = str(file.relative_to(self.repo))
                except ValueError:
                    relative = str(file)
                if not file.exists():
                    if relative not in PENDING_DOCS:
                        problems.append(Problem(where, line.strip(), f"link to a missing file: {target}"))
                    continue
                if anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
                    problems.append(Problem(where, line.strip(), f"link to a missing heading: {target}"))
        return problems

    # commands

    def _check_command(self, command: DocCommand, calls: list[_PrimerlCall]) -> list[Problem]:
        if command.argv[:1] == ("<unparsable>",):
            return [Problem(command.where, command.text, f"cannot split it as a shell line: {command.argv[1]}")]
        problems = self.check_paths(command)
        words = _strip_launcher(list(command.argv))
        if not words:
            return problems
        program = words[0]
        if program == "primerl":
            key, args = self._primerl_key(words[1:])
            calls.append(_PrimerlCall(command, key, args))
        elif program in ENTRY_POINTS:
            calls.append(_PrimerlCall(command, (ENTRY_POINTS[program],), words[1:]))
        elif program == "make":
            problems += self._check_make(command, words[1:])
        elif re.match(r"^python(3(\.\d+)?)?$", Path(program).name) and len(words) > 1:
            problems += self._check_script(command, words[1:])
        return problems

    def _synopses(self, source: str, text: str) -> list[_PrimerlCall]:
        """The inline `primerl ...` / `primerl-ROLE ...` spans of the prose (placeholders and brackets allowed)."""
        calls, in_fence = [], False
        for line_no, line in enumerate(text.splitlines(), 1):
            if _FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for span in re.findall(r"`(primerl(?:-[a-z]+)?(?: [^`]*)?)`", line):
                if "<" in span:
                    continue
                words = re.sub(r"\\\|", " ", re.sub(r"[\[\]{}]", " ", span)).split()
                command = DocCommand(f"{source}:{line_no}", f"`{span}`", tuple(words))
                if words[0] == "primerl":
                    key, args = self._primerl_key(words[1:])
                elif words[0] in ENTRY_POINTS:
                    key, args = (ENTRY_POINTS[words[0]],), words[1:]
                else:
                    continue
                if any(not re.match(r"^[a-z][a-z0-9-]*$", part) for part in key):  # `primerl SUB ...`, `primerl ...`
                    continue
                calls.append(_PrimerlCall(command, key, args, synopsis=True))
        return calls

    def _inline_make(self, source: str, text: str) -> list[Problem]:
        """Inline `make TARGET VAR=...` spans of the prose: the targets and variables exist (placeholders skipped)."""
        problems, in_fence = [], False
        for line_no, line in enumerate(text.splitlines(), 1):
            if _FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for span in re.findall(r"`(make [^`]+)`", line):
                try:
                    words = shlex.split(span)
                except ValueError:
                    continue
                if any(word.split("=", 1)[0].isupper() and "=" not in word for word in words[1:]):
                    continue  # `make TARGET VAR=...`: a synopsis
                problems += self._check_make(DocCommand(f"{source}:{line_no}", f"`{span}`", tuple(words)), words[1:])
        return problems

    @staticmethod
    def _toml_fragments(source: str, text: str) -> list[_PrimerlCall]:
        """Each ```toml block, as a fragment of a `primerl rl` config (checked layered on the example config)."""
        calls = []
        for first_line, body in fenced_blocks(text, frozenset({"toml"})):
            command = DocCommand(f"{source}:{first_line}", "```toml block: " + (body[0].strip() if body else ""), ())
            calls.append(_PrimerlCall(command, ("rl",), [], toml_fragment="\n".join(body) + "\n"))
        return calls

    @staticmethod
    def _primerl_key(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
        if not args or args[0].startswith("-"):
            return (), args
        if args[0] == "env" and len(args) > 1 and not args[1].startswith("-"):
            return ("env", args[1]), args[2:]
        return (args[0],), args[1:]

    def _check_make(self, command: DocCommand, args: list[str]) -> list[Problem]:
        problems = []
        for word in args:
            if word.startswith("-"):
                continue
            if "=" in word:
                name = word.split("=", 1)[0]
                if name not in self.make_variables:
                    problems.append(Problem(command.where, command.text, f"the Makefile uses no variable {name}"))
            elif word not in self.make_targets:
                problems.append(Problem(command.where, command.text, f"no make target {word!r} in the Makefile"))
        return problems

    def _check_script(self, command: DocCommand, args: list[str]) -> list[Problem]:
        if args[0].startswith("-"):  # python -m ..., python -c ...: not a script of the repository
            return []
        relative = self._repo_path(args[0])
        if relative is None or not (self.repo / relative).exists():
            return []  # a missing repository path is reported by check_paths
        script = self.repo / relative
        if script not in self._script_help:
            self._script_help[script] = run_script_help(script, self.repo)
        known = options_in(self._script_help[script])
        return [
            Problem(command.where, command.text, f"{relative} has no option {flag} (its --help does not list it)")
            for flag in filter(None, map(_flag, args[1:]))
            if flag not in known and flag not in ("-h", "--help")
        ]

    def _check_primerl_calls(self, calls: list[_PrimerlCall]) -> list[Problem]:
        """One child process: each new command's --help, then the dry runs (after writing the daemons' stand-ins)."""
        new_keys = sorted({call.key for call in calls} - set(self._help))
        dry_run_calls = [c for c in calls if c.key and c.key[0] in CONFIG_COMMANDS and not c.synopsis]
        problems: list[Problem] = []
        with tempfile.TemporaryDirectory(prefix="doc-commands-write-") as write_dir:
            roles_dir = str(Path(write_dir, "roles"))
            batch = [[*key, "--help"] for key in new_keys]
            if dry_run_calls:
                batch.append(["rl", "@", RL_STAND_IN, "--dry-run", "--write", roles_dir])  # the daemons' stand-ins
            batch += [self._dry_run_argv(call, write_dir, roles_dir) for call in dry_run_calls]
            envs = [{} for _ in range(len(batch) - len(dry_run_calls))]
            envs += [dict(call.command.exported) for call in dry_run_calls]
            results = run_cli_batch(batch, self.repo, envs)
        self._help.update(zip(new_keys, results))
        dry_results = results[len(new_keys) :]
        if dry_run_calls and dry_results[0]["rc"] != 0:
            raise RuntimeError(f"the stand-in role configs could not be written: {dry_results[0]['stderr'][-2000:]}")
        dry_run_result = dict(zip(map(id, dry_run_calls), dry_results[1:]))
        for call in calls:
            result, name = self._help[call.key], " ".join(("primerl", *call.key))
            if result["rc"] != 0:
                first = (result["stderr"].strip().splitlines() or ["(no output)"])[0]
                problems.append(Problem(call.command.where, call.command.text, f"`{name}` fails: {first}"))
            elif id(call) in dry_run_result:
                done = dry_run_result[id(call)]
                if done["rc"] != 0:
                    output = done["stderr"].strip() or done["stdout"].strip() or f"exit {done['rc']}"
                    message = re.sub(r"\S*fragment-\d+\.toml", "the block", " ".join(output.split()))[:600]
                    problems.append(Problem(call.command.where, call.command.text, f"`{name} --dry-run`: {message}"))
            else:
                known = options_in(result["stdout"] + result["stderr"])
                for flag in filter(None, map(_flag, call.args)):
                    if call.synopsis and "." in flag:  # a config key (or a placeholder such as --a.b)
                        continue
                    if flag not in known and flag not in ("-h", "--help"):
                        problems.append(
                            Problem(call.command.where, call.command.text, f"`{name}` has no option {flag}")
                        )
        return problems

    def _dry_run_argv(self, call: _PrimerlCall, write_dir: str, roles_dir: str) -> list[str]:
        role = call.key[0]
        stand_in = CONFIG_STAND_INS.get(role) or str(Path(roles_dir, ROLE_FILES[role]))
        if call.toml_fragment is not None:
            fragment = Path(write_dir, f"fragment-{id(call)}.toml")
            fragment.write_text(call.toml_fragment)
            return ["rl", "@", RL_STAND_IN, "@", str(fragment), "--dry-run"]
        argv, args = list(call.key), list(call.args)
        i = 0
        while i < len(args):
            word = args[i]
            if word == "@" and i + 1 < len(args):
                path = args[i + 1]
                if (self.repo / path).is_file():
                    argv += ["@", path]
                elif stand_in not in argv:
                    argv += ["@", stand_in]
                i += 2
                continue
            if word in DRY_RUN_DROPPED:
                i += 1
                continue
            if word == "--write" and i + 1 < len(args):
                argv += ["--write", str(Path(write_dir, f"call-{id(call)}"))]
                i += 2
                continue
            argv.append(word)
            i += 1
        if "@" not in argv and role in CONFIG_STAND_INS:  # a daemon without a file runs on its defaults
            argv[1:1] = ["@", stand_in]
        return argv + ["--dry-run"]


def heading_anchors(markdown: str) -> frozenset[str]:
    """GitHub's anchors of a markdown text's headings (lower case, punctuation dropped, spaces to dashes)."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not re.match(r"^#{1,6}\s", line):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(anchors)


def doc_files(repo: Path = REPO, patterns: Sequence[str] = DEFAULT_DOCS) -> list[Path]:
    files = []
    for pattern in patterns:
        files += sorted(p for p in repo.glob(pattern) if str(p.relative_to(repo)) not in SKIPPED_DOCS)
    return files


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cli-batch"]:
        return _cli_batch(argv[1], argv[2])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    paths = [Path(a).resolve() for a in argv] or doc_files()
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        print(f"check_doc_commands: no such file: {', '.join(missing)} (give markdown files of the repository)")
        return 2
    problems = DocChecker().check_files(paths)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in {len(paths)} file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
