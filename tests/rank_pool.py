"""A pool of gloo ranks kept alive for a whole pytest session.

Spawning ranks costs ~9 s each time (imports: torch, megatron-core), so tests send work to the same
processes instead. `pool.run(fn, *args)` calls the module-level function `fn(*args)` on every rank,
with torch.distributed initialized (gloo) and the CPU compatibility module applied, and returns the
per-rank results. Results cross process boundaries as torch.save bytes: passing tensors through a
multiprocessing queue failed once on these machines (docs/architecture.md, "Running Megatron-Core on CPU").

fn owns Megatron's parallel state: it must initialize and destroy it (actor.parallel.model_parallel).
A rank that raises sends its traceback; a rank that hangs past `timeout` kills the pool (the next
`rank_pool(n)` call starts a fresh one) so one broken test cannot wedge the session.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import torch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _share_one_gloo_device() -> None:
    """Every gloo group this process makes from now on uses one transport device.

    torch gives each ProcessGroupGloo a device of its own, and each device runs a loop thread that
    wakes every 10 ms even when idle (gloo's tcp Loop polls epoll with that timeout). Megatron makes
    dozens of groups per model, and a pool rank keeps the leaked ones (MAX_THREADS_PER_RANK): 18 idle
    pool ranks held ~680 such threads, 68,000 wake-ups a second, a third of both cores in system time
    (vmstat during the suite, 2026-11-27). A gloo device serves any number of groups' connections (its
    listener tells them apart by sequence number), so one per process keeps the groups as they were."""
    import datetime

    from torch.distributed import distributed_c10d

    base = distributed_c10d.ProcessGroupGloo
    device = base.create_default_device()

    class OneDeviceGloo(base):  # type: ignore[misc, valid-type]
        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            options = base._Options()
            options._devices = [device]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = OneDeviceGloo


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        from dapo_megatron.actor.compat import apply_cpu_compat
    except ImportError:
        apply_cpu_compat = None
    if apply_cpu_compat is not None:
        apply_cpu_compat()
    import torch.distributed as dist

    _share_one_gloo_device()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        msg = conn.recv_bytes()
        if not msg:  # empty message: shut down
            break
        try:
            fn, args, kwargs = _loads(msg)
            reply = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            reply = (False, f"rank {rank}:\n{traceback.format_exc()}")
        reply = (*reply, len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0)
        try:
            payload = _dumps(reply)
        except Exception:  # noqa: BLE001 - an unpicklable result is a test bug, say so
            payload = _dumps((False, f"rank {rank}: result not serializable:\n{traceback.format_exc()}"))
        conn.send_bytes(payload)
    dist.destroy_process_group()


# An Actor with megatron's DDP + distributed optimizer is never freed once built: DDP registers its
# grad hooks on C++ autograd nodes, a reference cycle the garbage collector cannot see through, and
# the objects in it hold megatron's gloo groups, each with polling threads (~45 threads per Actor,
# measured 2026-11-23; destroy_process_group cannot stop them while the group is referenced). A
# training process builds one Actor and is unaffected; a pool that builds hundreds reached 1,700
# threads per rank and a load average of 700 on a 2-core machine. So a rank whose thread count passes
# this bound is replaced before the pool's next use (conftest.rank_pool).
MAX_THREADS_PER_RANK = 300


class RankPool:
    def __init__(self, world_size: int, *, timeout: float = 600.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.max_threads = 0  # the largest thread count a rank reported after a job
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    @property
    def worn_out(self) -> bool:
        """Leaked threads past MAX_THREADS_PER_RANK (see there): time for fresh ranks."""
        return self.max_threads > MAX_THREADS_PER_RANK

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        assert self.alive, "rank pool has a dead rank"
        msg = _dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(msg)
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout):
                self.close(force=True)
                raise TimeoutError(f"rank {rank} did not answer within {self.timeout:.0f} s; pool killed")
            ok, value, threads = _loads(conn.recv_bytes())
            self.max_threads = max(self.max_threads, threads)
            (results if ok else errors).append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def close(self, *, force: bool = False) -> None:
        # a rank's own children outlive a killed rank: megatron's checkpoint writer starts a
        # multiprocessing Manager per process (filesystem_async._get_write_results_queue), whose server,
        # orphaned, kept ~270 MB and the test's stdout open (a `pytest ... | grep` never ended; 2026-11-28)
        children = self._children()
        for conn, proc in zip(self._conns, self._procs):
            if not force and proc.is_alive():
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()

    def _children(self) -> list[psutil.Process]:
        found = []
        for proc in self._procs:
            with contextlib.suppress(psutil.NoSuchProcess, ValueError):
                found += psutil.Process(proc.pid).children(recursive=True)
        return found
