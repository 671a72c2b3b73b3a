"""When the loop checkpoints, and what it resumes from (the files: trainer/checkpoint/files.py).

    checkpointer = Checkpointer(cfg, actor=actor, driver=driver, roles=roles, placement=placement)
    state = checkpointer.resume()          # --resume: the newest checkpoint that verifies, loaded; its TrainerState
    checkpointer.save(state, last_step=..., stop=...)   # every save_every steps, the last step, a stop request
    checkpointer.save_before_stopping(state)            # no engine left: keep the last completed step

Every method is a collective (every rank calls it at the same step), as the checkpoint is.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dapo_megatron.config import Config
from dapo_megatron.distributed.driver_decides import driver_decides
from dapo_megatron.trainer.checkpoint import files as ckpt
from dapo_megatron.trainer.checkpoint.files import TrainerState
from dapo_megatron.trainer.checkpoint.progress import CheckpointTimes, resumed_line
from dapo_megatron.trainer.checkpoint.resume_check import check_resume_model
from dapo_megatron.trainer.recovery import on_the_driver

if TYPE_CHECKING:  # the loop's components; imported at run time they would bring megatron into every reader of this
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.distributed.roles import RankRoles
    from dapo_megatron.trainer.driver import Driver
    from dapo_megatron.trainer.placement import Placement


class Checkpointer:
    def __init__(
        self, cfg: Config, *, actor: Actor, driver: Driver | None, roles: RankRoles, placement: Placement
    ) -> None:
        self.cfg, self.actor, self.driver, self.roles, self.placement = cfg, actor, driver, roles, placement
        self.run_dir = Path(cfg.trainer.output_dir)
        self.save_every = cfg.trainer.save_every  # 0 = only the last step and a stop request

    def resume(self) -> TrainerState:
        """The newest checkpoint that verifies against its manifest (ValueError when there is none),
        loaded into the actor and the driver; the loop continues after its step."""
        # the driver's progress line while it reads and its closing line (checkpoint/progress.py): no collective
        times = CheckpointTimes(speaks=self.roles.driver)
        with times.reading("verify", label="[checkpoint] resuming: checksums:"):
            latest = ckpt.newest_valid_checkpoint(self.run_dir)
        state = ckpt.read_trainer_state(latest)
        # the launcher checked the model before starting anything; a Slurm job's ranks start without one
        check_resume_model(latest, model_dir=self.cfg.model.path)
        with times.reading("actor", label=f"[checkpoint] resuming: loading {latest.name}/actor:"):
            self.actor.load(latest / "actor", seed=self.cfg.trainer.seed)  # the seed: RNG states of another layout
        if self.roles.driver:
            if state.driver is None:
                raise ValueError(f"{latest}: {ckpt.STATE_FILE} has no driver state (prompt order, request counter)")
            on_the_driver(self.driver).load_state_dict(state.driver)
            times.say(resumed_line(state.step, latest, times, size=ckpt.checkpoint_bytes(latest)))
        return state

    def should_save(self, step: int, *, last_step: bool, stop: bool) -> bool:
        return bool(self.save_every and step % self.save_every == 0) or last_step or stop

    def save(self, state: TrainerState, *, last_step: bool, stop: bool) -> None:
        """The checkpoint of state.step when it is due (a collective: every rank decides the same)."""
        if self.should_save(state.step, last_step=last_step, stop=stop):
            with self.placement.actor_on_device(self.actor, step=state.step):  # colocated: the engines make room
                ckpt.save_step(self.cfg, self.actor, self.driver, self.roles, state=state)

    def save_before_stopping(self, state: TrainerState) -> str:
        """A checkpoint of the last completed step (state.step updates) unless one is on disk; what was
        done, for the error message."""
        self.actor.onload()  # colocated: it was offloaded for the rollout (no engine is left to make room for)
        final = self.step_dir(state.step)
        if state.step == 0:
            return "no step was completed: nothing to checkpoint"
        if driver_decides(final.is_dir):
            return f"the checkpoint of step {state.step} is on disk ({final})"
        ckpt.save_step(self.cfg, self.actor, self.driver, self.roles, state=state)
        return f"checkpoint of step {state.step} written ({final}); continue with --resume"

    def step_dir(self, step: int) -> Path:
        return ckpt.step_dir(self.run_dir, step)

    def latest(self) -> Path | None:
        return ckpt.latest_checkpoint(self.run_dir)
