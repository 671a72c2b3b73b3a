"""The driver decides, every rank learns the result: one collective for every such site.

    slots = driver_decides(lambda: assign_engine_slots(driver.pool.registrations(), devices))
    files = driver_decides(lambda: checkpoint_files(ckpt_dir))   # one listing of a shared directory

The driver (global rank 0, distributed/roles.py) calls `decide()`; every other rank waits in one
object broadcast and returns the driver's result. When `decide()` raises, every rank raises the same
exception (its type and message; the driver re-raises its own, traceback and all), so no rank is left
waiting inside a collective the driver never reaches. A non-driver rank never calls `decide`: it may
touch what only the driver holds (the engine pool, the run's listing).

An exception that does not survive pickling (a constructor with other arguments than its message) and a
result that cannot be pickled reach the other ranks as a RuntimeError naming the type and the message.
Only `Exception` is caught: a KeyboardInterrupt on the driver is the process's own business.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll

T = TypeVar("T")
DRIVER_RANK = 0  # global rank 0 drives (distributed/roles.py: RankRoles.driver)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def driver_decides(decide: Callable[[], T]) -> T:
    """`decide()` on the driver; its result, or the exception it raised, on every rank (a collective
    over the default group when torch.distributed is up with more than one rank)."""
    if _world_size() == 1:
        return decide()
    box: list[bytes | None] = [None]
    error: Exception | None = None
    if dist.get_rank() == DRIVER_RANK:
        try:
            box[0] = _packed(("result", decide()))
        except Exception as err:  # noqa: BLE001 - every rank raises it below, the driver too
            error = err
            box[0] = _packed_error(err)
    coll.broadcast_object_list(box, src=DRIVER_RANK)
    blob = box[0]
    assert blob is not None  # the broadcast filled it on every rank
    kind, value = pickle.loads(blob)
    if kind == "result":
        return value
    raise error if error is not None else value


def _packed(outcome: tuple[str, object]) -> bytes:
    """The outcome as bytes every rank can load; an unpicklable result becomes the error that says so."""
    try:
        return pickle.dumps(outcome)
    except Exception as err:  # noqa: BLE001 - pickling can fail with any type
        return pickle.dumps(
            (
                "error",
                RuntimeError(
                    f"driver_decides: the driver's result ({type(outcome[1]).__name__}) cannot be sent to the other "
                    f"ranks: {type(err).__name__}: {err}"
                ),
            )
        )


def _packed_error(err: Exception) -> bytes:
    try:
        blob = pickle.dumps(("error", err))
        pickle.loads(blob)  # an exception whose __init__ takes other arguments fails only here
        return blob
    except Exception:  # noqa: BLE001 - fall back to the type and message
        return pickle.dumps(("error", RuntimeError(f"{type(err).__name__}: {err}")))
