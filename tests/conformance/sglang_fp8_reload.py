"""SGLang 0.5.21's own model, quantization and weight-update code on CPU, loading our block-FP8 rollout
checkpoint at start-up and reloading two syncs in place (tests/conformance/test_fp8_sglang_reload.py).

    python tests/conformance/sglang_fp8_reload.py EXPORT_DIR SYNC1.safetensors SYNC2.safetensors OUT_DIR [--tp-size 2]

For each engine TP rank (ranks are built one after the other in this process), SGLang's code, imported
from the installed sglang==0.5.21, not copied:
  1. start-up: prepare_server_args(--model-path EXPORT_DIR --quantization fp8 ...) and publish (which
     builds ModelConfig: _verify_quantization checks --quantization against the checkpoint's
     quantization_config); model_loader/loader.py _get_quantization_config (-> Fp8Config.from_config) and
     _initialize_model (Qwen2ForCausalLM with QKVParallelLinear / MergedColumnParallelLinear /
     RowParallelLinear, whose Fp8LinearMethod.create_weights registers weight + weight_scale_inv);
     DefaultModelLoader.load_weights_and_postprocess over safetensors_weights_iterator (the legacy
     Qwen2ForCausalLM.load_weights: stacked q/k/v -> qkv_proj, gate/up -> gate_up_proj, each through
     the parameter's weight loader; then process_weights_after_loading on every quantized module);
  2. sync 1, the disaggregated transport: SchedulerWeightUpdaterManager.begin_weight_update
     (-> WeightUpdater.begin_weight_update -> DefaultModelLoader.restore_weights_before_loading),
     update_weights_from_distributed with load_format "flattened_bucket" (receive_weights_from_distributed
     allocates SGLang's FlattenedTensorBucket and views the tensors back; load_weights_from_distributed ->
     model.load_weights), end_weight_update (-> postprocess_weights: process_weights_after_loading again);
  3. sync 2, the colocated transport: the same session around update_weights_from_tensor with our
     serialize_for_engine_rank payload (TpModelWorker.deserialize_own_rank, MultiprocessingSerializer).
After each phase the quantized parameters (weight bytes, weight_scale_inv) and, per parameter, its
object identity, class and whether it still has a weight_loader, are written to OUT_DIR
(rank{r}_{phase}.safetensors, report.json); the test compares them with what we sent.

Stand-ins (no GPU here), named:
  - the broadcast of sync 1: torch.distributed.broadcast is replaced, for the duration of
    receive_weights_from_distributed, by a copy of our flatten_bucket bytes into the tensor SGLang
    allocated (its own bucket layout, its own reconstruct_tensors);
  - vllm._custom_ops: RotaryEmbedding.__init__ imports its rotary kernel when not on CUDA/CPU-AMX; an
    empty module (no forward runs here);
  - the parallel groups (pp_group, tp_group, ...): objects that say "first and last rank" (no collective
    runs: the model is built, not run); tp_rank / tp_size are set with get_parallel().override.
What cannot run here: a forward (Fp8LinearMethod.apply dispatches to Triton / DeepGEMM / CUTLASS GPU
kernels). The test checks instead that SGLang's block_quant_dequant of the held parameters equals our
CPU engine's dequantization.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dapo_megatron (the trainer's side of the payloads)


def _stand_in_modules() -> None:
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = None
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


class _Group:
    """Stand-in for a parallel group of SGLang's runtime context (only its rank facts are read here)."""

    def __init__(self, rank: int, size: int):
        self.rank_in_group, self.world_size = rank, size
        self.is_first_rank, self.is_last_rank = True, True  # pipeline: one stage
        self.rank = rank
        self.cpu_group = self.device_group = None  # collectives run only in a forward, which never runs here


