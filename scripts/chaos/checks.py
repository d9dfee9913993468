"""The checks of one chaos run, from primerl's own outputs (the roles' logs, ``metrics.jsonl``, the checkpoints
directory, the run status) plus the harness's record of what it killed, and the per-run summary.

The final lineage of the weights: the last trainer incarnation resumed from checkpoint ``r`` (0: from scratch)
and trained steps ``r+1..``; checkpoint ``r`` was written by the latest earlier incarnation that logged
``checkpoint saved step=r``, which itself trained from its own resume point, and so on back to step 0. A step
trained by an incarnation outside that chain (killed before its checkpoint, the step then trained again after the
rollback) is counted as retrained, which is fine; an incarnation trained a step when it logged its ``step done`` or
published its version (it may die between the two). A ``step done`` with ``from_checkpoint`` for the step an incarnation
resumed at is the record of that step (its trainer died between the checkpoint and the record).
Checks:

- lost: a step of 1..N with no ``step done`` in the lineage; duplicated: a step done twice in the lineage;
- metrics rows: each step of 1..N has a trainer row in ``metrics.jsonl``, and no step has more rows than
  trainings;
- mismatched: a lineage step whose ``data_digest`` is not one the orchestrator logged (``step sending`` or
  ``step sent``) for that step (a digest missing on either side is unverified, and fails too). ``step sending``
  counts: an orchestrator killed after the broker spooled its step but before ``step sent`` leaves only that line,
  and the broker keeps its copy over the restarted orchestrator's (idempotent by batch id);
- unplanned exits: an exit the harness did not cause (a kill or the stop at the end; the trainer's exit 0 and the
  orchestrator's exit 0 once every step is produced are the run's normal end; the trainer's exit 1 on a checkpoint
  disk the harness held full is the harness's, like a kill);
- final status: every inference worker serves the latest policy version, which is N;
- spool: the broker's ``COMMITTED`` file says N (every step committed); batch files left are noted;
- leftovers: no process started by the run alive after it;
- mid-send: the step an orchestrator died in the middle of sending (its fault point) is trained on a set that an
  orchestrator restarted after it sent whole (``step sent``), never on the partial one alone;
- relay (mode separate): after the relay worker's kill mid-relay, the inference worker serves that update (or a
  later one) within ``RELAY_HEAL_BOUND_S``: the broker's relay timeout heals the chain around the dead relay.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from primerl.proto import telemetry

from .driver import RunRecord, served_final
from .logs import Incarnation, read_incarnations, read_metrics_rows
from .plan import CHECKPOINT_DISK, SPOOL_DISK
from .runs import RELAY_ROLE, RELAY_TIMEOUT_S, ROLES

RELAY_HEAL_BOUND_S = RELAY_TIMEOUT_S + 25.0
"""A relay killed mid-relay: the inference worker serves the update within the relay timeout plus this much."""


@dataclass
class Lineage:
    steps: dict[int, list[dict]] = field(default_factory=dict)  # step -> its "step done" fields in the lineage
    retrained: Counter = field(default_factory=Counter)  # step -> times trained outside the lineage
    trainings: Counter = field(default_factory=Counter)  # step -> times trained by any incarnation
    chain: list[tuple[int, int]] = field(default_factory=list)  # (incarnation, resumed from step)
    broken: str = ""


def lineage(trainer: list[Incarnation]) -> Lineage:
    result = Lineage()
    resumed = {
        inc.number: int(inc.named(telemetry.RESUMED_FROM_CHECKPOINT)[0].get("step", 0))
        if inc.named(telemetry.RESUMED_FROM_CHECKPOINT)
        else 0
        for inc in trainer
    }
    done = {inc.number: inc.named(telemetry.STEP_DONE) for inc in trainer}
    # the steps each incarnation trained: its own "step done" lines, the versions it published and the checkpoints
    # it saved (a trainer killed, or stopped with the broker gone, between a publish or a checkpoint and its
    # "step done" trained that step too; the next incarnation writes the step's record from the checkpoint)
    trained = {
        inc.number: {int(e.get("step", 0)) for e in done[inc.number] if not e.get("from_checkpoint")}
        | {
            int(e.get("policy_version", 0))
            for e in inc.named(telemetry.POLICY_PUBLISHED)
            if int(e.get("policy_version", 0)) > resumed[inc.number]
        }
        | {
            int(e.get("step", 0))
            for e in inc.named(telemetry.CHECKPOINT_SAVED)
            if int(e.get("step", 0)) > resumed[inc.number]
        }
        for inc in trainer
    }
    active = [
        inc for inc in trainer if done[inc.number] or trained[inc.number] or inc.named(telemetry.CHECKPOINT_SAVED)
    ]
    if not active:
        result.broken = "no trainer incarnation trained a step"
        return result
    owned: set[tuple[int, int]] = set()  # (incarnation, step): the trainings the final weights hold
    current, upper = active[-1], None
    while True:
        start = resumed[current.number]
        result.chain.append((current.number, start))
        owned |= {
            (current.number, step)
            for step in trained[current.number]
            if step > start and (upper is None or step <= upper)
        }
        for event in done[current.number]:
            step = int(event.get("step", 0))
            # a resumed trainer writes the record of the step it resumed at (``from_checkpoint``) when the
            # incarnation that trained it died before its "step done": that record is the step's
            record_of_resumed = step == start and bool(event.get("from_checkpoint"))
            if (step > start or record_of_resumed) and (upper is None or step <= upper):
                result.steps.setdefault(step, []).append(event.fields)
        if start == 0:
            break
        writers = [
            inc
            for inc in trainer
            if inc.number < current.number
            and any(int(e.get("step", -1)) == start for e in inc.named(telemetry.CHECKPOINT_SAVED))
        ]
        if not writers:
            result.broken = (
                f"incarnation {current.number} resumed from checkpoint {start}, which no earlier "
                "incarnation logged as saved"
            )
            break
        writer = writers[-1]
        if start not in result.steps and not any(
            int(e.get("step", 0)) == start and not e.get("from_checkpoint") for e in done[writer.number]
        ):
            # the record of checkpoint ``start``'s step may come from an incarnation between its writer and this one
            # that resumed from it too and wrote it (from the checkpoint), then died before a newer checkpoint (its
            # disk was full): the trainer writes that record once, so a later resume from ``start`` does not
            for between in trainer:
                if writer.number < between.number < current.number and resumed[between.number] == start:
                    records = [
                        e for e in done[between.number] if int(e.get("step", 0)) == start and e.get("from_checkpoint")
                    ]
                    if records:
                        result.steps.setdefault(start, []).append(records[0].fields)
                        break
        current, upper = writer, start
        owned.add((current.number, start))
    for number, steps in trained.items():
        for step in steps:
            result.trainings[step] += 1
            if (number, step) not in owned:
                result.retrained[step] += 1
    return result


@dataclass
class Verdict:
    record: RunRecord
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    retrained: dict[int, int] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)
    unverified: list[int] = field(default_factory=list)
    missing_rows: list[int] = field(default_factory=list)
    extra_rows: list[int] = field(default_factory=list)
    unplanned: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # worth reading; not a failed check

    @property
    def ok(self) -> bool:
        return not self.failures


def judge(record: RunRecord) -> Verdict:
    spec = record.spec
    verdict = Verdict(record)
    roles = (*ROLES, RELAY_ROLE) if spec.relay else ROLES
    logs = {role: read_incarnations(role, spec.run_dir / "logs" / f"{role}.log") for role in roles}
    n = spec.max_steps

    chain = lineage(logs["trainer"])
    if chain.broken:
        verdict.failures.append(f"lineage: {chain.broken}")
    verdict.lost = [s for s in range(1, n + 1) if s not in chain.steps]
    verdict.duplicated = [s for s, events in sorted(chain.steps.items()) if len(events) > 1]
    verdict.retrained = dict(sorted(chain.retrained.items()))

    # (step, trainer rank) -> the digests the orchestrator sent for it; the trainer's `step done` is rank 0's data
    sent: dict[tuple[int, int], set[str]] = defaultdict(set)
    for inc in logs["orchestrator"]:
        for event in [*inc.named(telemetry.STEP_SENDING), *inc.named(telemetry.STEP_SENT)]:
            if event.get("data_digest"):
                sent[int(event.get("step", 0)), int(event.get("rank", 0))].add(str(event.get("data_digest")))
    for step, events in sorted(chain.steps.items()):
        digest = events[-1].get("data_digest")
        if not digest or not sent.get((step, 0)):
            verdict.unverified.append(step)
        elif digest not in sent[step, 0]:
            verdict.mismatched.append(f"step {step}: trained {digest}, sent {sorted(sent[step, 0])}")
    # an orchestrator that died mid-send (its fault point): the step must come whole from one restarted after it,
    # i.e. be a set a later incarnation sent whole (``step sent``; a remade step may hold the very same data)
    incarnations = logs["orchestrator"]
    for number, inc in enumerate(incarnations):
        for fault in inc.named(telemetry.FAULT_ORCHESTRATOR_EXIT):
            step = int(fault.get("step", 0))
            later = {
                str(e.get("data_digest"))
                for after in incarnations[number + 1 :]
                for e in after.named(telemetry.STEP_SENT)
                if int(e.get("step", 0)) == step and int(e.get("rank", 0)) == 0
            }
            trained = chain.steps.get(step)
            if trained and trained[-1].get("data_digest") not in later:
                verdict.mismatched.append(
                    f"step {step}: trained {trained[-1].get('data_digest')}, not a set an orchestrator restarted after "
                    f"the one killed mid-send sent whole ({sorted(later) or 'none'})"
                )
    resent: dict[int, int] = {}
    for (step, _rank), digests in sent.items():
        if len(digests) > 1:
            resent[step] = max(resent.get(step, 0), len(digests))
    resent = dict(sorted(resent.items()))
    if resent:
        verdict.findings.append(f"steps sent with more than one data digest (orchestrator restarts): {resent}")

    rows = Counter(
        int(r.get("step", 0)) for r in read_metrics_rows(spec.run_dir / "metrics.jsonl") if r.get("role") == "trainer"
    )
    verdict.missing_rows = [s for s in range(1, n + 1) if rows[s] == 0]
    verdict.extra_rows = [s for s in sorted(rows) if rows[s] > chain.trainings[s]]

    for ended in record.exits:
        if ended.planned or _normal_end(ended, logs) or _stopped_by_held_disk(ended, record, logs):
            continue
        incarnation = _incarnation_of(logs[ended.role], ended.at_s)
        why = incarnation.last_error() if incarnation else "(no log)"
        code = "?" if ended.code is None else ended.code
        verdict.unplanned.append(
            f"{ended.role} pid {ended.pid} status {code} at +{ended.at_s - record.started_s:.0f}s: {why}"
        )

    final = record.final_status
    if not served_final(final, n):
        versions = [
            (w.get("name"), w.get("policy_version"))
            for w in (final or {}).get("workers", [])
            if w.get("role") == "ROLE_INFERENCE"
        ]
        verdict.failures.append(
            f"final status: latest policy version {(final or {}).get('latest_policy_version')} (want {n}), "
            f"inference workers serving {versions or 'none'} {record.final_status_error}".rstrip()
        )
    _spool_checks(spec.run_dir / "broker" / "spool", n, verdict)
    if not (spec.run_dir / "checkpoints" / f"step_{n}").exists():
        verdict.failures.append(f"no checkpoint of the last step (checkpoints/step_{n})")

    for name, values in (
        ("steps lost", verdict.lost),
        ("steps duplicated", verdict.duplicated),
        ("steps mismatched", verdict.mismatched),
        ("steps unverified (no data_digest)", verdict.unverified),
        ("metrics rows missing", verdict.missing_rows),
        ("metrics rows extra", verdict.extra_rows),
        ("left running", record.leftovers),
    ):
        if values:
            verdict.failures.append(f"{name}: {_short(values)}")
    if verdict.unplanned:
        verdict.failures.append(f"unplanned exits: {len(verdict.unplanned)} (listed above)")
    if record.aborted:
        verdict.failures.append(f"run aborted: {record.aborted}")
    if record.unfired:
        verdict.failures.append(f"kills never fired: {[k.describe() for k in record.unfired]}")
    if record.rl_exit_code not in (None, 0):
        verdict.failures.append(f"primerl rl exited {record.rl_exit_code}")
    for kill in record.kills:
        if kill.orphans:
            verdict.findings.append(
                f"{kill.spec.role} killed: {len(kill.orphans)} of its processes alive 2 s later: {_short(kill.orphans)}"
            )
        if kill.recovered_s is None:
            verdict.failures.append(f"{kill.spec.role} never came back after its kill ({kill.spec.moment})")
        if kill.spec.moment == "stall" and kill.fired and kill.stalled_s is None:
            verdict.failures.append("the stopped engine core was never reported stalled by its inference worker")
        if kill.spec.moment == "full" and kill.fired and kill.stalled_s is None:
            verdict.failures.append(
                "the broker never reported its spool's disk full"
                if kill.spec.role == SPOOL_DISK
                else "the trainer never stopped on its full checkpoint disk"
            )
        if kill.spec.moment == "mid-send" and kill.fired and kill.stalled_s is None:
            verdict.failures.append("the orchestrator never reached its mid-send fault point")
        if kill.spec.moment == "full" and not kill.fired:
            verdict.failures.append(f"the {kill.spec.role} filesystem could not be filled")
        if kill.spec.moment == "mid-relay" and (kill.healed_s is None or kill.healed_s > RELAY_HEAL_BOUND_S):
            verdict.failures.append(
                f"relay killed mid-relay of v{kill.version}: the inference worker served it "
                + ("never" if kill.healed_s is None else f"{kill.healed_s:.1f} s later")
                + f" (bound {RELAY_HEAL_BOUND_S:g} s: the broker's relay timeout plus an update's load)"
            )
    survivors = [f"{e.role} pid {e.pid}: {_short(e.survivors)}" for e in record.exits if e.survivors]
    if survivors:
        verdict.findings.append(
            f"processes left in a role's group when it ended (the restarter killed them): {_short(survivors)}"
        )
    _status_findings(record, verdict)
    return verdict


def _spool_checks(spool: Path, n: int, verdict: Verdict) -> None:
    """The broker's spool at the end: step N committed (``COMMITTED``); batches left or quarantined are noted."""
    try:
        committed = int((spool / "COMMITTED").read_text().strip())
    except (OSError, ValueError):
        committed = None
    if committed != n:
        verdict.failures.append(f"spool: committed step {committed} (want {n}) in {spool / 'COMMITTED'}")
    left = sorted(p.name for p in spool.glob("*.rbatch"))
    if left:
        verdict.findings.append(f"spool: {len(left)} batch files left after step {committed} was committed")
    quarantined = sorted(p.name for p in (spool / "quarantine").glob("*")) if (spool / "quarantine").is_dir() else []
    if quarantined:
        verdict.findings.append(f"spool: {len(quarantined)} files quarantined (torn or damaged): {_short(quarantined)}")


