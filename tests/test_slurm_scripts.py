"""`primerl slurm` without a cluster: the plan, the batch scripts (valid bash, the options asked for), the files a
run directory gets, `--dry-run` and `add-inference --dry-run`, and bad options refused in one line.
tests/test_slurm.py runs the same commands on a real SLURM cluster."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.cli.slurm import main as slurm_main
from primerl.slurm.plan import PlanError, SlurmPlan, read_plan, read_token
from primerl.slurm.scripts import one_job_script, role_script

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
PRIMERL = str(Path(sys.executable).parent / "primerl")


def bash_syntax_ok(text: str, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text(text)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def sbatch_options(text: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_role_scripts_carry_the_options_and_requeue_through_settle(tmp_path: Path) -> None:
    plan = SlurmPlan(
        run_dir=str(tmp_path / "run"),
        job_name="primerl-x",
        trainer_nodes=2,
        gpus_per_node=4,
        partition="gpu",
        account="lab",
        time_limit="2:00:00",
        sbatch_args=["--qos=high"],
    )
    trainer = role_script(plan, "trainer")
    bash_syntax_ok(trainer, tmp_path)
    options = sbatch_options(trainer)
    for expected in ("--job-name=primerl-x", "--comment=primerl:trainer", "--nodes=2", "--partition=gpu"):
        assert expected in options
    assert {"--account=lab", "--time=2:00:00", "--gpus-per-node=4", "--qos=high", "--requeue"} <= set(options)
    assert "slurm step trainer" in trainer and "slurm settle trainer" in trainer
    broker = role_script(plan, "broker")
    assert "--gpus-per-node=4" not in sbatch_options(broker)  # the broker needs no GPU
    inference = role_script(plan, "inference")
    assert f"--output={plan.slurm_dir}/logs/inference-%A_%a.out" in sbatch_options(inference)
    assert plan.world_size == 8


def test_one_job_script_shares_the_fate_of_its_roles(tmp_path: Path) -> None:
    plan = SlurmPlan(run_dir=str(tmp_path / "run"), job_name="primerl-x", shape="one-job", trainer_nodes=2)
    text = one_job_script(plan)
    bash_syntax_ok(text, tmp_path)
    assert "--nodes=4" in sbatch_options(text) and "--no-requeue" in sbatch_options(text)
    assert 'start trainer "$(join "${nodes[@]:1:2}")"' in text
    assert 'start inference "$(join "${nodes[@]:3:1}")"' in text
    assert "wait -n -p done_pid" in text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shape": "star"}, "--shape 'star'"),
        ({"trainer_nodes": 0}, "--trainer-nodes 0"),
        ({"job_name": "a b"}, "--job-name 'a b'"),
        ({"requeue_limit": -1}, "--requeue-limit"),
    ],
)
def test_bad_plans_are_refused_with_the_fix(fields: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace("'", "'")):
        SlurmPlan(run_dir=str(tmp_path), job_name=fields.pop("job_name", "x"), **fields)


def test_dry_run_writes_the_run_and_prints_every_script(tiny_model: Path, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = ["@", str(EXAMPLE), "--model.name", str(tiny_model), "--run-dir", str(run_dir), "--max-steps", "3"]
    assert slurm_main([*argv, "--trainer-nodes", "2", "--inference-nodes", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for role in ("broker", "trainer", "inference", "orchestrator"):
        assert f"# --- {run_dir}/slurm/{role}.sbatch ---" in out
        assert (run_dir / f"{role}.toml").exists()
        assert "run_token" not in (run_dir / f"{role}.toml").read_text()
    plan = read_plan(run_dir)
    assert (plan.trainer_nodes, plan.inference_nodes, plan.job_name) == (2, 2, "primerl-run")
    assert "num_train_ranks = 2" in (run_dir / "orchestrator.toml").read_text()
    token_file = run_dir / "slurm" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(read_token(run_dir)) > 20
    assert not (run_dir / "slurm" / "jobs.jsonl").exists()  # nothing submitted

    assert slurm_main(["add-inference", str(run_dir), "--nodes", "3", "--dry-run"]) == 0
    assert "sbatch --parsable --array=0-2" in capsys.readouterr().out


def test_bad_commands_get_one_line(tiny_model: Path, tmp_path: Path, capsys) -> None:
    assert slurm_main([]) == 2
    assert "give a config file" in capsys.readouterr().err
    argv = ["@", str(EXAMPLE), "--model.name", str(tiny_model), "--run-dir", str(tmp_path / "r"), "--dry-run"]
    assert slurm_main([*argv, "--shape", "one-job", "--trainer-nodes", "0"]) == 2
    assert "--trainer-nodes 0: give 1 or more nodes" in capsys.readouterr().err
    assert slurm_main(["add-inference", str(tmp_path / "nowhere"), "--nodes", "1"]) == 2
    assert "give the run directory of a `primerl slurm` run" in capsys.readouterr().err
    assert slurm_main([*argv, "--shape", "one-job"]) == 0
    result = subprocess.run([PRIMERL, "slurm", "step", "broker", str(tmp_path / "r")], capture_output=True, text=True)
    assert result.returncode == 1 and "not inside a SLURM job step" in result.stderr
    plan = json.loads((tmp_path / "r" / "slurm" / "plan.json").read_text())
    assert plan["shape"] == "one-job"