def _snapshot(model) -> tuple[dict, dict]:
    """(tensors to save, facts per parameter) of every quantized Linear, and per Linear the weight SGLang's
    own block_quant_dequant (fp8_utils.py) makes of the held parameters ("<module>.dequant", fp32)."""
    import torch
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    tensors, facts = {}, {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale_inv") and module.weight.dtype == torch.float8_e4m3fn:
            tensors[f"{name}.dequant"] = block_quant_dequant(
                module.weight.data, module.weight_scale_inv.data, module.quant_method.weight_block_size, torch.float32
            )
    for name, p in model.named_parameters():
        if not name.endswith((".weight", ".weight_scale_inv")) or ("proj" not in name):
            continue
        t = p.detach()
        tensors[name] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).contiguous().clone()
        facts[name] = {
            "id": id(p),
            "class": type(p).__name__,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "has_weight_loader": hasattr(p, "weight_loader"),
        }
    return tensors, facts


def build_rank(args, tp_rank: int):
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config, _initialize_model
    from sglang.srt.runtime_context import get_parallel

    groups = {
        n: _Group(
            tp_rank if n.startswith(("tp", "attn_tp")) else 0, args.tp_size if n.startswith(("tp", "attn_tp")) else 1
        )
        for n in ("pp_group", "tp_group", "attn_tp_group", "world_group")
    }
    get_parallel().override_permanently(tp_rank=tp_rank, attn_tp_rank=tp_rank, pp_rank=0, **groups)
    model_config = ModelConfig.from_server_args(args.server_args)
    load_config = LoadConfig(load_format="auto")
    quant_config = _get_quantization_config(model_config, load_config)
    model = _initialize_model(model_config, load_config, quant_config)
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(args.export).glob("*.safetensors"))
    DefaultModelLoader.load_weights_and_postprocess(model, safetensors_weights_iterator(files), torch.device("cpu"))
    from sglang.srt.layers.quantization import fp8 as fp8_module
    from sglang.srt.model_loader.utils import should_deepgemm_weight_requant_ue8m0

    method = model.model.layers[0].self_attn.qkv_proj.quant_method
    linear = getattr(method.w8a8_block_fp8_linear, "func", method.w8a8_block_fp8_linear)
    info = {
        "quantization": model_config.quantization,
        "quant_config": type(quant_config).__name__,
        "weight_block_size": getattr(quant_config, "weight_block_size", None),
        "linear_methods": sorted(
            {type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None) is not None}
        ),
        # which branch of process_weights_after_loading_block_quant ran: the NVIDIA one (not CPU-AMX,
        # not ROCm fnuz, no Marlin, no MXFP8), whose UE8M0 requant is off unless DeepGEMM scales are UE8M0
        "branch": {
            "cpu_amx": fp8_module._is_cpu,
            "fnuz": fp8_module._is_fp8_fnuz,
            "marlin": method.use_marlin,
            "mxfp8": method.use_mxfp8,
            "block_fp8_as_mxfp8": method.block_fp8_as_mxfp8,
            "block_quant": method.block_quant,
            "gemm": linear.__name__,
            "ue8m0_requant": should_deepgemm_weight_requant_ue8m0([128, 128]),
        },
    }
    return model, info


def build_manager(model, tp_rank: int, model_dir: str):
    """SGLang's WeightUpdater and SchedulerWeightUpdaterManager around the real model (as the oracle does
    around its recording model, sglang_oracle.build_rank)."""
    from types import MethodType, SimpleNamespace

    import torch.distributed as dist
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    runner = SimpleNamespace(tp_rank=tp_rank, model=model)
    runner.weight_updater = WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=SimpleNamespace(model_path=model_dir),
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: runner,
    )
    worker = SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
    worker.deserialize_own_rank = MethodType(TpModelWorker.deserialize_own_rank, worker)
    scheduler = SimpleNamespace(
        waiting_queue=[],
        chunked_req=None,
        hisparse_coordinator=None,
        _engine_paused=False,
        disaggregation_mode=None,
        collect_inflight_reqs=lambda: set(),
    )
    scheduler.record_weight_version_change = MethodType(Scheduler.record_weight_version_change, scheduler)
    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker,
        draft_worker=None,
        tp_cpu_group=dist.group.WORLD,
        memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
        flush_cache=lambda empty_cache=True: True,
        is_fully_idle=lambda **kw: True,
        scheduler=scheduler,
    )
    return runner, manager


