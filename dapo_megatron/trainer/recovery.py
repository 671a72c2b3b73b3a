"""What the trainer does when rollout engines fail mid-run (docs/architecture.md, "Faults a long run meets").

    faults = FaultPolicy(roles=roles, placement=placement, actor=actor, driver=driver, engine_restarts=...)
    groups, stats = faults.rollout(step)            # every rank: (groups, stats) on the driver, (None, {}) elsewhere
    stats = faults.transfer(step + 1)               # every rank: the weights after step + 1 updates, to every engine
    scores = faults.evaluate(step + 1)              # every rank: the eval (the driver's scores), retried or missed
    driver.engine_faults                            # EngineFaults: the driver's side (its pool, its run directory)

The loop holds the FaultPolicy (every rank, collectives); the driver holds its EngineFaults (what it
knows of the engines) and answers the policy through Driver.try_rollout and the EngineFaults fields
(sync_redo, lost_reason): no function here reaches into the Driver's attributes.

The only engine dying during a rollout: the driver puts its prompt stream and request counter back
where the step began, waits (at most rollout.engine_wait_s) for an engine to register again (the
local launcher restarts it: launch/supervise.py), and tells every rank, with one broadcast int, to
re-sync: the weights live on the actor ranks, so the re-sync is the collective export
(placement.transfer_weights) of the weights after `step` updates. Then the step's rollout starts over
from the same prompts with the same rids and per-sample seeds: with seeds honoured and groups taken in
request order, the same samples as an uninterrupted run. No engine back in time (or the launcher's
restart budget spent): EnginesLost on every rank, with the driver's message naming the engine and its
error; trainer/train.py checkpoints the last completed step and stops.

The only engine dying during an evaluation: the same wait and re-sync, then the eval once more with the
same prompts and seeds; if no engine comes back it is recorded as missed and training goes on (the
completed step is kept: the next rollout checkpoints it before stopping, if it comes to that).

An engine dying during a weight sync (transfer/engine_push.py): the sync fails at its bucket (weight_sync.py checks every engine
is reachable before a bucket's broadcast), the dead engine is dropped, the rest of the export is still
consumed on the driver (the other ranks run its collectives), and every rank runs another export pass
(one broadcast int after each pass says whether): the survivors got part of the new weights and take
the whole sync again in a group re-formed without the dead one. It rejoins through the normal re-sync
(pending after it registers again, admitted after the next push).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from dapo_megatron.dataplane import collectives as coll

OK, RESYNC, LOST = 0, 1, 2


class EnginesLost(RuntimeError):
    """No rollout engine left and none came back within rollout.engine_wait_s."""


def broadcast_code(code: int) -> int:
    """Global rank 0's `code` on every rank (a collective when torch.distributed is up)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return code
    flag = torch.tensor([code], dtype=torch.int32)
    coll.broadcast(flag, src=0)
    return int(flag.item())


