"""The teacher as a served role (online distillation): `[teacher]` in a whole-run config (its alias, port, the
settings filled in, `orchestrator.teacher`, the refusals), the role configs `primerl rl --dry-run --write` writes,
the CPU and memory budget of a second vLLM engine, and a real `primerl-infer --role teacher` on the tiny model
joined to a real broker: it registers as ROLE_TEACHER, `ListWorkers` and `primerl status` list it as a teacher,
a weight update published to the broker never reaches it, it answers prompt logprobs in the shape the
orchestrator reads (matching transformers), and it stops cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.daemons import InferenceDaemon
from support.inference import AUTH, TOKEN, full_update, perturbed_model
from support.rl_configs import BASE, config_writer, error_of, load

from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2, control_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_distill.toml"
BIN = Path(sys.executable).parent
TEACHER_MODEL = "teacher-model"


@pytest.fixture
def write(tmp_path):
    return config_writer(tmp_path)


# ------------------------------------------------------------------------------------------------- config
def test_the_example_loads_a_teacher_on_its_own_port_and_points_the_orchestrator_at_it():
    config = load("@", EXAMPLE, "--teacher.model.name", "runs/demo/rl/weights/step_30")
    teacher = config.teacher
    assert teacher is not None and teacher.role == "teacher" and not teacher.enable_lora
    assert teacher.model.name == "runs/demo/rl/weights/step_30"
    assert teacher.server.port == 0 and config.port_clashes() == []  # a free port of its own
    assert teacher.model.max_model_len == config.inference.model.max_model_len + 1 == 513
    assert teacher.model.dtype == config.inference.model.dtype
    assert teacher.kv_cache_memory_bytes == 64 * 2**20  # its own; inference keeps 128 MiB
    assert config.inference.kv_cache_memory_bytes == 128 * 2**20
    assert teacher.broker.address == config.inference.broker.address
    assert config.teacher_gpu_ids == [2]
    assert config.orchestrator.teacher.model == "runs/demo/rl/weights/step_30"
    assert config.orchestrator.teacher.base_url == []  # the broker lists the teacher
    assert config.trainer.loss.teacher_tau == 1.0 and config.trainer.loss.adv_tau == 0.0
    roles = config.role_configs()
    assert list(roles) == ["broker", "trainer", "orchestrator", "inference", "teacher"]
    assert roles["inference"].role == "inference" and roles["teacher"].role == "teacher"


def test_teacher_inference_is_prime_rls_name_for_the_teacher_table(write):
    config = load(
        "@",
        write(
            "rl.toml",
            BASE
            + f"""
        [trainer.loss]
        teacher_tau = 0.5

        [teacher_inference.model]
        name = "{TEACHER_MODEL}"
        """,
        ),
    )
    assert config.teacher.model.name == TEACHER_MODEL and config.teacher.role == "teacher"
    assert config.orchestrator.teacher.model == TEACHER_MODEL
    assert config.teacher_gpu_ids == [2]  # after inference [0] and trainer [1]
    message = error_of(
        write(
            "both.toml",
            BASE
            + f"""
        [teacher.model]
        name = "{TEACHER_MODEL}"
        [teacher_inference.model]
        name = "{TEACHER_MODEL}"
        """,
        )
    )
    assert "[teacher]" in message and "[teacher_inference]" in message


def test_teacher_gpu_ids_alone_start_a_teacher_of_the_run_model(write):
    """prime-rl's way: `teacher_gpu_ids` with no table serves the run's model (self-distillation)."""
    config = load("@", write("rl.toml", "teacher_gpu_ids = [2, 3]\n" + BASE))
    assert config.teacher.model.name == "tiny-model" == config.orchestrator.teacher.model
    assert config.teacher.parallel.dp == 2 and config.teacher_gpu_ids == [2, 3]


def test_an_orchestrator_teacher_the_user_wrote_is_kept(write):
    config = load(
        "@",
        write(
            "rl.toml",
            BASE
            + f"""
        [teacher.model]
        name = "{TEACHER_MODEL}"

        [orchestrator.teacher]
        timeout_s = 30
        """,
        ),
    )
    assert config.orchestrator.teacher.model == TEACHER_MODEL and config.orchestrator.teacher.timeout_s == 30
    with pytest.warns(UserWarning, match="orchestrator.teacher.base_url"):
        config = load(
            "@",
            write(
                "external.toml",
                BASE
                + f"""
            [teacher.model]
            name = "{TEACHER_MODEL}"

            [orchestrator.teacher]
            base_url = ["http://elsewhere:8000/v1"]
            """,
            ),
        )
    assert config.orchestrator.teacher.model is None  # an external teacher: its own model list decides
    # prime-rl's spelling of the orchestrator's teacher is left as written (its own model name)
    config = load(
        "@",
        write(
            "alias.toml",
            BASE
            + f"""
        [teacher.model]
        name = "{TEACHER_MODEL}"

        [orchestrator.teacher_model.model]
        name = "served-name"
        """,
        ),
    )
    assert config.orchestrator.teacher.model == "served-name"


def test_no_teacher_means_no_teacher_role(write):
    config = load("@", write("rl.toml", BASE))
    assert config.teacher is None and config.teacher_gpu_ids is None and config.orchestrator.teacher is None
    assert "teacher" not in config.role_configs()


def test_teacher_tau_without_any_teacher_is_refused_naming_both_settings(write):
    message = error_of(
        write(
            "rl.toml",
            BASE
            + """
        [trainer.loss]
        teacher_tau = 1.0
        adv_tau = 0.0
        """,
        )
    )
    assert "trainer.loss.teacher_tau = 1 needs a teacher" in message
    assert "[teacher]" in message and "[orchestrator.teacher]" in message
    # an external teacher is enough
    config = load(
        "@",
        write(
            "external.toml",
            BASE
            + """
        [trainer.loss]
        teacher_tau = 1.0

        [orchestrator.teacher]
        base_url = ["http://elsewhere:8000/v1"]
        """,
        ),
    )
    assert config.teacher is None and config.orchestrator.teacher.base_url == ["http://elsewhere:8000/v1"]


@pytest.mark.parametrize(
    "table, expected",
    [
        (
            '[teacher]\nrole = "inference"',
            "teacher.role = 'inference': the [teacher] table always runs role \"teacher\"",
        ),
        ("[teacher]\nenable_lora = true", 'role = "teacher" serves a fixed model and no LoRA adapters'),
        ('[inference]\nrole = "teacher"', "[inference] serves the policy; put the teacher in a [teacher] table"),
        ("[teacher.model]\nmax_model_len = 1024", "teacher.model.max_model_len (1024) must exceed seq_len (1024)"),
    ],
)
def test_bad_teacher_settings_are_refused_with_the_setting_to_change(write, table, expected):
    message = error_of(write("rl.toml", BASE + "\n" + table + "\n"))
    assert expected in message, message


def test_teacher_gpus_must_be_its_own(write):
    message = error_of(write("rl.toml", "teacher_gpu_ids = [1]\n" + BASE))
    assert "GPUs [1] are in both teacher_gpu_ids [1] and trainer_gpu_ids [1]" in message
    message = error_of(write("tp.toml", "teacher_gpu_ids = [2]\n" + BASE + "\n[teacher.parallel]\ntp = 2\n"))
    assert "teacher.parallel.tp x dp = 2 x 1 = 2 GPUs, but teacher_gpu_ids has 1" in message
    assert load("@", write("tp2.toml", BASE + "\n[teacher.parallel]\ntp = 2\n")).teacher_gpu_ids == [2, 3]


def test_fixed_teacher_and_inference_ports_that_clash_are_reported(write):
    with pytest.warns(UserWarning, match="inference.server.port and teacher.server.port are both 8000"):
        config = load(
            "@",
            write(
                "rl.toml",
                BASE
                + """
            [inference.server]
            port = 8000
            [teacher.server]
            port = 8000
            """,
            ),
        )
    assert config.port_clashes() == [
        "inference.server.port and teacher.server.port are both 8000; give each its own port, or 0 for a free one"
    ]
    # inference's fixed port is not copied to the teacher
    config = load("@", write("fixed.toml", BASE + "\n[inference.server]\nport = 8000\n[teacher]\n"))
    assert config.teacher.server.port == 0 and config.port_clashes() == []


def test_dry_run_writes_a_teacher_toml_that_primerl_infer_accepts(tmp_path):
    out = tmp_path / "configs"
    result = subprocess.run(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(EXAMPLE),
            "--teacher.model.name",
            TEACHER_MODEL,
            "--dry-run",
            "--write",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "broker.toml",
        "inference.toml",
        "orchestrator.toml",
        "rl.toml",
        "teacher.toml",
        "trainer.toml",
    ]
    result = subprocess.run(
        [str(BIN / "primerl-infer"), "@", str(out / "teacher.toml"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert 'role = "teacher"' in result.stdout and f'name = "{TEACHER_MODEL}"' in result.stdout
    assert "max_model_len = 513" in result.stdout
    # the whole run's file loads again as it was written
    again = load("@", out / "rl.toml")
    assert again.teacher.model.name == TEACHER_MODEL and again.orchestrator.teacher.model == TEACHER_MODEL


def test_a_teacher_shares_the_inference_cpus_and_the_memory_check_counts_both_engines(write):
    from primerl.cli.preflight.system import engine_memory_check
    from primerl.runtime.cpu_budget import VLLM_BIND_VAR, role_env
    from primerl.supervisor.role_configs import thread_budgets

    config = load("@", write("rl.toml", BASE + "\n[teacher]\nkv_cache_memory_bytes = 67108864\n"))
    roles = config.role_configs()
    budgets = thread_budgets(config, roles, gpus=False)
    assert budgets["teacher"].cpus == budgets["inference"].cpus  # a second engine on the same cores
    assert roles["teacher"].threads == budgets["teacher"]
    assert (
        role_env("teacher", budgets["teacher"])[VLLM_BIND_VAR]
        == role_env("inference", budgets["inference"])[VLLM_BIND_VAR]
    )
    engines = {"inference": roles["inference"], "teacher": roles["teacher"]}
    [finding] = engine_memory_check(engines, gpus=False, available_bytes=3 * 2**30)()
    assert not finding.error
    assert "2 vLLM engine(s) need about 4.3 GiB" in finding.message
    assert "inference.kv_cache_memory_bytes and teacher.kv_cache_memory_bytes" in finding.message
    assert engine_memory_check(engines, gpus=False, available_bytes=8 * 2**30)() == []
    assert engine_memory_check(engines, gpus=True, available_bytes=2**20)() == []


def test_a_teacher_with_another_tokenizer_is_a_warning(tmp_path):
    from primerl.cli.preflight.model import teacher_tokenizer_check

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for path, vocab in ((student, "a"), (teacher, "b")):
        path.mkdir()
        (path / "tokenizer.json").write_text(vocab)
    [finding] = teacher_tokenizer_check(str(teacher), str(student))()
    assert not finding.error and "another tokenizer.json than the student's" in finding.message
    assert teacher_tokenizer_check(str(student), str(student))() == []


def test_the_preflight_of_primerl_rl_checks_the_teacher_model(tmp_path, tiny_model):
    from primerl.cli.preflight.roles import rl_checks

    config = load("@", EXAMPLE, "--model.name", str(tiny_model), "--teacher.model.name", str(tmp_path / "missing"))
    checks = rl_checks(config)
    [finding] = checks["model"]()
    assert finding.error and finding.message.startswith(f"teacher.model.name = '{tmp_path / 'missing'}' does not exist")
    assert checks["teacher"]() == [] and "memory" in checks  # no tokenizer to compare with a missing model
    config = load("@", EXAMPLE, "--model.name", str(tiny_model), "--teacher.model.name", str(tiny_model))
    assert rl_checks(config)["model"]() == []


def test_status_shows_a_teacher_in_its_own_row():
    from primerl.supervisor.status_view import render_status

    status = control_pb2.RunStatus(
        run_id="r",
        workers=[
            control_pb2.WorkerInfo(
                name="infer-0",
                role=common_pb2.ROLE_INFERENCE,
                address="http://127.0.0.1:8000",
                state=control_pb2.WORKER_STATE_ALIVE,
                policy_version=3,
            ),
            control_pb2.WorkerInfo(
                name="teacher-0",
                role=common_pb2.ROLE_TEACHER,
                address="http://127.0.0.1:8001",
                state=control_pb2.WORKER_STATE_ALIVE,
            ),
        ],
    )
    [row] = [line for line in render_status(status).splitlines() if line.startswith("teacher-0")]
    assert row.split()[:4] == ["teacher-0", "teacher", "alive", "http://127.0.0.1:8001"]
    assert "frozen teacher" in row and "policy v" not in row


# ------------------------------------------------------------------------------- the real teacher daemon
def _prompt_logprobs(http: httpx.Client, model: str, token_ids: list[int]) -> list:
    """The teacher request of the contract: the sample's token ids as the prompt, one token, prompt logprobs."""
    response = http.post(
        "/v1/completions",
        headers=AUTH,
        json={"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-primerl-policy-version"] == "0"
    return response.json()["choices"][0]["prompt_logprobs"]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_teacher_daemon_registers_as_teacher_serves_prompt_logprobs_and_never_gets_weights(
    tmp_path, tiny_model, make_broker
):
    from primerl.broker.metrics import BrokerCollector
    from primerl.inference.logprob_check import reference_logprobs

    broker = make_broker(run_token=TOKEN, heartbeat_interval_s=0.2, run_id="teacher-test")
    teacher = InferenceDaemon(
        tmp_path,
        tiny_model,
        broker.grpc_address,
        TOKEN,
        "--role",
        "teacher",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--broker.connect-timeout-s",
        "30",
        max_model_len=64,
        name="teacher",
    )
    try:
        assert teacher.ready["role"] == "teacher"
        with broker.client(role="client", name="teacher-test-observer") as client:
            [listed] = client.list_workers(role=common_pb2.ROLE_TEACHER)
            assert client.list_workers(role="inference") == []
        assert listed.role == common_pb2.ROLE_TEACHER and listed.state == control_pb2.WORKER_STATE_ALIVE
        assert listed.address == teacher.ready["advertised_url"] and listed.worker_id == teacher.ready["worker_id"]
        assert listed.capabilities["role"] == "teacher" and listed.capabilities["model"] == str(tiny_model)
        assert not listed.HasField("policy_version")
        [workers] = [m for m in BrokerCollector(broker.service).collect() if m.name == telemetry.BROKER_WORKERS]
        assert {s.labels["role"]: s.value for s in workers.samples}["teacher"] == 1

        shown = subprocess.run(
            [str(BIN / "primerl"), "status", "--broker", broker.grpc_address, "--token", TOKEN],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        [row] = [line for line in shown.stdout.splitlines() if line.startswith(listed.name)]
        assert row.split()[1:4] == ["teacher", "alive", teacher.ready["advertised_url"]] and "frozen teacher" in row

        http = httpx.Client(base_url=teacher.url, timeout=60)
        assert http.get("/v1/models").status_code == 401  # the run token is checked as on inference workers
        model = http.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
        token_ids = [5, 17, 230, 41, 99, 7, 512, 300, 12, 64, 3, 800]
        before = _prompt_logprobs(http, model, token_ids)
        assert len(before) == len(token_ids) and before[0] is None
        served = [entry[str(token)]["logprob"] for entry, token in zip(before[1:], token_ids[1:], strict=True)]
        reference = reference_logprobs(tiny_model, token_ids[:1], token_ids[1:], temperature=1.0)
        assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4

        # A weight update published to the broker is stored for inference workers; none of it goes to the teacher.
        _, weights = perturbed_model(tiny_model, tmp_path / "perturbed", seed=1)
        assert broker.publish(*full_update(1, weights)).applied
        time.sleep(2.0)  # ten heartbeat intervals: a subscriber would have had the update pushed by now
        plane = broker.service.weight_plane.status()
        assert plane.workers == () and plane.bytes_out_total == 0  # no subscriber, nothing pushed
        assert _prompt_logprobs(http, model, token_ids) == before  # the same model answers
        with broker.client(role="client", name="teacher-test-observer") as client:
            [listed] = client.list_workers(role="teacher")
        assert listed.state == control_pb2.WORKER_STATE_ALIVE and not listed.HasField("policy_version")
        http.close()
    finally:
        code = teacher.stop(timeout_s=30)
    log = teacher.log_path.read_text()
    assert code == 0, log[-4000:]
    assert "teacher ready" in log and "teacher stopped" in log and "role=teacher" in log
    assert "weight update" not in log and "weight plane" not in log and "resubscribing" not in log
    with broker.client(role="client", name="teacher-test-observer") as client:
        [gone] = client.list_workers(role="teacher", include_gone=True)
    assert gone.state == control_pb2.WORKER_STATE_LEFT