def sync_distributed(manager, runner, named) -> dict:
    """Sync 1: begin / update_weights_from_distributed (flattened_bucket) / end, SGLang's code throughout;
    the broadcast is the stand-in copy of our bytes (module docstring)."""
    import torch
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromDistributedReqInput,
    )

    from dapo_megatron.transfer.tensor_payload import flatten_bucket

    flat = flatten_bucket(named)
    real_broadcast = dist.broadcast

    def broadcast_stand_in(tensor, src=0, group=None, async_op=False):
        assert tensor.dtype == torch.uint8 and tensor.numel() == flat.numel(), "SGLang's bucket differs from ours"
        tensor.copy_(flat)

    runner.weight_updater._model_update_group["fp8_sync"] = object()
    out = {"begin": manager.begin_weight_update(BeginWeightUpdateReqInput()).success}
    dist.broadcast = broadcast_stand_in
    try:
        req = UpdateWeightsFromDistributedReqInput(
            names=[n for n, _ in named],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
            shapes=[list(t.shape) for _, t in named],
            group_name="fp8_sync",
            load_format="flattened_bucket",
            flush_cache=False,
            weight_version="sync1",
        )
        result = manager.update_weights_from_distributed(req)
    finally:
        dist.broadcast = real_broadcast
    out.update(update=result.success, message=result.message)
    out["end"] = manager.end_weight_update(EndWeightUpdateReqInput()).success
    return out


def sync_tensor(manager, payload: list[str]) -> dict:
    """Sync 2: begin / update_weights_from_tensor (our payload, one entry per engine TP rank) / end."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    out = {"begin": manager.begin_weight_update(BeginWeightUpdateReqInput()).success}
    result = manager.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, load_format=None, flush_cache=False, weight_version="sync2"
        )
    )
    out.update(update=result.success, message=result.message)
    out["end"] = manager.end_weight_update(EndWeightUpdateReqInput()).success
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("sync1")
    ap.add_argument("sync2")
    ap.add_argument("out")
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args()

    from sglang_oracle import install_stubs

    install_stubs()
    _stand_in_modules()
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the flags sglang_launcher.sglang_command passes for rollout.quantization=fp8, parsed by SGLang
    args.server_args = prepare_server_args(
        [
            "--model-path",
            args.export,
            "--quantization",
            "fp8",
            "--tp-size",
            str(args.tp_size),
            "--context-length",
            "256",
            "--device",
            "cpu",
        ]
    )
    publish(args.server_args, role="test")
    # the scheduler's barriers run on its TP CPU group: a gloo world of one
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    syncs = [list(load_file(args.sync1).items()), list(load_file(args.sync2).items())]
    # the trainer's payloads, made before any engine-side code runs: deserialize_own_rank installs SGLang's
    # CUDA-IPC tensor reductions in this process (monkey_patch_torch_reductions), which the trainer's CPU
    # path never meets in its own process
    from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank

    payload = [serialize_for_engine_rank(syncs[1]) for _ in range(args.tp_size)]
    report = {}
    for tp_rank in range(args.tp_size):
        model, info = build_rank(args, tp_rank)
        runner, manager = build_manager(model, tp_rank, args.export)
        rank = {"info": info, "phases": {}}
        for phase, run in (
            ("start", None),
            ("sync1", functools.partial(sync_distributed, manager, runner, syncs[0])),
            ("sync2", functools.partial(sync_tensor, manager, payload)),
        ):
            result = run() if run else {}
            tensors, facts = _snapshot(model)
            save_file(tensors, str(out / f"rank{tp_rank}_{phase}.safetensors"))
            rank["phases"][phase] = {"result": result, "params": facts}
        report[str(tp_rank)] = rank
        del model, runner, manager
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
