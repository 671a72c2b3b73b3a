"""Device memory of a Megatron model and its optimizer: offload to a host backup, onload bit for bit,
and a ledger of what is resident, per category.

    memory = DeviceMemory(lambda: actor_tensors(chunks, optimizer))
    memory.offload("grads", "optimizer")      # keep what the weight transfer reads: the parameters
    memory.offload("params")                  # nothing of the actor left on the device
    memory.resident_bytes()                   # {"params": 0, "grads": 0, "optimizer": 0}
    memory.onload()                           # every category back, bit for bit (grads: zeros)

One mechanism on GPUs and on CPU: the "device copy" of a tensor is its storage. Offload copies the
storage's bytes into a host backup (pinned memory when the storage is on a GPU), then frees the
storage with `untyped_storage().resize_(0)`; onload re-allocates it at the same size and copies the
bytes back. Every tensor object (parameters, their `.data` views into Megatron's contiguous
param/grad buffers, `main_grad` views, the distributed optimizer's shard views, Adam's `exp_avg`)
stays the same Python object, so nothing that holds a reference to one (DDP buckets, the optimizer's
param groups) has to be rebuilt. Megatron-core 0.16.1 frees its own DDP buffers the same way
(distributed/param_and_grad_buffer.py `_ParamAndGradBuffer.offload_to_cpu`, distributed_data_parallel.py
`offload_grad_buffers`), and so does verl (verl/utils/megatron_utils.py `offload_megatron_model_to_cpu`;
its newer worker frees Adam state by resize too, "so the tensor can be offloaded correctly even when
it has tensor views"). We do not call megatron's `MegatronOptimizer.offload_to_cpu` (optimizer.py): it rebinds
`p.data = p.data.cpu()` on the optimizer's parameters, which under fp32 ARE the model's parameters
(FP32Optimizer) or views into the DDP param buffer (the distributed optimizer's shards, which come
back as separate copies: memory the buffer already holds), so "offload the optimizer" would also
move the weights the transfer reads; and it skips CPU tensors (so it cannot run in CI).

The colocated step offloads in two stages, as NeMo-RL's Megatron policy worker does
(nemo_rl/models/policy/megatron_policy_worker.py: `offload_before_refit` drops the grad buffers and
moves the optimizer state out but keeps the parameters the refit reads; `offload_after_refit` moves
the parameters too): offload("grads", "optimizer") before the weight transfer, offload("params") after.

Aliasing: tensors are grouped by the storage they view and every storage is handled exactly once, by
the first category that names it, in the order params -> grads -> optimizer. So Megatron's contiguous
buffers are moved once, through their buffer, whatever number of views exist: the fp32 distributed
optimizer's main-param shards are views of the param buffer (they count as, and move with, "params");
`shard_main_param.grad` is a view of the grad buffer ("grads"); only the bf16 optimizer's own fp32
master copies and Adam's moments are "optimizer".

Gradients are dead between steps (Actor.train zeroes the grad buffers before its first micro-batch),
so by default their storage is freed without a backup and comes back as zeros, like megatron's
`reload_from_cpu` and verl's `load_megatron_model_to_gpu`; this saves a D2H copy and 4 bytes of
pinned host memory per parameter. `keep_grads=True` backs them up like the rest.

torch_memory_saver (slime's choice: every allocation made inside its region is unmapped by
`pause()`, keeping virtual addresses) would need the model and optimizer built inside that region and
the library preloaded into the process; the storage path needs neither and runs the same code on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dapo_megatron.distributed import collectives as coll

CATEGORIES = ("params", "grads", "optimizer")


def device_type() -> str:
    """Where the trainer's "device" memory lives: the GPU, or the host on the CPU twin."""
    return coll.compute_device().type


def actor_tensors(model_chunks: list, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of a Megatron model (+ optimizer, may be None) by category, views included.

    params:    parameters and registered buffers of every (unwrapped) chunk
    grads:     each parameter's main_grad (DDP's grad buffer) and .grad, the optimizer params' .grad
    optimizer: the optimizer's own parameters (fp32 master copies / distributed shards) and every
               tensor in its state (Adam exp_avg, exp_avg_sq, step)
    Collected afresh at each call: Adam creates its state lazily and checkpoint loading replaces it.
    """
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    opt: list[torch.Tensor] = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            params.append(p)
            grads.extend(g for g in (getattr(p, "main_grad", None), p.grad) if g is not None)
        params.extend(chunk.buffers())
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                opt.append(p)
                if p.grad is not None:
                    grads.append(p.grad)
        for state in inner.state.values():
            opt.extend(v for v in state.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer": opt}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (Chained)Optimizer; none for a frozen model."""
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            out.append(inner)
    return out


