"""Rollout: one client for SGLang's HTTP API, the engine pool, the sampler, the overlapped rollout,
routing replay data and the SGLang launcher. Weight transfer is transfer/'s; the CPU stand-in for SGLang
is cpu_engine/'s; starting local engines is launch/engines.py's.
"""

from dapo_megatron.rollout.client import EngineClient, EngineError, EngineUnreachable
from dapo_megatron.rollout.pool import EnginePool
from dapo_megatron.rollout.sampler import RolloutResult, RolloutSampler, RolloutSettings

__all__ = [
    "EngineClient",
    "EngineError",
    "EnginePool",
    "EngineUnreachable",
    "RolloutResult",
    "RolloutSampler",
    "RolloutSettings",
]
