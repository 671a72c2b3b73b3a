"""What the trainer does when rollout engines fail mid-run (docs/architecture.md, "Faults a long run meets").

    faults = FaultPolicy(roles=roles, placement=placement, actor=actor, driver=driver, engine_restarts=...)
    groups, stats = faults.around_rollout(step=step)   # the driver's rollout; (None, {}) off the driver
    stats = faults.transfer(step + 1)               # every rank: the weights after step + 1 updates, to every engine
    scores = faults.around_eval(updates=step + 1)   # the driver's eval, retried or missed; {} off the driver
    driver.engine_faults                            # EngineFaults: the driver's side (its pool, its run directory)

The loop holds the FaultPolicy (every rank, collectives); the driver holds its EngineFaults (what it
knows of the engines) and answers the policy through Driver.try_phase and the EngineFaults fields
(sync_redo, lost_reason): no function here reaches into the Driver's attributes. Every decision is
the driver's, learned by every rank through distributed/driver_decides.py: a Verdict, or the driver's
exception (EnginesLost with the driver's message, raised on every rank alike).

The only engine dying during a rollout: the driver puts its prompt stream and request counter back
where the step began, waits (at most rollout.engine_wait_s) for an engine to register again (the
local launcher restarts it: launch/local/supervise.py), and tells every rank to re-sync (Verdict.RESYNC):
the weights live on the actor ranks, so the re-sync is the collective export
(placement.transfer_weights) of the weights after `step` updates. Then the step's rollout starts over
from the same prompts with the same rids and per-sample seeds: with seeds honoured and groups taken in
request order, the same samples as an uninterrupted run. No engine back in time (or the launcher's
restart budget spent): EnginesLost on every rank, with the driver's message naming the engine and its
error; trainer/train.py checkpoints the last completed step and stops.

The only engine dying during an evaluation: the same wait and re-sync (the same path, _with_resync), then the eval
once more with the
same prompts and seeds; if no engine comes back it is recorded as missed and training goes on (the
completed step is kept: the next rollout checkpoints it before stopping, if it comes to that).

An engine dying during a weight sync (transfer/engine_push.py): the sync fails at its bucket (weight_sync.py checks
every engine
is reachable before a bucket's broadcast), the dead engine is dropped, the rest of the export is still
consumed on the driver (the other ranks run its collectives), and every rank runs another export pass
(the driver decides after each pass whether): the survivors got part of the new weights and take
the whole sync again in a group re-formed without the dead one. It rejoins through the normal re-sync
(pending after it registers again, admitted after the next push).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

from dapo_megatron.distributed.driver_decides import driver_decides
from dapo_megatron.distributed.roles import RankRoles
from dapo_megatron.rollout.pool import NoLiveEngine
from dapo_megatron.rollout.registry import engine_events_path, read_engine_events

if TYPE_CHECKING:  # the policy's seams; imported at run time they would bring megatron
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.dataplane.sample import Sample
    from dapo_megatron.trainer.placement import Placement

T = TypeVar("T")  # what a phase returns (DriverSide.try_phase)
# the driver's rollout: train_batch_size groups of scored samples and their statistics (Driver.rollout)
Rollout: TypeAlias = "tuple[list[list[Sample]], dict[str, float]]"


class Verdict(Enum):
    """The driver's verdict on a phase that talks to the engines, learned by every rank."""

    OK = "ok"  # the phase completed
    RESYNC = "resync"  # every engine was lost and one is (back): re-sync the weights, then redo the phase
    LOST = "lost"  # none came back in time (the reason in EngineFaults.lost_reason)


