"""An engine whose weight-update session call was cut (reset / refused mid-sync) is dropped and the sync
redone, even when its port still accepts one TCP probe right after (a host going down, seen on the
multi-host test on 2026-11-26: the trainer exited 1 instead). A refusal by a live engine is still raised."""

import asyncio
import socket

import pytest

from dapo_megatron.rollout.client import EngineError, EngineUnreachable
from dapo_megatron.transfer.engine_push import sync_dropping_dead


class _Client:
    def __init__(self, url):
        self.url = url


class _Pool:
    """The engine pool's interface that sync_dropping_dead uses, recording what it is told."""

    def __init__(self, urls):
        self.clients = [_Client(u) for u in urls]
        self.dead: dict[str, str] = {}

    async def discover(self):
        return None

    def pending_urls(self):
        return []

    def weight_targets(self):
        return list(self.clients)

    def live_clients(self):
        return [c for c in self.clients if c.url not in self.dead]

    def mark_dead(self, url, why):
        self.dead[url] = why

    def admit(self, urls):
        return None


class _Sync:
    def __init__(self, error):
        self.error = error
        self.closed = 0

    async def sync(self, targets, named, *, weight_version):
        raise self.error

    async def close(self, clients):
        self.closed += 1


@pytest.fixture
def listening_url():
    """An engine port that still accepts TCP connections (the probe finds it reachable)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _begin_failed(url, cause):
    cut = [url] if isinstance(cause, EngineUnreachable) else []
    return EngineError(f"weight sync: engine {url}: begin_weight_update failed: {cause}", url=url, cut_urls=cut)


def test_a_cut_session_call_drops_the_engine_although_its_port_answers(listening_url):
    pool = _Pool([listening_url])
    sync = _Sync(_begin_failed(listening_url, EngineUnreachable("engine unreachable (ServerDisconnectedError)")))
    stats, redo = asyncio.run(sync_dropping_dead(pool, sync, iter([]), weight_version="step_1"))
    assert (stats, redo) == (None, True)
    assert list(pool.dead) == [listening_url] and "died during weight sync step_1" in pool.dead[listening_url]
    assert sync.closed == 1


def test_a_refusal_by_a_live_engine_is_raised(listening_url):
    pool = _Pool([listening_url])
    sync = _Sync(_begin_failed(listening_url, EngineError("400: a weight-update session is already open")))
    with pytest.raises(EngineError, match="already open"):
        asyncio.run(sync_dropping_dead(pool, sync, iter([]), weight_version="step_1"))
    assert pool.dead == {}