def _normal_end(ended, logs) -> bool:
    """An exit 0 that ends the run as designed: the orchestrator's once every step is produced, any role's once
    the trainer logged ``training finished`` (the broker then tells the others to stop). In mode rl the status
    of an exit is not known to the harness (None): the role's own log lines decide."""
    if ended.code not in (0, None):
        return False
    finished = [e.at_s for inc in logs["trainer"] for e in inc.named(telemetry.TRAINING_FINISHED)]
    if finished and ended.at_s >= min(finished):
        return True
    incarnation = _incarnation_of(logs[ended.role], ended.at_s)
    return (
        ended.role == "orchestrator"
        and incarnation is not None
        and bool(incarnation.named(telemetry.ALL_STEPS_PRODUCED))
    )


def _stopped_by_held_disk(ended, record: RunRecord, logs) -> bool:
    """The trainer's exit 1 on a checkpoint disk the harness held full: the incarnation that ended logged
    ``trainer cannot continue: no space for its checkpoint`` while the filler was there (caused by the harness, like
    a kill). In mode rl the status is not known (None)."""
    if ended.role != "trainer" or ended.code not in (1, None):
        return False
    incarnation = _incarnation_of(logs["trainer"], ended.at_s)
    held = [
        (kill.at_s, kill.at_s + (kill.resumed_s if kill.resumed_s is not None else float("inf")))
        for kill in record.kills
        if kill.spec.role == CHECKPOINT_DISK and kill.fired
    ]
    return incarnation is not None and any(
        start <= event.at_s <= end for event in incarnation.named(telemetry.CHECKPOINT_DISK_FULL) for start, end in held
    )


