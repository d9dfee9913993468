"""Trainer checkpoints: round trip, retention, atomicity under SIGKILL, bit-identical resume, HF export."""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import primerl.trainer.checkpoint as checkpoint_module
from primerl.trainer.checkpoint import (
    MODEL_FILE,
    CheckpointNotFoundError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    rng_file,
    save_checkpoint,
    steps_to_prune,
)
from primerl.trainer.committed_dir import STABLE_FILE
from primerl.trainer.weights_export import export_hf_weights

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKEN_POOL = torch.randint(0, 1024, (8, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def tiny_dir(small_tiny_model: Path) -> Path:
    return small_tiny_model


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_training(tiny_dir: Path, *, lora: bool = False):
    """Model (attention dropout on, so the torch RNG is consumed), AdamW and a warm-up LambdaLR."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), attn_implementation="eager", attention_dropout=0.1)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> float:
    """One step on a randomly sampled batch; python, numpy and torch RNGs all change the loss."""
    batch = TOKEN_POOL[torch.randint(0, TOKEN_POOL.shape[0], (2,))]
    scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
    loss = model(input_ids=batch, labels=batch).loss * scale
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def linear_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    return model, optimizer, scheduler


def save_linear(root: Path, step: int) -> Path:
    model, optimizer, scheduler = linear_training(step)
    return save_checkpoint(
        root, step, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"step": step}
    )


# ---------------------------------------------------------------------------------------------------- round trip


def test_round_trip_restores_model_optimizer_scheduler_and_rng(tiny_dir: Path, tmp_path: Path) -> None:
    seed_all(1)
    model, optimizer, scheduler = build_training(tiny_dir)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    extra = {"step": 2, "policy_version": 2, "data": {"epoch": 0, "position": 17}}
    path = save_checkpoint(
        tmp_path / "ckpt", 2, model=model, optimizer=optimizer, scheduler=scheduler, extra_state=extra
    )
    assert path == tmp_path / "ckpt" / "step_2"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MODEL_FILE, "optimizer.pt", "scheduler.pt", "extra_state.json", "meta.json", rng_file(0), STABLE_FILE]
    )
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(4))

    seed_all(99)
    fresh_model, fresh_optimizer, fresh_scheduler = build_training(tiny_dir)
    assert (
        load_checkpoint(tmp_path / "ckpt", model=fresh_model, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
        == extra
    )
    assert (random.random(), float(np.random.rand())) == expected_draws[:2]
    assert torch.equal(torch.rand(4), expected_draws[2])
    for (name, want), (_, got) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(want, got), name
    want_state, got_state = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want_state["param_groups"] == got_state["param_groups"]
    for index, state in want_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got_state["state"][index][key]), (index, key)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_lora_checkpoint_holds_only_the_adapter(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    seed_all(2)
    model, optimizer, scheduler = build_training(tiny_dir, lora=True)
    train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={})
    with safe_open(str(path / MODEL_FILE), framework="pt") as handle:
        keys = list(handle.keys())
        assert handle.metadata()["peft_base_model"] == str(tiny_dir)
    assert keys and all("lora_" in key for key in keys)

    seed_all(3)  # another adapter init
    fresh, fresh_optimizer, fresh_scheduler = build_training(tiny_dir, lora=True)
    load_checkpoint(tmp_path, 1, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    for (name, want), (_, got) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(want, got), name

    full, _, _ = build_training(tiny_dir)
    with pytest.raises(ValueError, match="peft_trainable"):
        load_checkpoint(tmp_path, 1, model=full, optimizer=None, scheduler=None)


# ---------------------------------------------------------------------------------------------------- resume


def test_resume_continues_the_same_loss_curve(tiny_dir: Path, tmp_path: Path) -> None:
    seed_all(0)
    training = build_training(tiny_dir)
    uninterrupted = [train_step(*training) for _ in range(6)]

    seed_all(0)
    training = build_training(tiny_dir)
    resumed = [train_step(*training) for _ in range(3)]
    model, optimizer, scheduler = training
    save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"step": 3})
    del training, model, optimizer, scheduler

    seed_all(12345)  # a restarted process: other RNG states, fresh model and optimizer
    model, optimizer, scheduler = build_training(tiny_dir)
    extra = load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert extra == {"step": 3}
    resumed += [train_step(model, optimizer, scheduler) for _ in range(3)]

    assert resumed == uninterrupted
    assert len(set(uninterrupted)) == 6


# ---------------------------------------------------------------------------------------------------- retention


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_interval", "deleted"),
    [
        ([1, 2, 3, 4, 5], 2, None, [1, 2, 3]),
        ([10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 3, 50, [10, 20, 30, 40, 60, 70]),
        ([1, 2, 3, 4, 5], 1, 2, [1, 3]),
        ([1, 2, 3, 4, 5], None, 2, []),  # keep_last unset: keep all
        ([1, 2, 3], 1, 1, []),  # every step is a multiple of 1
        ([5], 1, None, []),
        ([], 3, None, []),
        ([3, 1, 2], 1, None, [1, 2]),  # order of the listing does not matter
        ([2, 4, 6], 5, None, []),
    ],
)
def test_steps_to_prune(steps: list[int], keep_last: int | None, keep_interval: int | None, deleted: list[int]) -> None:
    assert steps_to_prune(steps, keep_last=keep_last, keep_interval=keep_interval) == deleted


def test_retention_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_prune([1], keep_last=0, keep_interval=None)
    with pytest.raises(ValueError, match="keep_interval"):
        steps_to_prune([1], keep_last=1, keep_interval=0)


def test_prune_deletes_only_committed_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_linear(tmp_path, step)
    (tmp_path / "step_0").mkdir()  # no STABLE: not a checkpoint, not pruned
    assert prune_checkpoints(tmp_path, keep_last=2, keep_interval=2) == [1]
    assert list_checkpoints(tmp_path) == [2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0", "step_2", "step_3", "step_4"]


def test_prune_skips_a_checkpoint_another_trainer_pruned_first(tmp_path: Path, monkeypatch) -> None:
    """Two trainers of a run (one superseding the other) may prune the same directory: a step that is gone by the
    time this one renames it is skipped, not an error."""
    for step in (1, 2, 3):
        save_linear(tmp_path, step)
    listed = list_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / "step_1")  # the other trainer's prune, between this one's listing and its rename
    monkeypatch.setattr(checkpoint_module, "list_checkpoints", lambda root: listed)
    assert prune_checkpoints(tmp_path, keep_last=1, keep_interval=None) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


# ---------------------------------------------------------------------------------------------------- errors, leftovers


def test_missing_step_lists_the_available_ones(tmp_path: Path) -> None:
    model, optimizer, scheduler = linear_training()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    save_linear(tmp_path, 1)
    save_linear(tmp_path, 3)
    with pytest.raises(CheckpointNotFoundError, match=r"step 2 .*available steps: \[1, 3\]"):
        load_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler)


def test_unserialisable_extra_state_writes_nothing(tmp_path: Path) -> None:
    model, optimizer, scheduler = linear_training()
    with pytest.raises(TypeError):
        save_checkpoint(
            tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"bad": object()}
        )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_leftover_temp_dirs_are_ignored_and_cleaned(tmp_path: Path) -> None:
    save_linear(tmp_path, 1)
    leftover = tmp_path / "step_5.tmp-4242"  # complete but never renamed: still not a checkpoint
    leftover.mkdir()
    (leftover / MODEL_FILE).write_bytes(b"partial")
    (leftover / STABLE_FILE).write_bytes(b"")
    (tmp_path / "step_7").mkdir()  # no marker
    (tmp_path / "step_8.trash-77").mkdir()
    assert list_checkpoints(tmp_path) == [1]
    assert latest_checkpoint(tmp_path) == 1

    model, optimizer, scheduler = linear_training()
    assert load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_7"]

    leftover.mkdir()
    save_linear(tmp_path, 2)
    assert not leftover.exists()
    assert list_checkpoints(tmp_path) == [1, 2]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    save_linear(tmp_path, 1)
    model, optimizer, scheduler = linear_training(seed=7)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"again": 1})
    fresh, _, _ = linear_training(seed=0)
    assert load_checkpoint(tmp_path, 1, model=fresh, optimizer=None, scheduler=None) == {"again": 1}
    assert torch.equal(fresh.weight, model.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


_KILL_CHILD = """
import json, sys, time
import torch
from primerl.trainer import checkpoint as ck

root, kill_at = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
scheduler.step()
ck.save_checkpoint(root, 1, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"step": 1})
print("saved " + json.dumps(model.weight.tolist()), flush=True)
with torch.no_grad():
    model.weight.add_(1.0)

def block(*args):
    print("saving", flush=True)
    time.sleep(120)

if kill_at == "after_first_file":
    fsync_file = ck.fsync_file
    def slow_fsync(path):
        fsync_file(path)
        block()
    ck.fsync_file = slow_fsync
else:  # before_rename: STABLE is in the temp dir already
    ck.commit_dir = block
ck.save_checkpoint(root, 2, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"step": 2})
print("unexpected: save finished", flush=True)
"""


def _start_line_reader(proc: subprocess.Popen) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue[str], prefix: str, timeout_s: float) -> str:
    """The next line of the child's stdout that starts with `prefix` (log lines go there too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"child printed no line starting with {prefix!r} within {timeout_s}s") from None
        if line.startswith(prefix):
            return line.rstrip("\n")