class EnginesLost(RuntimeError):
    """No rollout engine left and none came back within rollout.engine_wait_s."""


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
        return not self.pool.live_urls() or isinstance(err, NoLiveEngine)

    def launcher_gave_up(self) -> list[dict]:
        """The launcher's engines that exited with the restart budget spent, when that is all of them."""
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
        launcher = "; ".join(
            f"the launcher's {e['engine']} exited with code {e['returncode']} and was not restarted "
            f"(restart budget rollout.engine_restarts={e['budget']} spent)"
            for e in self.launcher_gave_up()
        )
        return (
            f"no rollout engine left at step {step}: {named}; none registered again within "
            f"{waited_s:.0f} s (rollout.engine_wait_s={self.engine_wait_s:g})"
            + (f"; {launcher}" if launcher else "")
            + f". Last error: {type(err).__name__}: {err}"
        )

    def after_loss(self, err: BaseException, *, during: str, then: str, updates: int, step: int, run) -> Verdict:
        """Every engine was lost `during` a phase on the weights after `updates` updates: RESYNC when
        one is (back) to take them (the phase redone `then`), LOST when none came back in time (the
        reason, naming `step`, in lost_reason). `run`: the driver's way of running a coroutine."""
        if self.pool.live_urls():  # overlapped steps: an engine came back and took a push meanwhile
            print(
                f"[engines] every engine was lost during {during}; {', '.join(self.pool.live_urls())} is back: "
                f"re-syncing the weights of step {updates}, then {then}",
                flush=True,
            )
            return Verdict.RESYNC
        print(
            f"[engines] no engine left during {during} ({type(err).__name__}); waiting up to "
            f"{self.engine_wait_s:g} s (rollout.engine_wait_s) for one to register again",
            flush=True,
        )
        tic = time.monotonic()
        if run(self.wait_for_engine(wait_s=self.engine_wait_s)):
            print(
                f"[engines] {', '.join(self.pool.pending_urls())} registered after {time.monotonic() - tic:.1f} s: "
                f"re-syncing the weights of step {updates}, then {then}",
                flush=True,
            )
            return Verdict.RESYNC
        self.lost_reason = self.lost_message(step, err, time.monotonic() - tic)
        return Verdict.LOST


# ----------------------------------------------------------------------------- every rank's policy
class DriverSide(Protocol):
    """What the policy asks of the driver (trainer/driver.py Driver; a Protocol, since the Driver itself
    imports this module for EngineFaults and Verdict)."""

    engine_faults: EngineFaults

    def rollout(self) -> Rollout: ...

    def evaluate(self, *, step: int) -> dict[str, float]: ...

    def try_phase(
        self,
        phase: Callable[[], T],
        *,
        restore_prompts: bool = False,
        during: str,
        then: str,
        updates: int,
        step: int,
    ) -> tuple[Verdict, T | None]: ...


D = TypeVar("D")


def on_the_driver(driver: D | None) -> D:
    """`driver` where the code runs on the driver rank only (driver_decides' `decide`, a roles.driver
    branch); None there is a bug in the caller, not a state of the run."""
    if driver is None:
        raise AssertionError("a driver-only call on a rank without the driver (roles.driver is False)")
    return driver