def broadcast_text(text: str) -> str:
    """Global rank 0's `text` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return text
    box = [text]
    coll.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------- the driver's side
class EngineFaults:
    """What the driver knows when engines fail: its pool, the launcher's restart events in its run
    directory, the rollout settings that bound the wait. Held by the Driver (Driver.engine_faults)."""

    def __init__(self, pool, *, run_dir: str | Path, engine: str, engine_urls, num_engines: int, engine_wait_s: float):
        self.pool = pool
        self.run_dir = Path(run_dir)
        self.local_engines = engine == "cpu" and not engine_urls  # started and restarted by the local launcher
        self.num_engines = num_engines
        self.engine_wait_s = engine_wait_s
        self.sync_redo = False  # the last push lost an engine mid-sync: the others need it again
        self.lost_reason = ""  # why no engine is left (the message every rank raises)

    def max_sync_passes(self) -> int:
        return len(self.pool.load()) + 1

    def is_engine_loss(self, err: BaseException) -> bool:
        """An EngineError that lost the last engine (engines that answer: a real error, raised)."""
        from dapo_megatron.rollout.pool import NoLiveEngine

        return not self.pool.live_urls() or isinstance(err, NoLiveEngine)

    def launcher_gave_up(self) -> list[dict]:
        """The launcher's engines that exited with the restart budget spent, when that is all of them."""
        from dapo_megatron.rollout.registry import engine_events_path, read_engine_events

        if not self.local_engines:
            return []
        events = read_engine_events(engine_events_path(self.run_dir))
        down = {e["engine"]: e for e in events if e["action"] == "budget_spent"}
        return list(down.values()) if len(down) >= self.num_engines else []

    async def wait_for_engine(self, *, wait_s: float, poll_s: float = 0.5) -> bool:
        """True once an engine registers again (pending: it needs the weights first); False after wait_s,
        or at once when the local launcher has given up on every engine it started."""
        deadline = time.monotonic() + wait_s
        while True:
            if await self.pool.discover():
                return True
            if time.monotonic() >= deadline or self.launcher_gave_up():
                return False
            await asyncio.sleep(poll_s)

    def lost_message(self, step: int, err: BaseException, waited_s: float) -> str:
        drops = {}
        for _, event, url in self.pool.events:
            if event.startswith("dropped"):
                drops[url] = event.removeprefix("dropped").lstrip(": ")
        named = "; ".join(f"{url} dropped ({why})" for url, why in drops.items()) or str(err)
        launcher = "; ".join(f"the launcher's {e['engine']} exited with code {e['returncode']} and was not restarted "
                             f"(restart budget rollout.engine_restarts={e['budget']} spent)"
                             for e in self.launcher_gave_up())
        return (f"no rollout engine left at step {step + 1}: {named}; none registered again within "
                f"{waited_s:.0f} s (rollout.engine_wait_s={self.engine_wait_s:g})"
                + (f"; {launcher}" if launcher else "") + f". Last error: {type(err).__name__}: {err}")

    def after_rollout_loss(self, err: BaseException, step: int, *, run) -> int:
        """RESYNC when an engine is (back) to take the weights, LOST when none came back in time (the
        reason in lost_reason). `run`: the driver's way of running a coroutine on its loop."""
        if self.pool.live_urls():  # overlapped steps: an engine came back and took a push meanwhile
            print(f"[engines] every engine was lost while batch {step + 1} was generating; "
                  f"{', '.join(self.pool.live_urls())} is back: re-syncing the weights of step {step}, then "
                  f"step {step + 1}'s rollout starts over", flush=True)
            return RESYNC
        print(f"[engines] no engine left during step {step + 1}'s rollout ({type(err).__name__}); waiting up to "
              f"{self.engine_wait_s:g} s (rollout.engine_wait_s) for one to register again", flush=True)
        tic = time.monotonic()
        if run(self.wait_for_engine(wait_s=self.engine_wait_s)):
            print(f"[engines] {', '.join(self.pool.pending_urls())} registered after {time.monotonic() - tic:.1f} s: "
                  f"re-syncing the weights of step {step}, then step {step + 1}'s rollout starts over", flush=True)
            return RESYNC
        self.lost_reason = self.lost_message(step, err, time.monotonic() - tic)
        return LOST


    def after_eval_loss(self, err: BaseException, updates: int, *, run) -> int:
        """The eval of the weights after `updates` updates lost every engine: RESYNC once one is (back),
        LOST when none came back in time (the reason in lost_reason)."""
        print(f"[engines] no engine left during the eval of step {updates} ({type(err).__name__}); waiting up to "
              f"{self.engine_wait_s:g} s (rollout.engine_wait_s) for one to register again", flush=True)
        tic = time.monotonic()
        if self.pool.live_urls() or run(self.wait_for_engine(wait_s=self.engine_wait_s)):
            print(f"[engines] {', '.join(self.pool.pending_urls() or self.pool.live_urls())} registered after "
                  f"{time.monotonic() - tic:.1f} s: re-syncing the weights of step {updates}, then the eval "
                  "starts over with the same prompts and seeds", flush=True)
            return RESYNC
        self.lost_reason = self.lost_message(updates - 1, err, time.monotonic() - tic)  # ("at step <updates>")
        return LOST


