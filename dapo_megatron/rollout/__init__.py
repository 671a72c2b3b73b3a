"""Rollout: one client for SGLang's HTTP API, the engine pool, the sampler, the overlapped rollout,
routing replay data and the SGLang launcher. Weight transfer is transfer/'s; the CPU stand-in for SGLang
is cpu_engine/'s; starting local engines is launch/local/engines.py's. The package itself imports nothing, so that
the launcher's light modules (auth.py, registry.py) do not pull aiohttp and torch in with them.
"""
