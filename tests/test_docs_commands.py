"""The docs' commands against the code (scripts/check_doc_commands.py): every command, flag, config key, make
target, repository path and link in README.md and docs/*.md exists; and the check catches each kind of drift."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_doc_commands.py"


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_doc_commands", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


docs = _load_checker()


@pytest.fixture(scope="module")
def checker():
    return docs.DocChecker(REPO)


def _problems(checker, markdown: str, source: str = "docs/example.md") -> list[str]:
    return [problem.message for problem in checker.check_texts([(source, markdown)])]


def test_readme_and_guides_commands_exist(checker):
    files = docs.doc_files(REPO)
    assert REPO / "README.md" in files and len(files) > 10
    problems = checker.check_files(files)
    assert not problems, "the docs drifted from the code:\n" + "\n".join(map(str, problems))


def test_docs_hold_commands_to_check():
    """The convention is used: the front page and the guides have ```bash blocks with primerl and make commands."""
    commands = [c for f in docs.doc_files(REPO) for c in docs.extract_commands(f.read_text(), f.name)]
    programs = {docs._strip_launcher(list(c.argv))[0] for c in commands if docs._strip_launcher(list(c.argv))}
    assert {"primerl", "make", "primerl-broker", "primerl-infer", "primerl-trainer"} <= programs
    assert len(commands) >= 30


def test_good_commands_pass(checker):
    markdown = """
```bash
make run
make bench BENCH_ARGS="--parts b"
primerl eval reverse-text -m runs/demo/sft -n 200 -r 1 -t 24 -T 1.0    # a comment --not-a-flag
primerl rl @ examples/reverse_text_rl.toml --orchestrator.batch-size 64 --max-steps 3
primerl-trainer @ trainer.toml --optim.lr 1e-5
a$ primerl status --broker 10.0.0.2:50051 --watch
cat examples/reverse_text_rl.toml | grep seq_len
```
Prose: `primerl plot RUN_DIR [--output DIR] [--smooth N]`, [the configs](configs.md#the-three-shapes).
"""
    assert _problems(checker, markdown) == []


def test_a_made_up_flag_fails(checker):
    markdown = "```bash\nprimerl eval reverse-text -m runs/demo/sft --made-up-flag 3\n```\n"
    assert _problems(checker, markdown) == ["`primerl eval` has no option --made-up-flag"]


DRIFT = [
    ("primerl rl @ examples/reverse_text_rl.toml --orchestrator.bach-size 3", "key `orchestrator.bach_size`"),
    ("primerl rl @ my_run.toml --made-up-setting 1", "unknown key"),
    ("primerl-broker --spool-dir x --grpc-prot 5", "unknown key"),
    ("primerl no-such-command --flag", "`primerl no-such-command` fails: primerl: unknown command"),
    ("primerl env uninstall foo", "`primerl env uninstall` fails"),
    ("make no-such-target", "no make target 'no-such-target'"),
    ("make test NO_SUCH_VARIABLE=1", "the Makefile uses no variable NO_SUCH_VARIABLE"),
    ("cat examples/no_such_file.toml", "no such file in the repository: examples/no_such_file.toml"),
    (".venv/bin/python scripts/demo_report.py --made-up", "scripts/demo_report.py has no option --made-up"),
    ("b$ torchrun --nproc-per-node 2 $(which primerl-trainer) @ t.toml --optim.made-up 1", "unknown key"),
]


@pytest.fixture(scope="module")
def drift_problems(checker):
    """One check of every drift case (one child process for all), each in its own made-up file."""
    texts = [(f"docs/drift-{i}.md", f"```bash\n{line}\n```\n") for i, (line, _) in enumerate(DRIFT)]
    problems: dict[int, list[str]] = {i: [] for i in range(len(DRIFT))}
    for problem in checker.check_texts(texts):
        problems[int(problem.where.split("-")[1].split(".")[0])].append(problem.message)
    return problems


@pytest.mark.parametrize("case", range(len(DRIFT)), ids=[line.split(" --")[0][:40] for line, _ in DRIFT])
def test_each_kind_of_drift_fails(drift_problems, case):
    expected = DRIFT[case][1]
    assert len(drift_problems[case]) == 1 and expected in drift_problems[case][0], drift_problems[case]


def test_toml_blocks_are_run_config_fragments(checker):
    good = '```toml\n[[orchestrator.env]]\nid = "my-env"\nargs = { difficulty = 2 }\n```\n'
    bad = "```toml\n[orchestrator.teacher]\ntimeout_s = 120\nmax_retrys = 3\n```\n"
    broken = "```toml\n[orchestrator\n```\n"
    problems = checker.check_texts([("docs/good.md", good), ("docs/bad.md", bad), ("docs/broken.md", broken)])
    assert [p.where for p in problems] == ["docs/bad.md:2", "docs/broken.md:2"], problems
    assert "unknown key `orchestrator.teacher.max_retrys`" in problems[0].message


def test_a_synopsis_with_a_made_up_flag_fails(checker):
    problems = _problems(checker, "Use `primerl plot RUN_DIR [--output DIR] [--smoothing N]` to plot.\n")
    assert problems == ["`primerl plot` has no option --smoothing"]


def test_inline_make_targets_must_exist(checker):
    problems = _problems(checker, "Run `make test EXTRAS=gpu,dev`, `make TARGET VAR=...` or `make tests`.\n")
    assert problems == ["no make target 'tests' in the Makefile"]


def test_inline_paths_must_exist_unless_moved(checker):
    markdown = (
        "Read `examples/reverse_text_rl.toml` and `examples/gone.toml`; `bench/` is there, `nobench/x.py` is not ours;"
        " `orchestrator/env_worker.py` -> `orchestrator/envs/remote/classic_worker.py`; metric `trainer/step`.\n"
    )
    assert _problems(checker, markdown) == ["no such file in the repository: examples/gone.toml"]


def test_links_and_anchors_must_resolve(checker):
    markdown = (
        "[a](configs.md#the-three-shapes) [b](no-such-guide.md) [c](configs.md#no-such-heading) [d](https://x.org/a)\n"
    )
    assert _problems(checker, markdown) == [
        "link to a missing file: no-such-guide.md",
        "link to a missing heading: configs.md#no-such-heading",
    ]


def test_text_blocks_and_exports():
    markdown = """
```text
primerl eval ENV -m MODEL --anything
```
```bash
export PRIMERL_RUN_TOKEN=secret
host$ primerl-broker @ b.toml && primerl status > out.txt 2>&1 &
primerl certs --out certs/ --host 127.0.0.1 | grep -v '^#' > sec.toml && \\
    primerl rl @ run.toml @ sec.toml
```
"""
    commands = docs.extract_commands(markdown, "x.md")
    assert [c.argv for c in commands] == [
        ("primerl-broker", "@", "b.toml"),
        ("primerl", "status"),
        ("primerl", "certs", "--out", "certs/", "--host", "127.0.0.1"),
        ("grep", "-v", "^#"),
        ("primerl", "rl", "@", "run.toml", "@", "sec.toml"),
    ]
    assert all(c.exported == (("PRIMERL_RUN_TOKEN", "secret"),) for c in commands)
    assert commands[-1].where == "x.md:8"


def test_heading_anchors_follow_github():
    anchors = docs.heading_anchors(
        "# Faults\n## Restarts and process hygiene under `primerl rl`\n## Encrypted wire (opt-in)\n"
        "## verifiers v1 environments (verifiers 0.4)\n```bash\n# not a heading\n```\n## Encrypted wire (opt-in)\n"
    )
    assert anchors == {
        "faults",
        "restarts-and-process-hygiene-under-primerl-rl",
        "encrypted-wire-opt-in",
        "verifiers-v1-environments-verifiers-04",
        "encrypted-wire-opt-in-1",
    }
