"""Rollout: one client for SGLang's HTTP API, the engine pool, the sampler, weight sync, the CPU
rollout server (`dapo-megatron serve-rollout`) and the SGLang launcher.

Light imports only (aiohttp, torch): the server's transformers model loads in server.py/cpu_engine.py.
"""

from dapo_megatron.rollout.client import EngineClient, EngineError, EngineUnreachable
from dapo_megatron.rollout.local import LocalEngines
from dapo_megatron.rollout.pool import EnginePool
from dapo_megatron.rollout.sampler import RolloutResult, RolloutSampler, RolloutSettings
from dapo_megatron.rollout.weight_sync import DistributedWeightSync, SyncStats, TensorWeightSync, weight_update_session

__all__ = [
    "DistributedWeightSync",
    "EngineClient",
    "EngineError",
    "EnginePool",
    "EngineUnreachable",
    "LocalEngines",
    "RolloutResult",
    "RolloutSampler",
    "RolloutSettings",
    "SyncStats",
    "TensorWeightSync",
    "weight_update_session",
]