def _incarnation_of(incarnations: list[Incarnation], at_s: float) -> Incarnation | None:
    """The last incarnation with a log line before ``at_s`` (the one that ended then)."""
    before = [inc for inc in incarnations if any(0 < e.at_s <= at_s + 1.0 for e in inc.events)]
    return before[-1] if before else (incarnations[-1] if incarnations else None)


def _status_findings(record: RunRecord, verdict: Verdict) -> None:
    """Run status after a broker restart should say what it said before. A policy rollback (a trainer resumed
    from a checkpoint older than its last publish: ``num_rollbacks`` goes up) lowers the latest version by design,
    so the version counts from there."""
    best = {"last_committed_step": 0, "latest_policy_version": 0}
    rollbacks = 0
    regressions: list[str] = []
    for _, status in record.statuses:
        rolled_back = int(status.get("num_rollbacks", 0)) > rollbacks
        rollbacks = max(rollbacks, int(status.get("num_rollbacks", 0)))
        for key in best:
            value = int(status.get(key, 0))
            if rolled_back and key == "latest_policy_version":
                best[key] = value
                continue
            if value < best[key] and f"{key} {best[key]} -> {value}" not in regressions:
                regressions.append(f"{key} {best[key]} -> {value}")
            best[key] = max(best[key], value)
    if regressions:
        verdict.findings.append(f"run status went backwards (broker restart forgot state): {_short(regressions)}")