@pytest.mark.parametrize("kill_at", ["after_first_file", "before_rename"])
def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, kill_at: str) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD, str(root), kill_at],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = _start_line_reader(proc)
        saved = _wait_for_line(lines, "saved ", 60)
        weight_at_step_1 = torch.tensor(json.loads(saved.removeprefix("saved ")))
        _wait_for_line(lines, "saving", 60)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()

    temp_dirs = [p.name for p in root.iterdir() if p.name.startswith("step_2.tmp-")]
    assert temp_dirs == [f"step_2.tmp-{proc.pid}"]
    assert (STABLE_FILE in os.listdir(root / temp_dirs[0])) == (kill_at == "before_rename")
    assert list_checkpoints(root) == [1]
    assert latest_checkpoint(root) == 1

    model, optimizer, scheduler = linear_training(seed=5)
    assert load_checkpoint(root, model=model, optimizer=optimizer, scheduler=scheduler) == {"step": 1}
    assert torch.equal(model.weight, weight_at_step_1)
    assert scheduler.last_epoch == 1
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # the load removed the temp dir


# ---------------------------------------------------------------------------------------------------- multi-rank


def test_two_ranks_write_one_checkpoint(tmp_path: Path) -> None:
    barrier = threading.Barrier(2, timeout=30)
    model, optimizer, scheduler = linear_training()
    results: dict[int, Path] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = save_checkpoint(
                tmp_path,
                4,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                extra_state={"step": 4},
                rank=rank,
                world_size=2,
                barrier=barrier.wait,
            )
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert results == {0: tmp_path / "step_4", 1: tmp_path / "step_4"}
    names = sorted(p.name for p in (tmp_path / "step_4").iterdir())
    assert {rng_file(0), rng_file(1), MODEL_FILE, STABLE_FILE} <= set(names)
    assert json.loads((tmp_path / "step_4" / "meta.json").read_text())["world_size"] == 2
    fresh, _, _ = linear_training(seed=3)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=None, scheduler=None, rank=1) == {"step": 4}
    assert torch.equal(fresh.weight, model.weight)

    with pytest.raises(ValueError, match="barrier"):
        save_checkpoint(tmp_path, 5, model=model, optimizer=None, scheduler=None, extra_state={}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        save_checkpoint(tmp_path, 5, model=model, optimizer=None, scheduler=None, extra_state={}, rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------------- HF export


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_export_full_weights_loads_in_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seed_all(4)
    model, optimizer, scheduler = build_training(tiny_dir)
    train_step(model, optimizer, scheduler)
    out = export_hf_weights(model, tiny_dir, tmp_path / "weights" / "step_1")
    assert out == tmp_path / "weights" / "step_1"
    assert (out / STABLE_FILE).is_file() and (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["step_1"]

    loaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    model.eval()
    assert torch.equal(_logits(loaded, TOKEN_POOL), _logits(model, TOKEN_POOL))
    assert AutoTokenizer.from_pretrained(str(out))("hello world")["input_ids"]


def test_export_lora_merges_without_touching_the_training_model(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    seed_all(5)
    model, optimizer, scheduler = build_training(tiny_dir, lora=True)
    train_step(model, optimizer, scheduler)
    model.eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    base_only, _, _ = build_training(tiny_dir)
    assert not torch.allclose(_logits(base_only.eval(), TOKEN_POOL), _logits(model, TOKEN_POOL), atol=1e-3)

    out = export_hf_weights(model, tiny_dir, tmp_path / "weights" / "step_1")
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as handle:
        keys = list(handle.keys())
    assert not [key for key in keys if "lora" in key or "base_layer" in key]
    assert "model.layers.0.self_attn.q_proj.weight" in keys

    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)

    loaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(loaded, TOKEN_POOL), _logits(model, TOKEN_POOL), rtol=1e-5, atol=1e-5)
    reference = model.merge_and_unload()  # the last use of the training model: peft's own merge, bit for bit
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_export_replaces_an_existing_directory(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, _, _ = build_training(tiny_dir)
    out = tmp_path / "step_2"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    (tmp_path / "step_2.tmp-999").mkdir()  # leftover of a killed export
    started = time.monotonic()
    export_hf_weights(model, None, out)
    assert time.monotonic() - started < 30
    assert not (out / "stale.txt").exists() and (out / STABLE_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    AutoModelForCausalLM.from_pretrained(str(out))


def test_a_failed_save_leaves_no_temp_dir(tmp_path: Path) -> None:
    class BrokenOptimizer:
        def state_dict(self) -> dict:
            raise RuntimeError("disk full")

    save_linear(tmp_path, 1)
    model, _, scheduler = linear_training()
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=BrokenOptimizer(), scheduler=scheduler, extra_state={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