class FaultPolicy:
    """What every rank does around the phases that talk to the engines: the driver's rollout and eval
    (redone after a re-sync when every engine died: one retry-with-resync path; EnginesLost when none
    came back) and the weight transfer (as many export passes as it takes). The driver decides each
    time; every rank learns its verdict (distributed/driver_decides.py)."""

    def __init__(
        self, *, roles: RankRoles, placement: Placement, actor: Actor, driver: DriverSide | None, engine_restarts: int
    ) -> None:
        self.roles, self.placement, self.actor, self.driver = roles, placement, actor, driver
        self.engine_restarts = engine_restarts

    @property
    def _driver(self) -> DriverSide:
        """The Driver, in what only the driver rank runs (driver_decides' `decide`, roles.driver branches)."""
        return on_the_driver(self.driver)

    def transfer(self, step: int, *, max_passes: int = 0) -> dict[str, float]:
        """placement.transfer_weights of the weights after `step` updates, as many export passes as it
        takes for every surviving engine to get the whole sync (every rank runs the same number)."""
        passes = driver_decides(lambda: max_passes or self._driver.engine_faults.max_sync_passes())
        for attempt in range(1, passes + 1):
            stats = self.placement.transfer_weights(self.actor, step=step)
            if not driver_decides(lambda: self._driver.engine_faults.sync_redo):
                return {**stats, "sync/passes": float(attempt)} if self.roles.driver else stats
        raise RuntimeError(f"weight sync step_{step}: engines kept dying during the sync ({passes} passes)")

    def around_rollout(self, *, step: int) -> tuple[list[list[Sample]] | None, dict[str, float]]:
        """The driver's rollout ((groups, stats); (None, {}) elsewhere), redone after a re-sync when
        every engine died; EnginesLost on every rank, with the driver's message, when none came back (at
        most rollout.engine_restarts + 1 redone rollouts per step)."""

        def attempt() -> tuple[Verdict, Rollout | None]:
            verdict, result = self._driver.try_phase(
                self._driver.rollout,
                restore_prompts=True,
                during=f"step {step + 1}'s rollout",
                then=f"step {step + 1}'s rollout starts over",
                updates=step,
                step=step + 1,
            )
            if verdict is Verdict.LOST:  # raised on every rank (torchrun's "Root Cause" may be any rank's)
                raise EnginesLost(self._driver.engine_faults.lost_reason)
            return verdict, result

        verdict, result, _ = self._with_resync(attempt, updates=step, attempts=self.engine_restarts + 2)
        if verdict is Verdict.RESYNC:
            raise EnginesLost(
                f"step {step + 1}'s rollout was redone {self.engine_restarts + 1} times: the engines "
                f"keep dying (rollout.engine_restarts={self.engine_restarts})"
            )
        if not self.roles.driver:
            return None, {}
        if result is None:
            raise AssertionError("an OK verdict on the driver carries its rollout")
        return result

    def around_eval(self, *, updates: int) -> dict[str, float]:
        """The driver's evaluate() of the weights after `updates` updates ({} on the other ranks). The
        only engine dying during it: wait for it, re-sync those weights and evaluate once more with the
        same prompts and seeds ("eval/retried": 1). Not back in time, or dying again: the eval is
        recorded as missed ("eval/missed": 1) with a line saying why, and training goes on: the step it
        followed is complete and is never lost (the next rollout waits for an engine, or checkpoints
        this step and stops)."""

        def attempt() -> tuple[Verdict, dict[str, float] | None]:
            return self._driver.try_phase(
                lambda: self._driver.evaluate(step=updates),
                during=f"the eval of step {updates}",
                then="the eval starts over with the same prompts and seeds",
                updates=updates,
                step=updates,
            )

        verdict, scores, attempts = self._with_resync(attempt, updates=updates, attempts=2)
        if not self.roles.driver:
            return {}
        if verdict is Verdict.OK:
            if scores is None:
                raise AssertionError("an OK verdict on the driver carries its eval's scores")
            return {**scores, **({"eval/retried": 1.0} if attempts > 1 else {})}
        faults = self._driver.engine_faults
        why = faults.lost_reason or "the engines died again during the retried eval"
        print(
            f"[eval] the eval of step {updates} is missed (recorded as eval/missed=1): {why}. Training goes on "
            f"from step {updates}, which is complete",
            flush=True,
        )
        faults.lost_reason = ""
        return {"eval/missed": 1.0}

    def _with_resync(
        self, attempt: Callable[[], tuple[Verdict, T | None]], *, updates: int, attempts: int
    ) -> tuple[Verdict, T | None, int]:
        """The one retry-with-resync path: the driver's `attempt()` -> (verdict, result); every rank
        learns the verdict (the result stays on the driver); after RESYNC every rank re-syncs the
        weights after `updates` updates and the driver attempts again, `attempts` times at most.
        Returns the last verdict, the driver's result (None elsewhere) and the attempts made."""
        for made in range(1, attempts + 1):
            kept: list[T | None] = [None]

            def decide(kept: list[T | None] = kept) -> Verdict:  # this attempt's list (B023), called at once below
                verdict, kept[0] = attempt()
                return verdict

            verdict = driver_decides(decide)
            if verdict is not Verdict.RESYNC or made == attempts:
                return verdict, kept[0], made
            self.placement.before_train(self.actor)  # the phases a transfer runs in (a no-op when disaggregated)
            self.transfer(updates)
            self.placement.before_rollout(self.actor)
        raise AssertionError("unreachable: the last attempt returns")
