"""This rank's place in the actor's parallel layout, read once and passed in.

    with model_parallel(tp=2, pp=2, seed=42) as layout:     # actor/parallel.py builds it
        roles = RankRoles.current(layout)
        actor = Actor(settings, hf_dir, layout)
        share, _ = scatter_batch(batch, layout=layout, ...)

A frozen record of megatron's parallel_state after its model-parallel init: every rank and size the
package's code reads, whether the rank is the first / last pipeline stage, and the process groups.
Consumers receive it instead of asking parallel_state through getters, so what a component depends
on is in its signature, and a test can see the whole layout of a rank at once. It lives in the data
plane (below the actor) because the data plane consumes it too (roles.py, scatter.py); the actor
builds it (actor/parallel.py, ParallelLayout.from_megatron there).

Rank order is megatron's "tp-cp-ep-dp-pp". The groups are valid until model_parallel() exits (its
groups are destroyed then): a layout does not outlive the `with` block that made it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    rank: int  # global rank
    world_size: int
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    pp_group: dist.ProcessGroup
    vpp_size: int | None  # virtual pipeline stages per rank (model chunks); None without VPP
    is_first_stage: bool  # first pipeline stage (virtual stages ignored): it embeds the tokens
    is_last_stage: bool  # last pipeline stage (virtual stages ignored): it holds the log-probs and the loss
    cp_rank: int
    cp_size: int
    cp_group: dist.ProcessGroup
    dp_rank: int  # data-parallel index (the replica) without context parallelism
    dp_size: int
    dp_group: dist.ProcessGroup
    dp_cp_rank: int  # DP x CP: the group gradients reduce over (and the distributed optimizer shards)
    dp_cp_size: int
    dp_cp_group: dist.ProcessGroup
    ep_rank: int  # expert parallel: carved out of the DP ranks (megatron's expert rank generator)
    ep_size: int
    ep_group: dist.ProcessGroup
    etp_rank: int  # expert tensor parallel (actor.etp; = tp unless set)
    etp_size: int
    etp_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup  # this rank's DP replica: its TP, CP and PP peers, itself included

    @property
    def sizes(self) -> dict[str, int | None]:
        """The sizes a config names (actor.tp, ...): to check a layout against the config, or record it."""
        return {
            "tp": self.tp_size,
            "pp": self.pp_size,
            "cp": self.cp_size,
            "vpp": self.vpp_size,
            "ep": self.ep_size,
            "etp": self.etp_size,
        }
