"""What this rank does in a step, named once instead of tested as `rank == 0` / `driver is None`.

    roles = RankRoles.current(layout)   # layout: what parallel.model_parallel(...) yields
    if roles.driver: ...               # global rank 0: engines, sampler, batch, metrics, run files

Roles of a TP x CP x PP x DP layout (megatron order tp-cp-ep-dp-pp; one DP replica = the TP x CP x
PP ranks that share a DP index):
  driver         global rank 0: talks to the engines, builds the step's batch, logs metrics,
                 writes run files; also the batch source of replica 0 and stage 0's exporter
  batch_source   the first rank of its DP replica (TP, CP and PP rank 0): receives the replica's
                 share from the driver and broadcasts it to the replica's other ranks
  holds_results  last pipeline stage: old / reference log-probs are computed and kept here (every
                 TP and CP rank of the stage holds the whole share's values)
  reports        holds_results on TP rank 0 and CP rank 0: one per DP replica; its values enter
                 the step's metric reductions
  exporter       TP, CP and DP rank 0 of its pipeline stage: the one rank that materialises the
                 stage's full HF tensors (its TP peers only send their shards)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dapo_megatron.distributed.layout import ParallelLayout


@dataclass(frozen=True)
class RankRoles:
    rank: int
    stage: int
    num_stages: int
    dp_rank: int
    dp_size: int
    driver: bool
    batch_source: bool
    holds_results: bool
    reports: bool
    exporter: bool

    @classmethod
    def current(cls, layout: ParallelLayout) -> RankRoles:
        """This rank's roles in the actor's parallel layout (distributed/layout.py)."""
        tp0, cp0 = layout.tp_rank == 0, layout.cp_rank == 0
        stage, stages = layout.pp_rank, layout.pp_size
        last = stage == stages - 1
        dp_rank = layout.dp_rank
        return cls(
            rank=dist.get_rank(),
            stage=stage,
            num_stages=stages,
            dp_rank=dp_rank,
            dp_size=layout.dp_size,
            driver=dist.get_rank() == 0,
            batch_source=tp0 and cp0 and stage == 0,
            holds_results=last,
            reports=last and tp0 and cp0,
            exporter=tp0 and cp0 and dp_rank == 0,
        )

    def describe(self) -> str:
        names = [n for n in ("driver", "batch_source", "holds_results", "reports", "exporter") if getattr(self, n)]
        return f"rank {self.rank} (stage {self.stage}/{self.num_stages}, dp {self.dp_rank}/{self.dp_size}): " + (
            ", ".join(names) or "actor only"
        )