# ----------------------------------------------------------------------------- every rank's policy
class FaultPolicy:
    """What every rank does around the two phases that talk to the engines: the rollout (redone after
    a re-sync when the only engine died; EnginesLost when none came back) and the weight transfer
    (as many export passes as it takes). The driver's verdicts reach every rank as broadcast ints."""

    def __init__(self, *, roles, placement, actor, driver, engine_restarts: int) -> None:
        self.roles, self.placement, self.actor, self.driver = roles, placement, actor, driver
        self.engine_restarts = engine_restarts

    def transfer(self, step: int, *, max_passes: int = 0) -> dict[str, float]:
        """placement.transfer_weights of the weights after `step` updates, as many export passes as it
        takes for every surviving engine to get the whole sync (every rank runs the same number)."""
        faults = self.driver.engine_faults if self.roles.driver else None
        max_passes = max_passes or (faults.max_sync_passes() if faults else 0)
        passes = broadcast_code(max_passes)  # the same bound on every rank
        for attempt in range(1, passes + 1):
            stats = self.placement.transfer_weights(self.actor, step=step)
            if not broadcast_code(int(bool(faults and faults.sync_redo))):
                return {**stats, "sync/passes": float(attempt)} if faults else stats
        raise RuntimeError(f"weight sync step_{step}: engines kept dying during the sync ({passes} passes)")

    def rollout(self, step: int) -> tuple[list | None, dict[str, float]]:
        """The driver's rollout ((groups, stats); (None, {}) elsewhere), redone after a re-sync when the
        only engine died; EnginesLost on every rank when none came back (at most rollout.engine_restarts
        + 1 redone rollouts per step)."""
        for _ in range(self.engine_restarts + 2):
            code, result = self.driver.try_rollout(step) if self.roles.driver else (OK, (None, {}))
            code = broadcast_code(code)
            if code == OK:
                return result
            if code == LOST:  # the driver's message on every rank: torchrun's "Root Cause" may be any rank's
                raise EnginesLost(broadcast_text(self.driver.engine_faults.lost_reason if self.roles.driver else ""))
            self.placement.before_train(self.actor)  # the phases a transfer runs in (a no-op when disaggregated)
            self.transfer(step)
            self.placement.before_rollout(self.actor)
        raise EnginesLost(f"step {step + 1}'s rollout was redone {self.engine_restarts + 1} times: the engines "
                          f"keep dying (rollout.engine_restarts={self.engine_restarts})")


    def evaluate(self, updates: int) -> dict[str, float]:
        """The driver's eval of the weights after `updates` updates ({} on the other ranks). The only
        engine dying during it: wait for it, re-sync those weights (a collective, hence every rank) and
        evaluate once more with the same prompts and seeds ("eval/retried": 1). Not back in time, or
        dying again: the eval is recorded as missed ("eval/missed": 1) with a line saying why, and
        training goes on: the step it followed is complete and is never lost (the next rollout waits for
        an engine, or checkpoints this step and stops)."""
        faults = self.driver.engine_faults if self.roles.driver else None
        for attempt in range(2):
            code, scores = self.driver.try_evaluate(updates) if self.roles.driver else (OK, {})
            code = broadcast_code(code)
            if code == OK:
                return {**scores, **({"eval/retried": 1.0} if attempt and faults else {})}
            if code == LOST or attempt == 1:
                break
            self.placement.before_train(self.actor)  # the phases a transfer runs in (a no-op when disaggregated)
            self.transfer(updates)
            self.placement.before_rollout(self.actor)
        if faults is None:
            return {}
        why = faults.lost_reason or "the engines died again during the retried eval"
        print(f"[eval] the eval of step {updates} is missed (recorded as eval/missed=1): {why}. Training goes on "
              f"from step {updates}, which is complete", flush=True)
        faults.lost_reason = ""
        return {"eval/missed": 1.0}

def save_before_stopping(cfg, actor, driver, roles, *, step: int, extra: dict) -> str:
    """Every rank: a checkpoint of the last completed step (`step` updates) unless one is on disk;
    returns what was done, for the error message."""
    from dapo_megatron.trainer import run_checkpoint as ckpt

    final = ckpt.step_dir(cfg.trainer.output_dir, step)
    if step == 0:
        return "no step was completed: nothing to checkpoint"
    if broadcast_code(int(roles.driver and final.is_dir())):  # the driver's view decides for every rank
        return f"the checkpoint of step {step} is on disk ({final})"
    ckpt.save_step(cfg, actor, driver, roles, step=step, extra=extra)
    return f"checkpoint of step {step} written ({final}); continue with --resume"
