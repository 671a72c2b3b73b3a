"""What the trainer does when rollout engines fail mid-run (docs/architecture.md, "Faults a long run meets").

    groups, stats = rollout_with_recovery(cfg, step, roles=..., actor=..., driver=..., placement=...)  # every rank
    stats = transfer_with_recovery(placement, actor, step=step + 1, roles=roles, driver=driver)       # every rank
    scores = evaluate_with_recovery(cfg, updates=step + 1, roles=..., actor=..., driver=..., placement=...)  # every rank

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

An engine dying during a weight sync: the sync fails at its bucket (weight_sync.py checks every engine
is reachable before a bucket's broadcast), the dead engine is dropped, the rest of the export is still
consumed on the driver (the other ranks run its collectives), and every rank runs another export pass
(one broadcast int after each pass says whether): the survivors got part of the new weights and take
the whole sync again in a group re-formed without the dead one. It rejoins through the normal re-sync
(pending after it registers again, admitted after the next push).
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

import torch

OK, RESYNC, LOST = 0, 1, 2


class EnginesLost(RuntimeError):
    """No rollout engine left and none came back within rollout.engine_wait_s."""


def broadcast_code(code: int) -> int:
    """Global rank 0's `code` on every rank (a collective when torch.distributed is up)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return code
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([code], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def broadcast_text(text: str) -> str:
    """Global rank 0's `text` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------- weight sync
async def _drop_unreachable(pool, clients, *, why: str) -> list[str]:
    from dapo_megatron.transfer.weight_sync import engine_unreachable

    errors = await asyncio.gather(*(engine_unreachable(c.url) for c in clients))
    dead = [c.url for c, err in zip(clients, errors) if err is not None]
    for url, err in zip([c.url for c in clients], errors):
        if err is not None:
            pool.mark_dead(url, f"{why}: {type(err).__name__}: {err}")
    return dead


async def sync_dropping_dead(pool, weight_sync, named, *, weight_version: str, around=None):
    """One export pass into the live + pending engines (driver). Returns (stats or None, redo): redo is
    True when an engine died during the pass (dropped; the survivors need the whole sync again). The
    iterator `named` is always consumed to its end: the other ranks run its collectives."""
    from dapo_megatron.rollout.client import EngineError

    await pool.discover()
    if pool.pending_urls():  # new incarnations join a new group (a restarted engine may keep its url)
        await weight_sync.close(pool.live_clients())
    targets = pool.weight_targets()
    try:
        if not targets:  # nothing to send to: the next rollout waits for an engine (rollout_with_recovery)
            return None, False
        sync = weight_sync.sync(targets, named, weight_version=weight_version)
        # around(targets, sync): e.g. the engines paused while steps overlap (rollout/async_rollout.py)
        stats = await (around(targets, sync) if around is not None else sync)
    except EngineError as err:
        if not await _drop_unreachable(pool, targets, why=f"died during weight sync {weight_version}"):
            raise  # every engine answers: not a dead engine (a refused bucket is a bug to see)
        await weight_sync.close(pool.live_clients())
        return None, True
    finally:
        for _ in named:  # what the failed or skipped sync left of this pass
            pass
    pool.admit(pool.pending_urls())
    return stats, False


def transfer_with_recovery(placement, actor, *, step: int, roles, driver, max_passes: int = 0) -> dict[str, float]:
    """placement.transfer_weights, as many export passes as it takes for every surviving engine to get
    the whole sync (every rank runs the same number: the driver's verdict is broadcast after each)."""
    max_passes = max_passes or (len(driver.pool.load()) + 1 if driver else 0)
    passes = broadcast_code(max_passes)  # the same bound on every rank
    for attempt in range(1, passes + 1):
        stats = placement.transfer_weights(actor, step=step)
        if not broadcast_code(int(bool(driver and driver.sync_redo))):
            return {**stats, "sync/passes": float(attempt)} if driver else stats
    raise RuntimeError(f"weight sync step_{step}: engines kept dying during the sync ({passes} passes)")


# --------------------------------------------------------------------------------------- rollout
def _events_path(driver) -> Path:
    from dapo_megatron.rollout.registry import engine_events_path

    return engine_events_path(driver.run_dir)


def _launcher_gave_up(driver) -> list[dict]:
    """The launcher's engines that exited with the restart budget spent, when that is all of them."""
    from dapo_megatron.rollout.registry import read_engine_events

    r = driver.cfg.rollout
    if r.engine != "cpu" or r.engine_urls:
        return []
    down = {e["engine"]: e for e in read_engine_events(_events_path(driver)) if e["action"] == "budget_spent"}
    return list(down.values()) if len(down) >= r.num_engines else []


async def wait_for_engine(driver, *, wait_s: float, poll_s: float = 0.5) -> bool:
    """True once an engine registers again (pending: it needs the weights first); False after wait_s,
    or at once when the local launcher has given up on every engine it started."""
    deadline = time.monotonic() + wait_s
    while True:
        if await driver.pool.discover():
            return True
        if time.monotonic() >= deadline or _launcher_gave_up(driver):
            return False
        await asyncio.sleep(poll_s)


def _lost_message(driver, step: int, err: BaseException, waited_s: float) -> str:
    drops = {}
    for _, event, url in driver.pool.events:
        if event.startswith("dropped"):
            drops[url] = event.removeprefix("dropped").lstrip(": ")
    named = "; ".join(f"{url} dropped ({why})" for url, why in drops.items()) or str(err)
    launcher = "; ".join(f"the launcher's {e['engine']} exited with code {e['returncode']} and was not restarted "
                         f"(restart budget rollout.engine_restarts={e['budget']} spent)"
                         for e in _launcher_gave_up(driver))
    return (f"no rollout engine left at step {step + 1}: {named}; none registered again within "
            f"{waited_s:.0f} s (rollout.engine_wait_s={driver.cfg.rollout.engine_wait_s:g})"
            + (f"; {launcher}" if launcher else "") + f". Last error: {type(err).__name__}: {err}")


def _driver_attempt(driver, step: int):
    from dapo_megatron.rollout.client import EngineError
    from dapo_megatron.rollout.pool import NoLiveEngine

    # where this step's prompts and request numbers begin; not while steps overlap: the producer thread
    # draws prompts ahead, and its failed batch's prompts stay used (rollout/async_rollout.py)
    state = copy.deepcopy(driver.state_dict()) if driver.overlap is None else None
    try:
        return OK, driver.rollout()
    except EngineError as err:
        if driver.pool.live_urls() and not isinstance(err, NoLiveEngine):
            raise  # engines answer: not an engine loss
        if state is not None:
            driver.load_state_dict(state)  # the redone rollout asks for the same samples
        if driver.pool.live_urls():  # overlapped steps: an engine came back and took a push meanwhile
            print(f"[engines] every engine was lost while batch {step + 1} was generating; "
                  f"{', '.join(driver.pool.live_urls())} is back: re-syncing the weights of step {step}, then "
                  f"step {step + 1}'s rollout starts over", flush=True)
            return RESYNC, None
        wait_s = driver.cfg.rollout.engine_wait_s
        print(f"[engines] no engine left during step {step + 1}'s rollout ({type(err).__name__}); waiting up to "
              f"{wait_s:g} s (rollout.engine_wait_s) for one to register again", flush=True)
        tic = time.monotonic()
        if driver.run(wait_for_engine(driver, wait_s=wait_s)):
            print(f"[engines] {', '.join(driver.pool.pending_urls())} registered after {time.monotonic() - tic:.1f} s: "
                  f"re-syncing the weights of step {step}, then step {step + 1}'s rollout starts over", flush=True)
            return RESYNC, None
        driver.lost_reason = _lost_message(driver, step, err, time.monotonic() - tic)
        return LOST, None


def rollout_with_recovery(cfg, step: int, *, roles, actor, driver, placement):
    """driver.rollout() on the driver ((groups, stats); None elsewhere), redone after a re-sync when the
    only engine died; EnginesLost on every rank when none came back (at most rollout.engine_restarts + 1
    redone rollouts per step)."""
    for _ in range(cfg.rollout.engine_restarts + 2):
        code, result = (_driver_attempt(driver, step) if roles.driver else (OK, None))
        code = broadcast_code(code)
        if code == OK:
            return result
        if code == LOST:  # the driver's message on every rank: torchrun's "Root Cause" may be any rank's
            raise EnginesLost(broadcast_text(driver.lost_reason if driver else ""))
        placement.before_train(actor)  # the phases a transfer runs in (a no-op when disaggregated)
        transfer_with_recovery(placement, actor, step=step, roles=roles, driver=driver)
        placement.before_rollout(actor)
    raise EnginesLost(f"step {step + 1}'s rollout was redone {cfg.rollout.engine_restarts + 1} times: the engines "
                      f"keep dying (rollout.engine_restarts={cfg.rollout.engine_restarts})")


# --------------------------------------------------------------------------------------- evaluation
def _eval_attempt(driver, updates: int):
    from dapo_megatron.rollout.client import EngineError
    from dapo_megatron.rollout.pool import NoLiveEngine

    try:
        return OK, driver.evaluate()
    except EngineError as err:
        if driver.pool.live_urls() and not isinstance(err, NoLiveEngine):
            raise  # engines answer: not an engine loss
        wait_s = driver.cfg.rollout.engine_wait_s
        print(f"[engines] no engine left during the eval of step {updates} ({type(err).__name__}); waiting up to "
              f"{wait_s:g} s (rollout.engine_wait_s) for one to register again", flush=True)
        tic = time.monotonic()
        if driver.pool.live_urls() or driver.run(wait_for_engine(driver, wait_s=wait_s)):
            print(f"[engines] {', '.join(driver.pool.pending_urls() or driver.pool.live_urls())} registered after "
                  f"{time.monotonic() - tic:.1f} s: re-syncing the weights of step {updates}, then the eval "
                  "starts over with the same prompts and seeds", flush=True)
            return RESYNC, None
        driver.lost_reason = _lost_message(driver, updates - 1, err, time.monotonic() - tic)  # ("at step <updates>")
        return LOST, None


def evaluate_with_recovery(cfg, *, updates: int, roles, actor, driver, placement) -> dict[str, float]:
    """Every rank: driver.evaluate() of the weights after `updates` updates. The only engine dying
    during it: wait for it to come back, re-sync those weights (a collective, hence every rank) and
    evaluate once more with the same prompts and seeds ("eval/retried": 1). Not back in time, or dying
    again: the eval is recorded as missed ("eval/missed": 1) with a line saying why, and training goes
    on: the step it followed is complete and is never lost (the next rollout waits for an engine, or
    checkpoints this step and stops: rollout_with_recovery)."""
    for attempt in range(2):
        code, scores = _eval_attempt(driver, updates) if roles.driver else (OK, {})
        code = broadcast_code(code)
        if code == OK:
            return {**scores, **({"eval/retried": 1.0} if attempt and driver else {})}
        if code == LOST or attempt == 1:
            break
        placement.before_train(actor)  # the phases a transfer runs in (a no-op when disaggregated)
        transfer_with_recovery(placement, actor, step=updates, roles=roles, driver=driver)
        placement.before_rollout(actor)
    if not driver:
        return {}
    why = driver.lost_reason or "the engines died again during the retried eval"
    print(f"[eval] the eval of step {updates} is missed (recorded as eval/missed=1): {why}. Training goes on "
          f"from step {updates}, which is complete", flush=True)
    driver.lost_reason = ""
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
