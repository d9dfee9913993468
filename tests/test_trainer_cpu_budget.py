"""Thread budgets of the roles (primerl.runtime.cpu_budget) and how the launcher hands them out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from primerl.runtime.cpu_budget import ThreadsConfig, default_budgets, describe, fill_budget, resolved, role_env


def test_two_cores_split_give_every_role_one_thread_and_vllm_one_bound_cpu():
    budgets = default_budgets([0, 1], gpus=False, sharing="split")
    assert budgets["inference"].cpus == [0] and budgets["inference"].num_threads == 1
    assert budgets["trainer"].num_threads == 1 and budgets["trainer"].cpus is None
    assert budgets["orchestrator"].num_threads == 1 and budgets["broker"].num_threads == 1
    assert all(b.wait_policy == "passive" for b in budgets.values())
    assert "inference 1 on CPUs 0" in describe(budgets)


def test_larger_machines_split_the_cpus_between_inference_and_trainer():
    budgets = default_budgets(list(range(8, 16)), gpus=False, sharing="split")
    assert budgets["inference"].cpus == [8, 9, 10, 11]
    assert budgets["trainer"].num_threads == 4
    one = default_budgets([3], gpus=False, sharing="split")
    assert one["inference"].cpus == [3] and one["trainer"].num_threads == 1
    gpus = default_budgets(list(range(8)), gpus=True, sharing="split")
    assert gpus["inference"].cpus is None and gpus["trainer"].num_threads == 4
    assert default_budgets(list(range(8)), gpus=False, num_trainer_ranks=2, sharing="split")["trainer"].num_threads == 2
    assert default_budgets([0, 1], gpus=False, num_trainer_ranks=2, sharing="split")["trainer"].num_threads == 1
    with pytest.raises(ValueError):
        default_budgets([], gpus=False)


def test_shared_gives_trainer_and_vllm_every_core_and_leaves_the_light_roles_one_thread():
    budgets = default_budgets([0, 1], gpus=False, sharing="shared")
    assert budgets["inference"].cpus == [0, 1] and budgets["inference"].num_threads == 2
    assert budgets["teacher"].cpus == [0, 1]
    assert budgets["trainer"].num_threads == 2 and budgets["trainer"].cpus is None
    assert budgets["orchestrator"].num_threads == 1 and budgets["broker"].num_threads == 1
    assert all(b.wait_policy == "passive" for b in budgets.values())  # a waiting role sleeps: no spin on shared cores
    assert role_env("inference", budgets["inference"])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    big = default_budgets(list(range(4, 12)), gpus=False, sharing="shared", num_trainer_ranks=2)
    assert big["inference"].cpus == list(range(4, 12)) and big["trainer"].num_threads == 4
    assert default_budgets([5], gpus=False, sharing="shared")["inference"].cpus == [5]
    # With GPUs the compute is not on the CPUs: both modes give the same budgets.
    assert default_budgets(list(range(8)), gpus=True, sharing="shared") == default_budgets(
        list(range(8)), gpus=True, sharing="split"
    )
    with pytest.raises(ValueError, match="shared.*split"):
        default_budgets([0, 1], gpus=False, sharing="half")  # type: ignore[arg-type]


def test_explicit_values_win_over_the_default_split():
    default = ThreadsConfig(num_threads=1, cpus=[0])
    filled = fill_budget(ThreadsConfig(num_threads=3, wait_policy="active"), default)
    assert (filled.num_threads, filled.wait_policy, filled.cpus) == (3, "active", [0])
    assert fill_budget(None, default) == default
    assert resolved(None, cpus=[0, 1, 2]).num_threads == 3


def test_torchrun_ranks_of_a_standalone_trainer_share_the_cpus(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolved(None, cpus=[0, 1, 2, 3]).num_threads == 2
    assert resolved(ThreadsConfig(num_threads=3), cpus=[0, 1, 2, 3]).num_threads == 3


def test_role_env_sets_thread_counts_wait_policy_and_the_vllm_binding():
    env = role_env("inference", ThreadsConfig(num_threads=5, cpus=[2, 3]))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "2"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["KMP_BLOCKTIME"] == "0"
    trainer = role_env("trainer", ThreadsConfig(num_threads=1, wait_policy="active"))
    assert trainer["OMP_NUM_THREADS"] == "1" and trainer["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in trainer
    with pytest.raises(ValueError):
        role_env("painter", ThreadsConfig())


def test_bad_cpu_lists_are_refused():
    for cpus in ([], [1, 1], [-1]):
        with pytest.raises(ValueError):
            ThreadsConfig(cpus=cpus)


def test_a_daemon_applies_its_budget_before_torch_loads():
    code = (
        "import json, os\n"
        "from primerl.runtime.cpu_budget import ThreadsConfig, apply_budget\n"
        "apply_budget('trainer', ThreadsConfig(num_threads=1, num_interop_threads=1))\n"
        "import torch\n"
        "print(json.dumps({'threads': torch.get_num_threads(), 'interop': torch.get_num_interop_threads(),\n"
        "                  'omp': os.environ['OMP_NUM_THREADS'], 'wait': os.environ['OMP_WAIT_POLICY']}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "OPENBLAS_", "KMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "threads": 1,
        "interop": 1,
        "omp": "1",
        "wait": "PASSIVE",
    }


def test_the_launcher_writes_each_roles_budget_into_its_config(tmp_path, monkeypatch):
    from primerl.configs.rl import RLConfig
    from primerl.supervisor.role_configs import thread_budgets

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    config = RLConfig.model_validate(
        {
            "model": {"name": str(tmp_path)},
            "max_steps": 2,
            "output_dir": str(tmp_path / "run"),
            "broker": {},
            "trainer": {"threads": {"num_threads": 3}},
            "orchestrator": {"env": [{"id": "reverse-text"}]},
            "inference": {"threads": {"num_threads": 1}},
        }
    )
    roles = config.role_configs()
    budgets = thread_budgets(config, roles, gpus=False)
    assert roles["trainer"].threads.num_threads == 3  # explicit wins
    assert roles["inference"].threads.cpus == [0]  # one thread asked for: one CPU bound
    assert roles["orchestrator"].threads.num_threads == 1
    assert budgets["broker"].num_threads == 1
    assert role_env("trainer", budgets["trainer"])["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(
    ("sharing", "inference_cpus", "trainer_threads"),
    [("shared", [0, 1, 2, 3], 4), ("split", [0, 1], 2), (None, None, 4)],
)
def test_cpu_sharing_of_the_run_config_picks_the_default_budgets(
    tmp_path, monkeypatch, sharing, inference_cpus, trainer_threads
):
    from primerl.configs.rl import RLConfig
    from primerl.runtime.cpu_budget import CPU_SHARING_DEFAULT
    from primerl.supervisor.role_configs import thread_budgets

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    raw = {
        "model": {"name": str(tmp_path)},
        "output_dir": str(tmp_path / "run"),
        "broker": {},
        "trainer": {},
        "orchestrator": {"env": [{"id": "reverse-text"}]},
        "inference": {"threads": {"wait_policy": "active"}},
    }
    if sharing is not None:
        raw["cpu_sharing"] = sharing
    config = RLConfig.model_validate(raw)
    assert config.cpu_sharing == (sharing or CPU_SHARING_DEFAULT)
    roles = config.role_configs()
    thread_budgets(config, roles, gpus=False)
    expected = default_budgets([0, 1, 2, 3], gpus=False, sharing=config.cpu_sharing)
    assert roles["inference"].threads.cpus == (inference_cpus or expected["inference"].cpus)
    assert roles["inference"].threads.wait_policy == "active"  # explicit fields still win
    assert roles["trainer"].threads.num_threads == (trainer_threads if sharing else expected["trainer"].num_threads)
    with pytest.raises(ValueError, match="cpu_sharing"):
        RLConfig.model_validate({**raw, "cpu_sharing": "half"})