def storages_by_category(
    tensors: dict[str, list[torch.Tensor]], *, device: str
) -> dict[str, dict[int, torch.UntypedStorage]]:
    """{category: {storage id: storage}} over the tensors on `device`, each storage in ONE category
    (the first of CATEGORIES that holds a view of it). The id is the storage's C++ object
    (`_cdata`): stable across resize_, unlike data_ptr, which is 0 for every freed storage."""
    seen: set[int] = set()
    out: dict[str, dict[int, torch.UntypedStorage]] = {}
    for category in CATEGORIES:
        found: dict[int, torch.UntypedStorage] = {}
        for t in tensors.get(category, ()):
            if t.device.type != device:  # e.g. torch Adam's `step` stays on the host next to a GPU model
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in seen:
                seen.add(key)
                found[key] = storage
        out[category] = found
    return out


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage: copies through it are exact whatever the dtypes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DeviceMemory:
    """Offload / onload / resident bytes of the tensors that `collect()` returns by category.

    frozen=True: the tensors never change (the KL reference model), so the host backup taken at
    the first offload stays valid: later offloads only free the storage (no device-to-host copy).
    """

    def __init__(self, collect: Callable[[], dict[str, list[torch.Tensor]]], *, frozen: bool = False) -> None:
        self._collect = collect
        self._frozen = frozen
        self._device = device_type()
        # category -> {storage id: (storage, nbytes)} of the storages this object freed
        self._freed: dict[str, dict[int, tuple[torch.UntypedStorage, int]]] = {c: {} for c in CATEGORIES}
        self._backups: dict[int, torch.Tensor] = {}  # storage id -> host uint8 copy (reused across offloads)

    @staticmethod
    def _check(what: Iterable[str]) -> tuple[str, ...]:
        what = tuple(what) or CATEGORIES
        for category in what:
            if category not in CATEGORIES:
                raise ValueError(f"offload/onload: unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
        return what

    def offloaded(self) -> tuple[str, ...]:
        """The categories that have a freed storage now."""
        return tuple(c for c in CATEGORIES if self._freed[c])

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of device storage each category holds now (a freed storage counts 0)."""
        storages = storages_by_category(self._collect(), device=self._device)
        return {c: sum(s.nbytes() for s in storages[c].values()) for c in CATEGORIES}

    @torch.no_grad()
    def offload(self, *what: str, keep_grads: bool = False) -> None:
        """Free the device storage of these categories (all without arguments), keeping a host backup
        (gradients: none unless keep_grads). Idempotent."""
        what = self._check(what)
        storages = storages_by_category(self._collect(), device=self._device)
        pin = self._device == "cuda"
        for category in what:
            for key, storage in storages[category].items():
                nbytes = storage.nbytes()
                if nbytes == 0:  # already freed (or empty)
                    continue
                if category != "grads" or keep_grads:
                    backup = self._backups.get(key)
                    if backup is None or backup.numel() != nbytes:
                        backup = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                        self._backups[key] = backup
                        backup.copy_(_bytes_view(storage), non_blocking=pin)
                    elif not self._frozen:
                        backup.copy_(_bytes_view(storage), non_blocking=pin)
                else:
                    self._backups.pop(key, None)
                self._freed[category][key] = (storage, nbytes)
        alive = {key for found in storages.values() for key in found}
        self._backups = {k: v for k, v in self._backups.items() if k in alive}  # replaced tensors (a loaded checkpoint)
        if pin:
            torch.cuda.synchronize()  # the copies must land before the memory is reused
        for category in what:
            for storage, _ in self._freed[category].values():
                storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()  # hand the blocks back to the driver: the engines allocate next

    @torch.no_grad()
    def onload(self, *what: str) -> None:
        """Re-allocate what offload freed in these categories (all without arguments) and copy the
        host backup back (bit for bit); gradients freed without a backup come back as zeros."""
        what = self._check(what)
        for category in what:
            for key, (storage, nbytes) in self._freed[category].items():
                storage.resize_(nbytes)
                backup = self._backups.get(key)
                if backup is None:
                    _bytes_view(storage).zero_()
                else:
                    _bytes_view(storage).copy_(backup, non_blocking=True)
                    if not self._frozen and category == "grads":
                        del self._backups[key]  # grads are backed up per offload, not kept
            self._freed[category] = {}
        if self._device == "cuda":
            torch.cuda.synchronize()

    def host_backup_bytes(self) -> int:
        """Host bytes of the backups held now (pinned on GPUs; kept across offloads for reuse)."""
        return sum(b.numel() for b in self._backups.values())


GIB = 2**30  # the ledger's "gb", as torch and SGLang print memory


def trainer_memory_gb(*, phase: str, actor, ref=None) -> dict[str, float]:
    """Collective: the trainer side of the memory ledger at this phase of the step, the max over
    ranks (a GPU holds one rank) of device bytes held from the real storages, in GiB:
        memory/actor_gb_during_<phase>            actor (every category) + reference
        memory/actor_<category>_gb_during_<phase> per category of the actor
        memory/ref_gb_during_<phase>              the frozen reference (0 between its calls)
        memory/host_backup_gb_during_<phase>      host (pinned) backups of actor + reference
    """
    import torch.distributed as dist

    held = actor.resident_bytes()
    names = [f"actor_{c}" for c in CATEGORIES] + ["ref", "actor", "host_backup"]
    ref_bytes = sum(ref.resident_bytes().values()) if ref is not None else 0
    backups = actor.memory.host_backup_bytes() + (ref.host_backup_bytes() if ref is not None else 0)
    values = [held[c] for c in CATEGORIES] + [ref_bytes, sum(held.values()) + ref_bytes, backups]
    device = coll.compute_device()
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        coll.all_reduce(t, op=dist.ReduceOp.MAX)
    return {f"memory/{name}_gb_during_{phase}": float(v) / GIB for name, v in zip(names, t.tolist())}
