"""Routed experts: which experts every token of a sequence went through in the engine (MoE models),
in SGLang's wire format, and the CPU engine's recorder.

SGLang 0.5.21 (read from its source):
  request   GenerateReqInput.return_routed_experts: bool, routed_experts_start_len: int
            (srt/managers/io_struct.py: "response covers [routed_experts_start_len, seqlen - 1)";
            the server needs --enable-return-routed-experts, srt/arg_groups/fields/exec_.py)
  reply     meta_info["routed_experts"] = base64 of an int32 array [rows, num_hidden_layers, topk]
            in C order (srt/managers/detokenizer_manager.py _b64_encode_per_request,
            tokenizer_manager.py; decoded with np.frombuffer(..., int32) in
            srt/state_capturer/routed_experts.py extract_routed_experts_from_meta_info)
  rows      seqlen = prompt + output tokens; rows are positions start_len .. seqlen - 2: every token
            the model processed (the last generated token is sampled, never fed back)
            (srt/managers/scheduler_components/batch_result_processor.py, state_capturer/base.py
            get_topk); layers without a router keep the zeros their capture buffer starts with.
  ids       logical expert ids: captured before EPLB's logical-to-physical remap
            (srt/layers/moe/topk.py _post_process_topk_ids), i.e. the checkpoint's expert numbers.

Row t holds the experts position t's hidden state was sent to in each layer, so the trainer can
replay them for the forward pass that produces the log-prob of token t + 1 (R3, "rollout routing
replay": slime's --use-rollout-routing-replay, verl's router_replay mode R3, arXiv 2510.11370).

The CPU engine (cpu_engine.py) records the same array from transformers' routers: a forward hook on
every `model.layers.{i}.mlp.gate` (Qwen3MoeTopKRouter, whose forward returns (logits, weights,
indices) with indices [tokens, top_k]) keeps the indices of each forward of a decode loop; the
first forward is the left-padded prefill, every later one feeds each row's previous token.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Protocol

import numpy as np
import torch

_ROUTER_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.gate")


def sglang_routing_args(*, return_routed_experts: bool) -> list[str]:
    """SGLang server flags for routed experts: its capturer exists only when the server starts with
    --enable-return-routed-experts (srt/state_capturer/routed_experts.py RoutedExpertsCapturer.create);
    without it a request's return_routed_experts is silently answered without the field."""
    return ["--enable-return-routed-experts"] if return_routed_experts else []


def encode_routed_experts(rows_LK: torch.Tensor) -> str:
    """[rows, layers, topk] -> SGLang's base64 of int32 (C order)."""
    return base64.b64encode(rows_LK.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, *, num_rows: int, where: str) -> torch.Tensor:
    """SGLang's base64 int32 -> a compact [num_rows, layers * topk] tensor (uint8 when every id fits,
    else int16: a 20K-token response of a 48-layer top-8 model holds 7.7 MB as uint8).

    num_rows = prompt + output tokens - 1 (minus routed_experts_start_len when one was asked).
    ValueError naming `where` (the request) when the size does not fit that many rows."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if num_rows <= 0 or flat.size % num_rows:
        raise ValueError(
            f"{where}: meta_info.routed_experts holds {flat.size} ids, not a whole number of "
            f"rows for {num_rows} tokens (prompt + output - 1)"
        )
    values = torch.from_numpy(flat.copy()).view(num_rows, -1)
    if values.numel() and (values.min() < 0 or values.max() > 32767):
        raise ValueError(f"{where}: meta_info.routed_experts holds expert ids outside [0, 32767]")
    dtype = torch.uint8 if values.numel() == 0 or values.max() < 256 else torch.int16
    return values.to(dtype)


def routed_experts_of(output: dict, *, where: str) -> torch.Tensor | None:
    """The decoded meta_info.routed_experts of one /generate output (with its `prompt_ids` added by
    the sampler), or None when the engine sent none (not asked, or a dense model)."""
    encoded = output["meta_info"].get("routed_experts")
    if encoded is None:
        return None
    num_rows = len(output["prompt_ids"]) + len(output["output_ids"]) - 1
    return decode_routed_experts(encoded, num_rows=num_rows, where=where)


class RoutedSequence(Protocol):
    """What take() reads and writes of a sequence (the CPU engine's cpu_engine/protocol.SequenceRequest)."""

    prompt_ids: list[int]
    output_ids: list[int]
    return_routed_experts: bool
    routed_experts_start_len: int
    routed_experts: torch.Tensor | None


class RoutedExpertsRecorder:
    """Hooks on a transformers MoE model that collect, for each forward of a decode loop, the top-k
    expert indices of every token in every sparse layer. A dense model gets no hooks (`enabled` is
    False). Usage (cpu_engine.py): start() before the loop, finish() after it."""

    def __init__(self, model: Any) -> None:  # a transformers causal LM (untyped foreign API)
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.topk = int(getattr(config, "num_experts_per_tok", 0) or 0)
        routers = {
            int(m.group(1)): module
            for name, module in model.named_modules()
            if (m := _ROUTER_NAME.fullmatch(name)) and hasattr(module, "top_k")
        }
        self.enabled = bool(routers) and self.topk > 0
        self._calls: list[dict[int, torch.Tensor]] | None = None  # per forward: layer -> [B, S, k]
        self._batch = 0
        if not self.enabled:
            return
        model.register_forward_pre_hook(self._new_forward)
        for layer, module in routers.items():
            module.register_forward_hook(self._recorder(layer))
        self.layers = sorted(routers)

    def _new_forward(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        if self._calls is not None:
            self._calls.append({})

    def _recorder(self, layer: int):
        def record(module: torch.nn.Module, args: tuple[object, ...], output: tuple[torch.Tensor, ...]) -> None:
            if self._calls is not None:
                indices = output[2]  # Qwen3MoeTopKRouter: (router_logits, router_scores, router_indices)
                self._calls[-1][layer] = indices.reshape(self._batch, -1, indices.shape[-1]).to(torch.int16)

        return record

    def start(self, *, active: bool, batch_size: int) -> None:
        """Record the forwards that follow when `active` (some sequence asked) and the model has experts.
        Called again before a prefill that recomputes every row (continue after a retract pause): the
        recomputed prefill covers every earlier position, with the weights of then."""
        self._calls = [] if active and self.enabled else None
        self._batch = batch_size

    def stop(self) -> None:
        self._calls = None

    def take(self, seq: RoutedSequence, *, row: int, prefill_length: int, width: int) -> None:
        """Give `seq` (row `row` of the batch, which asked for them) its `routed_experts` [rows, layers,
        topk] int16, rows = P + n - 1 - start (P its prompt, n its output tokens so far: SGLang's
        seqlen - 1 - start_len). prefill_length: the row's tokens in the last prefill (left padded to
        `width`); every later forward fed it one token. Called as the sequence finishes, before its
        reply leaves."""
        calls = self._calls
        if not calls or not getattr(seq, "return_routed_experts", False):
            return
        total = len(seq.prompt_ids) + len(seq.output_ids) - 1
        rows = torch.zeros(max(total, 0), self.num_layers, self.topk, dtype=torch.int16)
        for layer in self.layers:
            prefill = calls[0][layer][row, width - prefill_length :]  # left padding: the prompt ends the row
            fed_back = [call[layer][row] for call in calls[1:]]  # one token per decode step
            rows[:, layer] = torch.cat([prefill, *fed_back])[:total]
        start = min(int(getattr(seq, "routed_experts_start_len", 0)), max(total, 0))
        seq.routed_experts = rows[start:]
