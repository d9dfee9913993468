"""The seeded kill plan of one chaos run: which role is SIGKILLed, at which kind of moment, in which order.

Kinds of moment:
- ``random``: a random delay (0 to ``MAX_RANDOM_DELAY_S``) after the trainer's ``step done`` of the arming step;
- ``push`` (broker only): the moment the broker logs ``weight update stored`` for a new version, i.e. while it
  fans the update out to the inference workers (the report says whether a worker had applied it before the kill);
- ``mapping`` (inference only): the moment the inference worker logs ``weight update received`` for a new version:
  on one host it has mapped the trainer's shared-memory segment and its vLLM worker is staging the update from it
  (the trainer must not write that segment again until the broker declared the worker gone; the restarted worker
  gets the update from the broker, and the segment of a dead reader is released);
- ``publish-before-checkpoint`` (trainer only): the moment the trainer logs ``policy published`` for a step that
  is not a checkpoint step, so the newest published version is newer than its newest checkpoint;
- ``mid-relay`` (the relay worker of mode ``separate``, which relays weight chunks to the inference worker, over a
  slow link for the first updates: ``broker.weight_fanout = "chain"``): ``RELAY_KILL_DELAY_S`` after the relay
  logs ``relay worker holding`` (an update's first chunk arrived; it forwards it a second later), so the inference
  worker behind it gets the update only once the broker has healed the chain. Always the first kill, so the chain
  is still the one of the start (the relay joined first: it is the chain's head, the inference worker behind it).
- the launcher (mode ``rl``): `primerl rl` itself is SIGKILLed at a random moment; its roles go with it (its
  reaper), and the harness starts the same `primerl rl` again at once (as ``Restart=always`` would), which resumes
  the run from its directory: the broker's spool and run state, the trainer's newest checkpoint.
- one rank of a two-rank trainer (mode ``rl``, whose trainer runs two ranks under torchrun): rank 1 is SIGKILLed at
  a random moment; torchrun ends the other rank and exits, `primerl rl` restarts the trainer, which resumes from
  its newest checkpoint.
- ``stall`` (role ``engine``, the full plan): a gray failure, not a kill. The inference worker's vLLM engine core is
  stopped with SIGSTOP while ``primerl-infer`` itself runs on and heartbeats; once the daemon logs ``inference
  engine stalled`` (its watchdog, ``engine_stall_timeout_s``, set short for chaos runs) the harness waits
  ``delay_s`` more and resumes it with SIGCONT. It is back on ``inference engine recovered``.
- ``full`` (role ``spool-disk``, the full plan, where a tmpfs can be mounted): the broker's spool directory is a
  small tmpfs of its own for the whole run; the harness fills it (a filler file in a subdirectory the spool
  ignores) and, once the broker logs ``rollout spool disk full``, waits ``delay_s`` more and deletes the filler.
  It is back on ``rollout spool has room again``.
- ``full`` (role ``checkpoint-disk``, the full plan, where a tmpfs can be mounted): the trainer's checkpoint
  directory is a tmpfs of its own for the whole run; the harness fills it the same way. The trainer's next
  checkpoint fails, and it exits 1 with ``trainer cannot continue: no space for its checkpoint`` (the previous
  checkpoint kept, the step not committed); ``delay_s`` after that line the harness deletes the filler, and the
  restarted trainer resumes from its newest checkpoint. It is back on its next ``checkpoint saved``.
- ``skew`` (role ``trainer-clock``, mode ``separate``, the full plan, where libfaketime is installed): the trainer
  is SIGKILLed and its restarter starts it again, from then on with its clock ``skew_s`` off (libfaketime through
  ``LD_PRELOAD``: every clock read of the process, Python's and gRPC's C core's alike, as on a host whose clock is
  wrong; the monotonic clock left alone, as a host's is): 6 to 12 hours behind for odd seeds, ahead for even ones.
  It is back once the skewed trainer registered with the broker; its steps must go on from its checkpoint like
  after any kill (the policy lineage comes from the broker, not from a clock).
- ``partition`` (roles ``inference-net`` and ``trainer-net``, mode ``separate``, the full plan, where network
  namespaces can be made): the inference worker and the trainer then run on hosts of their own (network namespaces
  joined by a bridge, as in the multi-host tests; the broker and the orchestrator on the bridge's address), and the
  fault takes that host's cable off the bridge for ``hold_s`` (seeded; of the two hosts one for 1-2.5 s, well within
  the broker's liveness window of 5 s, the other for 8-20 s, past it): its packets are dropped silently, both ways,
  with every process alive, as with an unplugged switch port. Then it is plugged back. An inference worker cut off
  stops the rollouts (it is the only one) and, past the liveness window, is marked lost; a trainer cut off neither
  gets batches nor publishes. It is back on the trainer's next ``step done`` after the heal (heal to full speed).
- ``mid-send`` (role ``orchestrator-send``, the full plan): the orchestrator is killed in the middle of a step's
  send, after ``k`` of the step's micro-batches (1 to 3 of 4, seeded) were made durable by the broker: the harness
  arms the orchestrator's test-only fault point (``PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS_FILE``: a file with
  ``k``), and at its next step the orchestrator sends ``k`` micro-batches, waits for their acks and SIGKILLs itself
  (``fault injection: orchestrator exits after acks``). The broker must never serve that partial set: the
  restarted orchestrator's whole set takes the step. It is back once the restarted orchestrator registered.

Kills run one after another: kill ``i`` is armed once the role of kill ``i - 1`` is back (or a bound passed) and
the trainer has done ``gap_steps`` more steps, so each recovery is seen on its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

MAX_RANDOM_DELAY_S = 1.5
RELAY_KILL_DELAY_S = 0.05
ROLES = ("broker", "inference", "orchestrator", "trainer")
LAUNCHER = "launcher"
TRAINER_RANK = "trainer-rank"  # rank 1 of a two-rank trainer
ENGINE = "engine"  # the inference worker's vLLM engine core, stopped and resumed (moment "stall")
SPOOL_DISK = "spool-disk"  # the filesystem of the broker's spool, filled and freed (moment "full")
CHECKPOINT_DISK = "checkpoint-disk"  # the filesystem of the trainer's checkpoints, filled and freed (moment "full")
DISKS = (SPOOL_DISK, CHECKPOINT_DISK)
# faults held for ``delay_s`` once the system saw them
HELD_FAULTS = {ENGINE: "stall", SPOOL_DISK: "full", CHECKPOINT_DISK: "full"}
CLOCK = "trainer-clock"  # the trainer restarted with its clock skewed (moment "skew")
MID_SEND = "orchestrator-send"  # the orchestrator killed after k of a step's micro-batches were acked ("mid-send")
MID_SEND_MAX_ACKS = 3  # k is 1..3 (a step has 4 micro-batches in the chaos run)
INFERENCE_NET = "inference-net"  # the inference worker's host cut off the network (moment "partition")
TRAINER_NET = "trainer-net"  # the trainer's host cut off the network (moment "partition")
PARTITIONS = {INFERENCE_NET: "inference", TRAINER_NET: "trainer"}  # fault -> the role on the host cut off
# Within the broker's liveness window (5 s by default) less a heartbeat interval (the last one may come up to 1 s
# before the cut) and TCP's retransmission after the heal (the heartbeat stuck in the connection is resent on its
# backed-off timer: 1-2.5 s after a 3-4 s cut here): nobody is marked lost. A 4.2 s cut was marked lost 1.3 s after
# its heal.
SHORT_PARTITION_S = (1.0, 2.5)
LONG_PARTITION_S = (8.0, 20.0)  # past it: the cut-off worker is marked lost, and registers again once healed


@dataclass(frozen=True)
class KillSpec:
    role: str
    moment: str  # random | push | mapping | publish-before-checkpoint | mid-relay | stall | full | ...
    gap_steps: int  # trainer steps done after the previous recovery before this kill is armed
    delay_s: float = 0.0  # for moment "random"
    skew_s: float = 0.0  # for moment "skew": the restarted trainer's clock minus the true time
    hold_s: float = 0.0  # for moment "partition": how long the host stays cut off
    acks: int = 0  # for moment "mid-send": the micro-batches acked before the orchestrator dies

    def describe(self) -> str:
        delay = f" +{self.delay_s:.2f}s" if self.moment in ("random", "skew", *HELD_FAULTS.values()) else ""
        skew = f" {self.skew_s / 3600:+.1f}h" if self.moment == "skew" else ""
        hold = f" for {self.hold_s:.1f}s" if self.moment == "partition" else ""
        acks = f" after {self.acks} acks" if self.moment == "mid-send" else ""
        return f"{self.role}@{self.moment}{delay}{skew}{hold}{acks} (after {self.gap_steps} more steps)"


def make_plan(
    seed: int,
    *,
    full: bool,
    relay: bool = False,
    launcher: bool = False,
    trainer_rank: bool = False,
    stall: bool = False,
    disk: bool = False,
    checkpoint_disk: bool = False,
    clock: bool = False,
    partitions: bool = False,
    mid_send: bool = False,
) -> list[KillSpec]:
    """Every kind once at a random moment, the broker during a push and the trainer between a publish and its
    checkpoint; ``full=False`` (the CI profile) keeps one kill per role: push, publish-before-checkpoint, a random
    moment for the orchestrator and the inference worker while it reads an update (mapping). ``relay`` (mode
    separate): first, the relay worker mid-relay. ``launcher`` (mode rl): `primerl rl` itself at a random moment, at
    a seeded place in the plan (the other kills keep their seeded order). ``trainer_rank`` (mode rl, a two-rank
    trainer): rank 1 at a random moment, placed the same way. ``stall``: the engine core stopped, then resumed
    ``delay_s`` after the daemon saw the stall, placed the same way. ``disk``: the spool's filesystem filled, then
    freed ``delay_s`` after the broker saw it full, placed the same way. ``checkpoint_disk``: the checkpoints'
    filesystem filled, then freed ``delay_s`` after the trainer stopped on it, placed the same way. ``clock``: the
    trainer restarted with its clock 6-12 h behind (odd seeds) or ahead (even seeds), at a random moment, placed the
    same way. ``partitions``: the inference worker's host and the trainer's host each cut off once, placed the same
    way: one for 1-2.5 s (well within the broker's liveness window), the other for 8-20 s (the inference worker's
    cut is the short one for odd seeds). ``mid_send``: the orchestrator killed after 1-3 of a step's micro-batches
    were acked, placed the same way."""
    rng = random.Random(seed)
    moments = [
        ("broker", "push"),
        ("trainer", "publish-before-checkpoint"),
        ("orchestrator", "random"),
        ("inference", "mapping"),
    ]
    if full:
        moments += [("broker", "random"), ("trainer", "random"), ("inference", "random")]
    rng.shuffle(moments)
    plan = [
        KillSpec(
            role,
            moment,
            gap_steps=rng.randint(1, 2),
            delay_s=round(rng.uniform(0.0, MAX_RANDOM_DELAY_S), 3) if moment == "random" else 0.0,
        )
        for role, moment in moments
    ]
    for role, moment, wanted in (
        (LAUNCHER, "random", launcher),
        (TRAINER_RANK, "random", trainer_rank),
        (ENGINE, "stall", stall),
        (SPOOL_DISK, "full", disk),
        (CHECKPOINT_DISK, "full", checkpoint_disk),
        (CLOCK, "skew", clock),
        (INFERENCE_NET, "partition", partitions),
        (TRAINER_NET, "partition", partitions),
        (MID_SEND, "mid-send", mid_send),
    ):
        if wanted:
            own = random.Random(f"{role}-{seed}")
            kill = KillSpec(
                role, moment, gap_steps=own.randint(1, 2), delay_s=round(own.uniform(0.0, MAX_RANDOM_DELAY_S), 3)
            )
            if moment == "skew":
                kill = replace(kill, skew_s=(-1 if seed % 2 else 1) * 3600.0 * own.randint(6, 12))
            if moment == "mid-send":
                kill = replace(kill, acks=own.randint(1, MID_SEND_MAX_ACKS))
            if moment == "partition":  # one host cut shorter than the liveness window, the other longer
                short = (seed % 2 == 1) == (role == INFERENCE_NET)
                kill = replace(kill, hold_s=round(own.uniform(*(SHORT_PARTITION_S if short else LONG_PARTITION_S)), 1))
            plan.insert(own.randint(0, len(plan)), kill)
    if relay:
        plan.insert(0, KillSpec("relay", "mid-relay", gap_steps=1, delay_s=RELAY_KILL_DELAY_S))
    return plan


def steps_needed(plan: list[KillSpec]) -> int:
    """Enough steps for every kill to fire with a few left to finish on: a step takes well under a second here,
    so the trainer goes on for a few steps during a random delay and while a killed role comes back (a relay
    worker's kill does not hold the trainer up: one step for it)."""
    return 4 + sum(kill.gap_steps + (1 if kill.moment == "mid-relay" else 4) for kill in plan)