def _short(values, limit: int = 6) -> str:
    values = list(values)
    shown = "; ".join(str(v) for v in values[:limit])
    return shown + (f"; ... ({len(values)} in all)" if len(values) > limit else "")


def summary(verdict: Verdict) -> str:
    record, spec = verdict.record, verdict.record.spec
    lines = [
        f"== mode {spec.mode} seed {spec.seed}: {'PASS' if verdict.ok else 'FAIL'} "
        f"({spec.max_steps} steps, {record.wall_s:.0f} s, run dir {spec.run_dir})"
    ]
    lines.append(
        f"  kills {len(record.kills)}, starts per role {record.starts} "
        f"(restarts {sum(max(0, c - 1) for c in record.starts.values())})"
    )
    for kill in record.kills:

        def seconds(value):
            return "never" if value is None else f"{value:.1f}s"

        healed = f", inference served v{kill.version}+ in {seconds(kill.healed_s)}" if kill.version else ""
        if kill.spec.moment == "stall":
            healed = f", seen stalled in {seconds(kill.stalled_s)}, resumed at {seconds(kill.resumed_s)}"
        if kill.spec.moment == "full":
            healed = f", seen full in {seconds(kill.stalled_s)}, freed at {seconds(kill.resumed_s)}"
        if kill.spec.moment == "mid-send":
            healed = f", died mid-send {seconds(kill.stalled_s)} after it was armed"
        if kill.spec.moment == "partition":
            lost = "" if kill.stalled_s is None else f", marked lost in {seconds(kill.stalled_s)}"
            after = (
                f" (full speed {kill.recovered_s - kill.resumed_s:.1f}s after the heal)"
                if kill.recovered_s is not None and kill.resumed_s is not None
                else ""
            )
            healed = f"{lost}, healed at {seconds(kill.resumed_s)}{after}"
        lines.append(
            f"  - {kill.spec.role:<12} {kill.spec.moment:<25} at step {kill.trainer_step:>2}: back in "
            f"{seconds(kill.recovered_s)}, next step done in {seconds(kill.next_step_s)}{healed}  [{kill.note}]"
        )
    lines.append(f"  run status polls: {len(record.statuses)} answered, {record.status_errors} failed")
    lines.append(
        f"  steps lost {len(verdict.lost)}, duplicated {len(verdict.duplicated)}, mismatched "
        f"{len(verdict.mismatched)}, unverified {len(verdict.unverified)}, retrained after a rollback "
        f"{verdict.retrained or 0}, unplanned exits {len(verdict.unplanned)}"
    )
    for exit_line in verdict.unplanned:
        lines.append(f"  unplanned: {exit_line}")
    for failure in verdict.failures:
        lines.append(f"  FAIL {failure}")
    for finding in verdict.findings:
        lines.append(f"  note {finding}")
    return "\n".join(lines)


def write_summary(verdict: Verdict) -> Path:
    """``chaos_summary.txt`` and ``chaos_record.json`` (kills, exits, starts, verdict; no run token)."""
    record = verdict.record
    run_dir = record.spec.run_dir
    facts = {
        "mode": record.spec.mode,
        "seed": record.spec.seed,
        "max_steps": record.spec.max_steps,
        "wall_s": round(record.wall_s, 1),
        "aborted": record.aborted,
        "starts": record.starts,
        "kills": [asdict(k) for k in record.kills],
        "unfired": [asdict(k) for k in record.unfired],
        "exits": [asdict(e) for e in record.exits],
        "leftovers": record.leftovers,
        "failures": verdict.failures,
        "findings": verdict.findings,
        "unplanned": verdict.unplanned,
        "lost": verdict.lost,
        "duplicated": verdict.duplicated,
        "mismatched": verdict.mismatched,
        "unverified": verdict.unverified,
        "retrained": verdict.retrained,
    }
    (run_dir / "chaos_record.json").write_text(json.dumps(facts, indent=1, default=str) + "\n")
    path = run_dir / "chaos_summary.txt"
    path.write_text(summary(verdict) + "\n")
    return path
