"""Typed run configuration: nested dataclasses, YAML in, dotted overrides, validation.

    cfg = load_config("configs/runs/qwen2.5-7b_dapo.yaml", ["algorithm.eps_high=0.3", "actor.tp=4"])
    dapo-megatron config show configs/ablations/3_soft_overlong_punishment.yaml trainer.lr=2e-6

A YAML file may name `base: other.yaml` (relative to itself): the base is loaded first and this file's
keys are merged over it, so the ablation ladder is six small files that each add one technique.
Every user mistake raises ValueError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# the names registered in algo/registry.py (config sits below algo/; tests/unit/test_algo_objective.py
# checks that these lists and the registries agree)
PolicyLossName = Literal["dapo", "grpo", "gspo"]
AdvantageName = Literal["grpo", "drgrpo"]
# algorithm.rejection: the masks of algo/rollout_correction.py ("token" -> "token_reject", ...; "icepop")
RejectionLevel = Literal["token", "sequence", "geometric", "icepop"]


@dataclass
class ModelConfig:
    path: str = ""  # HF checkpoint directory (config.json + safetensors + tokenizer)
    arch: Literal["auto", "qwen2", "llama", "qwen3", "qwen3_moe"] = "auto"  # auto: read config.json's model_type


@dataclass
class SyntheticDataConfig:
    """Integer-answer arithmetic prompts in the DAPO-Math schema (used when data.train_path is empty)."""

    num_train: int = 2000
    num_eval: int = 200
    difficulty: int = 1
    seed: int = 1234
    style: Literal["dapo", "raw", "compact"] = "dapo"  # compact: "27+58=" prompts for the tiny model


@dataclass
class DataConfig:
    train_path: str = ""  # parquet / jsonl in the DAPO-Math-17K schema; "" = synthetic task
    eval_path: str = ""
    # several eval sets, name -> file (DAPO-Math schema), e.g. {aime24: ..., aime25: ..., math500: ...}: each
    # logged as eval/<name>/avg@k, ... (trainer/evaluation/report.py); {} = the one set of eval_path (or the
    # synthetic held-out split), logged as eval/avg@k. The first set picks the best checkpoint.
    eval_sets: dict[str, str] = field(default_factory=dict)
    dedup: bool = True  # the public DAPO-Math-17K file repeats every prompt ~100 times
    prompt_template: Literal["as-is", "dapo"] = "as-is"  # "dapo": wrap raw problems in the DAPO template
    # every row is checked before a run starts (file, row, column; prompt tokens vs rollout.max_prompt_length):
    # false = a bad row stops the launch, listing them; true = bad rows are left out and counted
    skip_bad_rows: bool = False
    shuffle: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def validate(self) -> None:
        """data.eval_sets: names that can sit in a metric name (eval/<name>/avg@k), one file each (whether
        each file exists and its rows are sound is checked where it is read: data/prompts.py load_prompts)."""
        _require(
            not (self.eval_sets and self.eval_path),
            "data.eval_path",
            self.eval_path,
            "empty when data.eval_sets is set (name the file as one of the sets instead)",
        )
        for name, path in self.eval_sets.items():
            _require(
                re.fullmatch(r"[A-Za-z0-9_.-]+", name) is not None,
                f"data.eval_sets.{name}",
                path,
                "set names are letters, digits, _ . - (they become metric names: eval/<name>/avg@k)",
            )
            _require(bool(path.strip()), f"data.eval_sets.{name}", path, "must name a prompt file (parquet or jsonl)")


@dataclass
class RolloutConfig:
    n: int = 16  # responses per prompt (the group size G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompt_length: int = 2048
    max_response_length: int = 20480  # L_max, the generation cap
    gen_batch_size: int = 1536  # prompts per generation round (3x train_batch_size in the recipe)
    in_order: bool = True  # dynamic sampling keeps groups in request order: reproducible batches
    engine: Literal["cpu", "sglang"] = "sglang"
    placement: Literal["colocated", "disaggregated"] = "colocated"
    # 0 = synchronous steps; k >= 1 = the engines generate the batches of the next k steps while the
    # trainer trains (disaggregated only; rollout/async_rollout.py): no sample older than k updates is trained on
    max_staleness: int = 0
    num_engines: int = 1
    engine_tp: int = 1
    engine_urls: list[str] = field(default_factory=list)  # fixed engines; else <run_dir>/engines/
    # keys of engines started with SGLang's --api-key / --admin-api-key (rollout.engine_urls only; the
    # engines a run starts get the run's own secret, rollout/auth.py): the NAME of an environment variable
    # holding the key, or a file (mode 0600) holding it; never the key itself in the YAML
    engine_api_key_env: str = ""
    engine_api_key_file: str = ""
    engine_admin_api_key_env: str = ""
    engine_admin_api_key_file: str = ""
    mem_fraction_static: float = 0.7
    weight_bucket_mb: int = 512
    # master address of the trainer<->engines weight group: "" = this host's address that the engines
    # reach (NCCL/GLOO_SOCKET_IFNAME's interface, else the route to them; loopback if all are local)
    weight_sync_address: str = ""
    # after every weight sync, read each tensor back from the engines (/get_weights_by_name) and fail
    # unless it equals the trainer's bit for bit: a debugging aid (slow: the whole model over HTTP)
    verify_weight_sync: bool = False
    request_timeout_s: float = 3600.0
    max_retries: int = 3
    # engine faults (docs/architecture.md, "Faults"): the local launcher restarts a CPU engine that
    # exits mid-run at most this many times in the run; with no engine left, the driver waits at most
    # engine_wait_s for one to register again (then re-syncs it and redoes the step's rollout) before
    # checkpointing the last completed step and stopping
    engine_restarts: int = 3
    engine_wait_s: float = 300.0
    # MoE: engines return each token's experts (SGLang's return_routed_experts; SGLang servers need
    # --enable-return-routed-experts). Needed by actor.routing_replay; alone it logs routing agreement.
    return_routed_experts: bool = False
    # none | fp8: the engines (cpu or sglang) load modelopt's 128x128 block-FP8 export of the base model and
    # every sync sends fp8 weights + block scales (dapo_megatron/quant, docs/fp8.md)
    quantization: str = "none"
    # CPU engines started by the local launcher run on these CPU cores only ([] = wherever the OS puts
    # them); with actor.cpu_cores this is disaggregation on one CPU machine: each side gets cores of its
    # own, as disaggregated SGLang engines get GPUs of their own (bench overlap --engine-cores)
    cpu_engine_cores: list[int] = field(default_factory=list)
    # where CPU engines hold their model: "cpu", or "cuda" (engine i on GPU i, its colocated slot): on a
    # one-GPU machine the colocated placement then runs for real (CUDA IPC weight payloads made by the
    # trainer and opened by the engine, release/resume of real device memory)
    cpu_engine_device: str = "cpu"

    def validate(self) -> None:
        """This section's own rules (what depends on another section: _validate_across_sections)."""
        _require(self.n >= 1, "rollout.n", self.n, "need at least 1 response per prompt")
        _require(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", self.top_k, "-1 (off) or >= 1")
        for key in ("max_prompt_length", "max_response_length", "gen_batch_size", "num_engines", "engine_tp"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), "must be >= 1")
        _require(0 < self.mem_fraction_static < 1, "rollout.mem_fraction_static", self.mem_fraction_static, "in (0, 1)")
        _require(self.weight_bucket_mb >= 1, "rollout.weight_bucket_mb", self.weight_bucket_mb, "must be >= 1")
        _require(self.request_timeout_s > 0, "rollout.request_timeout_s", self.request_timeout_s, "must be > 0")
        _require(self.max_retries >= 0, "rollout.max_retries", self.max_retries, "must be >= 0")
        _require(
            isinstance(self.engine_restarts, int) and self.engine_restarts >= 0,
            "rollout.engine_restarts",
            self.engine_restarts,
            "an integer >= 0 (restarts of exited CPU engines per run; 0 = none)",
        )
        _require(
            self.engine_wait_s >= 0,
            "rollout.engine_wait_s",
            self.engine_wait_s,
            "must be >= 0 (seconds to wait for an engine when none is left; 0 = stop at once)",
        )
        _require(self.max_staleness >= 0, "rollout.max_staleness", self.max_staleness, "0 (synchronous) or >= 1")
        _require(
            self.max_staleness == 0 or self.placement == "disaggregated",
            "rollout.max_staleness",
            self.max_staleness,
            f"0 with rollout.placement={self.placement!r}: colocated engines share the trainer's GPUs, so "
            "generation cannot overlap training (set rollout.placement=disaggregated)",
        )
        _require(self.quantization in ("none", "fp8"), "rollout.quantization", self.quantization, "one of: none, fp8")
        _require(
            self.cpu_engine_device in ("cpu", "cuda"),
            "rollout.cpu_engine_device",
            self.cpu_engine_device,
            "cpu or cuda (CPU engine i holds its model on GPU i)",
        )
        _require_core_list("rollout.cpu_engine_cores", self.cpu_engine_cores)
        for url in self.engine_urls:
            _require(url.startswith(("http://", "https://")), "rollout.engine_urls", url, "URLs start with http://")
        self._validate_engine_keys()

    def _validate_engine_keys(self) -> None:
        """Where the keys of user-started engines come from (read at start-up by rollout/auth.py)."""
        for kind in ("api_key", "admin_api_key"):
            env, path = getattr(self, f"engine_{kind}_env"), getattr(self, f"engine_{kind}_file")
            _require(
                not (env and path),
                f"rollout.engine_{kind}_env",
                env,
                f"set rollout.engine_{kind}_env or rollout.engine_{kind}_file, not both",
            )
            _require(
                not env or env.isidentifier(),
                f"rollout.engine_{kind}_env",
                env,
                "the NAME of an environment variable that holds the key (e.g. SGLANG_API_KEY), never the key itself",
            )
            _require(
                not (env or path) or bool(self.engine_urls),
                f"rollout.engine_{kind}_{'env' if env else 'file'}",
                env or path,
                "only with rollout.engine_urls: engines the run starts itself get the run's own secret "
                "(<run_dir>/secrets/engine_auth.yaml)",
            )


@dataclass
class AlgorithmConfig:
    # the objective (algo/): "dapo" clip-higher + dual clip, "grpo" naive GRPO's symmetric clip with the
    # sequence-level mean, "gspo" sequence-level ratio and clip (docs/algorithm.md 5)
    policy_loss: PolicyLossName = "dapo"
    advantage: AdvantageName = "grpo"  # "grpo" (R - mean) / std per group; "drgrpo" R - mean (Dr. GRPO)
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher
    clip_ratio_c: float | None = 10.0  # dual clip for A < 0; null disables it
    loss_agg_mode: LossAggMode = "token-mean"
    dynamic_sampling: bool = True
    max_num_gen_batches: int = 10  # 0 = unlimited
    on_gen_batches_exhausted: Literal["raise", "train"] = "raise"
    overlong_shaping: bool = True  # soft overlong punishment
    overlong_buffer_length: int = 4096  # L_cache
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = False  # mask the loss of truncated responses
    use_kl: bool = False
    kl_coef: float = 0.001
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    tis_cap: float | None = None  # truncated importance sampling vs engine log-probs; null = off
    # the other rollout corrections (algo/rollout_correction.py, docs/algorithm.md 11); null = off
    seq_is_cap: float | None = None  # truncated sequence-level weight min(prod_t pi_old / pi_rollout, cap)
    rejection: RejectionLevel | None = None  # mask tokens / responses whose ratio leaves [lower, upper]
    rejection_upper: float | None = None
    rejection_lower: float | None = None  # null: 1 / rejection_upper
    veto_threshold: float | None = None  # drop a response holding a token with pi_old / pi_rollout below it
    bypass_old_logprobs: bool = False  # pi_old := the engine's log-probs: the trainer's old-log-prob pass is skipped
    advantage_eps: float = 1e-6

    def validate(self) -> None:
        """This section's own rules, with what each policy_loss needs of them (algo/policy_loss.py, gspo.py)."""
        _require(0 <= self.eps_low < 1, "algorithm.eps_low", self.eps_low, "must be in [0, 1)")
        _require(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, "must be >= 0")
        _require(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            "algorithm.clip_ratio_c",
            self.clip_ratio_c,
            "null (off) or > 1 (it bounds -A * ratio for A < 0; 3.0 default, 10.0 in the 32B recipe)",
        )
        _require(
            self.max_num_gen_batches >= 0,
            "algorithm.max_num_gen_batches",
            self.max_num_gen_batches,
            "0 = unlimited, else >= 1",
        )
        for key in ("overlong_buffer_length", "overlong_penalty_factor", "kl_coef"):
            _require(getattr(self, key) >= 0, f"algorithm.{key}", getattr(self, key), "must be >= 0")
        _require(self.tis_cap is None or self.tis_cap >= 1, "algorithm.tis_cap", self.tis_cap, "null (off) or >= 1")
        _require(self.advantage_eps > 0, "algorithm.advantage_eps", self.advantage_eps, "must be > 0")
        self._validate_policy_loss()
        _validate_rollout_correction(self)

    def _validate_policy_loss(self) -> None:
        name = self.policy_loss
        if name == "grpo":
            _require(
                self.eps_high == self.eps_low,
                "algorithm.eps_high",
                self.eps_high,
                f"equal to algorithm.eps_low ({self.eps_low}) with algorithm.policy_loss=grpo: naive GRPO clips "
                "symmetrically (clip-higher is algorithm.policy_loss=dapo)",
            )
        if name in ("grpo", "gspo"):
            _require(
                self.loss_agg_mode == "seq-mean-token-mean",
                "algorithm.loss_agg_mode",
                self.loss_agg_mode,
                f"seq-mean-token-mean with algorithm.policy_loss={name}: its loss is a mean over sequences",
            )
        if name == "gspo":
            _require(
                self.clip_ratio_c is None,
                "algorithm.clip_ratio_c",
                self.clip_ratio_c,
                "null with algorithm.policy_loss=gspo (GSPO has no dual clip)",
            )
            _require(
                self.tis_cap is None,
                "algorithm.tis_cap",
                self.tis_cap,
                "null with algorithm.policy_loss=gspo (the truncated importance weight is per token; GSPO's "
                "ratio is per sequence)",
            )


def _validate_rollout_correction(a: AlgorithmConfig) -> None:
    """The rollout corrections' keys and the combinations that make sense (algo/rollout_correction.py)."""
    _require(a.seq_is_cap is None or a.seq_is_cap >= 1, "algorithm.seq_is_cap", a.seq_is_cap, "null (off) or >= 1")
    _require(
        a.seq_is_cap is None or a.tis_cap is None,
        "algorithm.seq_is_cap",
        a.seq_is_cap,
        f"null with algorithm.tis_cap={a.tis_cap}: one importance weight, token level (tis_cap) or sequence "
        "level (seq_is_cap)",
    )
    if a.rejection is None:
        for key in ("rejection_upper", "rejection_lower"):
            _require(getattr(a, key) is None, f"algorithm.{key}", getattr(a, key), "null without algorithm.rejection")
    else:
        upper, lower = a.rejection_upper, a.rejection_lower
        _require(
            upper is not None and upper > 1,
            "algorithm.rejection_upper",
            upper,
            f"a number > 1 with algorithm.rejection={a.rejection} (the ratio band [lower, upper] holds 1)",
        )
        _require(
            lower is None or 0 < lower < 1,
            "algorithm.rejection_lower",
            lower,
            "null (1 / rejection_upper) or in (0, 1)",
        )
    _require(
        a.rejection != "icepop" or (a.tis_cap is None and a.seq_is_cap is None),
        "algorithm.rejection",
        a.rejection,
        f"not icepop with algorithm.tis_cap={a.tis_cap} / seq_is_cap={a.seq_is_cap}: IcePop weights each token "
        "by its ratio itself (a second importance weight would count it twice)",
    )
    _require(
        a.policy_loss != "gspo" or a.rejection not in ("token", "icepop"),
        "algorithm.rejection",
        a.rejection,
        "sequence, geometric or null with algorithm.policy_loss=gspo (a token-level mask breaks GSPO's "
        "per-sequence ratio)",
    )
    _require(
        a.veto_threshold is None or 0 < a.veto_threshold < 1,
        "algorithm.veto_threshold",
        a.veto_threshold,
        "null (off) or in (0, 1), e.g. 1e-4: a token the trainer finds 10^4 times less likely than the engine",
    )
    _validate_bypass(a)


def _validate_bypass(a: AlgorithmConfig) -> None:
    """algorithm.bypass_old_logprobs: the masks then compare pi_theta (no gradient) with pi_rollout; a weight
    may not (docs/algorithm.md 11)."""
    if a.bypass_old_logprobs:
        weights = {
            "tis_cap": a.tis_cap,
            "seq_is_cap": a.seq_is_cap,
            "rejection": "icepop" if a.rejection == "icepop" else None,
        }
        for key, value in weights.items():
            _require(
                value is None,
                f"algorithm.{key}",
                value,
                "not an importance weight with algorithm.bypass_old_logprobs=true: the PPO ratio is then "
                "pi_theta / pi_rollout already, and a weight of the same ratio would count it twice (rejection "
                "token / sequence / geometric and the veto apply)",
            )


@dataclass
class ActorConfig:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per rank
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_tokens: int = 24576  # token budget of one packed micro-batch (>= one full sequence)
    attention_backend: Literal["torch", "te"] = "te"
    # torch backend only: "sdpa" = per-document causal SDPA (CPU and GPU), "flex" = FlexAttention with a
    # document BlockMask, "varlen" = torch's flash varlen_attn, one launch for every document (both CUDA only;
    # refused by the local launcher and at model build without CUDA). actor/attention.py
    attention_kernel: Literal["sdpa", "flex", "varlen"] = "sdpa"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    recompute: Literal["none", "selective", "full"] = "none"
    use_distributed_optimizer: bool = True
    # the distributed optimizer's checkpoint format (actor/checkpoint.py): "fully_reshardable" resumes under
    # any layout (every DP rank gathers its TP x PP shard's optimizer state at each save: measured 6x the save
    # time and host memory at 94M parameters, docs/benchmarks.md); "dp_reshardable" saves each DP rank's flat
    # shard as it is and resumes only under the same TP, PP, VPP and EP
    checkpoint_format: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    # Fused Triton kernels (dapo_kernels) for the LM-head log-prob/entropy and the policy loss; false =
    # plain torch. They need CUDA, or on CPU the Triton interpreter (TRITON_INTERPRET=1; tests, tiny
    # models): the Actor refuses to start when they cannot run rather than falling back silently.
    fused_logprob: bool = True
    fused_policy_loss: bool = True
    # How the train step's last stage turns hidden states into the loss: "separate" = the LM head's log-probs
    # (actor.fused_logprob) then the policy loss (actor.fused_policy_loss); "one_pass" = dapo_kernels'
    # linear_dapo_loss, the loss's gradient taken while the logits are on chip (three N x H x V GEMMs instead
    # of four; actor/head_loss.py). one_pass needs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on CPU)
    # and a per-token loss whose weights are known before the pass (one_pass_conflicts below)
    head_loss: Literal["separate", "one_pass"] = "separate"
    world_size: int = 1  # actor processes launched by `train` on one node (torchrun)
    # mixture-of-experts models (Qwen3-MoE)
    ep: int = 1  # expert parallel: each expert lives on one of ep ranks (carved out of the DP ranks)
    etp: int | None = None  # expert tensor parallel: each expert split over etp ranks; null = actor.tp
    routing_replay: bool = False  # R3: old log-probs and the loss use the engine's experts for every token
    # with rollout.quantization=fp8: every Linear the engines hold in FP8 runs its forward (old log-probs and
    # training) with the engines' block-FP8 values of its weights, straight-through gradient; master weights,
    # optimizer, checkpoints and the export unchanged (actor/fake_quant.py, docs/fp8.md)
    quantization_aware: bool = False
    # the local launcher runs the actor ranks on these CPU cores only ([] = anywhere); see
    # rollout.cpu_engine_cores
    cpu_cores: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """This section's own rules (what needs the model's config.json, such as num_experts % ep, is
        checked when the model is built: actor/moe.py check_expert_parallel)."""
        for key in ("tp", "pp", "cp", "world_size"):
            _require(getattr(self, key) >= 1, f"actor.{key}", getattr(self, key), "must be >= 1")
        _require(self.vpp is None or self.vpp >= 1, "actor.vpp", self.vpp, "null or >= 1")
        _require(self.vpp is None or self.pp > 1, "actor.vpp", self.vpp, "virtual pipeline stages need actor.pp > 1")
        _require(self.micro_batch_tokens >= 1, "actor.micro_batch_tokens", self.micro_batch_tokens, "must be >= 1")
        model_parallel = self.tp * self.pp * self.cp
        _require(
            self.world_size % model_parallel == 0,
            "actor.world_size",
            self.world_size,
            f"must be a multiple of tp*pp*cp = {model_parallel}",
        )
        _require(self.ep >= 1, "actor.ep", self.ep, "must be >= 1")
        _require(self.etp is None or self.etp >= 1, "actor.etp", self.etp, "null (= actor.tp) or >= 1")
        expert_parallel = self.expert_tp * self.ep * self.pp
        _require(
            self.world_size % expert_parallel == 0,
            "actor.world_size",
            self.world_size,
            f"must be a multiple of etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert_parallel} "
            "(actor.etp, actor.ep, actor.pp: every pipeline stage holds etp x ep expert shards)",
        )
        _require(
            not (self.routing_replay and self.recompute == "full" and self.pp > 1),
            "actor.routing_replay",
            self.routing_replay,
            "with actor.recompute=full needs actor.pp=1: the recomputed forward of a "
            "pipelined schedule would replay another micro-batch's experts",
        )
        _require(
            not self.quantization_aware or self.attention_backend == "torch",
            "actor.quantization_aware",
            self.quantization_aware,
            f"true only with actor.attention_backend=torch (it is "
            f"{self.attention_backend!r}): TE's fused LayerNorm + Linear hides the normalized input that the "
            "engines quantize to FP8 (docs/fp8.md)",
        )
        _require(
            self.attention_kernel != "varlen" or self.attention_backend == "torch",
            "actor.attention_kernel",
            self.attention_kernel,
            f"varlen only with actor.attention_backend=torch (it is {self.attention_backend!r}): te runs its own "
            "kernels",
        )
        _require_core_list("actor.cpu_cores", self.cpu_cores)

    @property
    def expert_tp(self) -> int:
        """The expert tensor parallel size: actor.etp, or actor.tp when it is null (megatron's default)."""
        return self.tp if self.etp is None else self.etp


LrDecayStyle = Literal["constant", "linear", "cosine"]  # the lr after warm-up (actor/optimizer.py)


@dataclass
class TrainerConfig:
    train_batch_size: int = 512  # prompts per step (each with rollout.n responses)
    mini_batch_size: int = 32  # prompts per gradient update
    lr: float = 1e-6
    warmup_steps: int = 10
    lr_decay_style: LrDecayStyle = "constant"  # after warm-up (the paper: constant)
    min_lr: float = 0.0  # lr at the last step with linear / cosine decay (a run within its warm-up never decays)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    total_steps: int = 400
    eval_every: int = 10  # 0 = never
    save_every: int = 10  # 0 = never
    eval_n: int = 32  # k of avg@k
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7
    seed: int = 42
    output_dir: str = "outputs/run"
    max_nonfinite_in_row: int = 3  # NaN/inf updates skipped before the run stops
    keep_checkpoints: int = 2
    # also keep the checkpoint of the best eval so far (checkpoints/best.json names it); needs a
    # checkpoint at every eval: trainer.save_every must divide trainer.eval_every (unless eval_every=0)
    keep_best_checkpoint: bool = False
    save_hf: bool = True  # also write each checkpoint as a HF model (checkpoints/step_N/hf) for eval / engines
    wandb_project: str = "dapo-megatron"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"

    def validate(self) -> None:
        _require(self.train_batch_size >= 1, "trainer.train_batch_size", self.train_batch_size, "must be >= 1")
        _require(self.mini_batch_size >= 1, "trainer.mini_batch_size", self.mini_batch_size, "must be >= 1")
        _require(
            self.train_batch_size % self.mini_batch_size == 0,
            "trainer.mini_batch_size",
            self.mini_batch_size,
            f"must divide trainer.train_batch_size ({self.train_batch_size})",
        )
        _require(self.lr > 0, "trainer.lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr <= self.lr, "trainer.min_lr", self.min_lr, f"must be in [0, trainer.lr = {self.lr}]")
        for key in ("warmup_steps", "total_steps", "eval_every", "save_every", "keep_checkpoints", "weight_decay"):
            _require(getattr(self, key) >= 0, f"trainer.{key}", getattr(self, key), "must be >= 0")
        _require(self.grad_clip >= 0, "trainer.grad_clip", self.grad_clip, "must be >= 0 (0 = off)")
        for key in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, key) < 1, f"trainer.{key}", getattr(self, key), "must be in [0, 1)")
        _require(self.eval_n >= 1, "trainer.eval_n", self.eval_n, "must be >= 1")
        _require(self.eval_temperature > 0, "trainer.eval_temperature", self.eval_temperature, "must be > 0")
        _require(0 < self.eval_top_p <= 1, "trainer.eval_top_p", self.eval_top_p, "must be in (0, 1]")
        # (with trainer.eval_every=0 there is no eval, hence no best, and the option does nothing)
        every, save = self.eval_every, self.save_every
        _require(
            not self.keep_best_checkpoint or every == 0 or (save > 0 and every % save == 0),
            "trainer.keep_best_checkpoint",
            self.keep_best_checkpoint,
            f"needs a checkpoint at every eval: trainer.save_every ({save}) must divide trainer.eval_every ({every})",
        )
        _require(
            self.max_nonfinite_in_row >= 1, "trainer.max_nonfinite_in_row", self.max_nonfinite_in_row, "must be >= 1"
        )
        _require(bool(self.output_dir), "trainer.output_dir", self.output_dir, "must be a directory path")


@dataclass
class SlurmConfig:
    partition: str = ""
    account: str = ""
    qos: str = ""
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 96
    mem: str = "0"
    time: str = "48:00:00"
    constraint: str = ""
    signal_seconds: int = 600  # SIGUSR1 this long before the time limit: checkpoint, then requeue
    array_throttle: int = 2  # %K of sweep / eval arrays
    # shell lines every job runs first (module load, venv activation); they choose the interpreter:
    # jobs run `python` from the PATH these lines leave, unless `python` below names another
    setup: list[str] = field(default_factory=list)
    extra_sbatch: list[str] = field(default_factory=list)  # more `#SBATCH` options, e.g. "--exclusive"
    # interpreter on the compute nodes; "" = `python` after slurm.setup, or (no setup lines) the
    # interpreter running `slurm submit`
    python: str = ""
    # the rollout engines' own environment (SGLang pins its torch; the trainer needs Megatron and
    # Transformer Engine): interpreter and shell lines of the engine array; "" / [] = python / setup above
    engine_python: str = ""
    engine_setup: list[str] = field(default_factory=list)
    # pyxis (enroot) containers, per role: each job step runs as `srun --container-image=IMAGE
    # --container-mounts=MOUNTS ...` ("" = no container). engine_* for the engine array ("" = the trainer's)
    container_image: str = ""
    container_mounts: str = ""  # src:dst[:flags],... as pyxis takes them
    engine_container_image: str = ""
    engine_container_mounts: str = ""
    gpu_memory_gb: float = (
        80.0  # memory of one GPU in GiB (H100 80GB); `dapo-megatron plan` checks every phase against it
    )
    # host memory of one node in GiB (2 TiB on a DGX H100): `plan` checks a checkpoint save against it (every
    # actor rank of a node gathers its position's optimizer state at once: memplan/checkpoint_cost.py)
    host_memory_gb: float = 2048.0
    # link bandwidths `dapo-megatron plan` predicts the weight sync's seconds from (memplan/sync_time.py):
    # one sender's NIC to the engines (400: one NDR InfiniBand NIC per GPU) and the NVLink all-gather bus
    # bandwidth per GPU (2880 = 360 GB/s on 8 x H100 SXM); `plan --links preflight.json` uses measured ones
    network_gbps: float = 400.0
    intra_node_gbps: float = 2880.0

    def validate(self) -> None:
        _require(self.nodes >= 1, "slurm.nodes", self.nodes, "must be >= 1")
        _require(self.gpus_per_node >= 0, "slurm.gpus_per_node", self.gpus_per_node, "must be >= 0")
        _require(self.signal_seconds >= 0, "slurm.signal_seconds", self.signal_seconds, "must be >= 0")
        _require(self.array_throttle >= 1, "slurm.array_throttle", self.array_throttle, "must be >= 1")
        _require(
            self.gpu_memory_gb > 0,
            "slurm.gpu_memory_gb",
            self.gpu_memory_gb,
            "GiB of one GPU, > 0 (80 for an H100 80GB)",
        )
        _require(
            self.host_memory_gb > 0, "slurm.host_memory_gb", self.host_memory_gb, "GiB of one node's host memory, > 0"
        )
        _require(self.network_gbps > 0, "slurm.network_gbps", self.network_gbps, "Gbit/s of one sender's link, > 0")
        _require(
            self.intra_node_gbps > 0, "slurm.intra_node_gbps", self.intra_node_gbps, "Gbit/s of NVLink per GPU, > 0"
        )
        # `#SBATCH` lines are parsed by sbatch, not a shell, but a newline or a space would end the option and
        # start a script line: only the characters Slurm's own syntax uses are allowed.
        for key, pattern, allowed in _SLURM_SYNTAX:
            val = getattr(self, key)
            _require(val == "" or re.fullmatch(pattern, val) is not None, f"slurm.{key}", val, allowed)
        for i, opt in enumerate(self.extra_sbatch):
            _require(
                opt.startswith("-") and not any(c in opt for c in "\n\r\0"),
                f"slurm.extra_sbatch[{i}]",
                opt,
                "one sbatch option per item, starting with '-' and without line breaks",
            )
        for key in ("setup", "engine_setup"):
            for i, line in enumerate(getattr(self, key)):
                _require(not any(c in line for c in "\n\r\0"), f"slurm.{key}[{i}]", line, "one shell line per item")
        for key in _SLURM_ONE_LINE:
            val = getattr(self, key)
            _require(
                not any(c in val for c in "\n\r\0") and val == val.strip(),
                f"slurm.{key}",
                val,
                "one value without line breaks or surrounding spaces",
            )
        _require(
            not (self.container_mounts and not self.container_image),
            "slurm.container_mounts",
            self.container_mounts,
            "needs slurm.container_image (pyxis mounts into a container)",
        )
        _require(
            not (self.engine_container_mounts and not (self.engine_container_image or self.container_image)),
            "slurm.engine_container_mounts",
            self.engine_container_mounts,
            "needs slurm.engine_container_image or slurm.container_image",
        )


@dataclass
class TinyConfig:
    """The embedded default's model (dapo_megatron.data.tiny_model): with `enabled`, a tiny Qwen2 and its tokenizer
    are built and warm-started under <trainer.output_dir>/tiny_model/ and used instead of model.path."""

    enabled: bool = False
    arch: Literal["qwen2", "qwen3_moe"] = "qwen2"  # qwen3_moe: the tiny mixture-of-experts variant
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    num_experts: int = 4  # qwen3_moe only: experts per layer (every layer sparse), top-k, expert width
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    warm_start_steps: int = 1000  # supervised AdamW steps on the train prompts' "Answer: N"
    warm_start_batch_size: int = 64
    warm_start_lr: float = 3e-3
    label_smoothing: float = 0.1  # sets the warm start's accuracy: ~(1 - eps)^response_tokens
    cache_dir: str = ""  # where tiny_model/ is built and reused; "" = trainer.output_dir
    # true: use the model cached under cache_dir or stop with an error, never build or warm-start it (the GPU
    # check carries the model built on the CPU machine: tests/gpu/prepare.sh)
    require_cached: bool = False

    def validate(self) -> None:
        """This section's own rules when enabled (how the tiny model fits actor.tp / ep and data.train_path:
        _validate_across_sections)."""
        if not self.enabled:
            return
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "warm_start_batch_size",
        ):
            _require(getattr(self, key) >= 1, f"tiny.{key}", getattr(self, key), "must be >= 1")
        _require(
            self.hidden_size % self.num_heads == 0,
            "tiny.hidden_size",
            self.hidden_size,
            f"must be a multiple of tiny.num_heads ({self.num_heads})",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "tiny.num_heads",
            self.num_heads,
            f"must be a multiple of tiny.num_kv_heads ({self.num_kv_heads})",
        )
        if self.arch == "qwen3_moe":
            _require(
                1 <= self.num_experts_per_tok <= self.num_experts,
                "tiny.num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be in [1, tiny.num_experts={self.num_experts}]",
            )
        _require(self.warm_start_steps >= 0, "tiny.warm_start_steps", self.warm_start_steps, "must be >= 0")
        _require(self.warm_start_lr > 0, "tiny.warm_start_lr", self.warm_start_lr, "must be > 0")
        _require(0 <= self.label_smoothing < 1, "tiny.label_smoothing", self.label_smoothing, "must be in [0, 1)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)

    def to_dict(self) -> RawJson:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Loading

# Parsed YAML or JSON whose shape is not fixed by a schema here: a config file before _build checks it
# against the dataclasses, a run's config.yaml as wandb and the run directory keep it, a results file of
# whatever a bench wrote. Records whose schema the project fixes get their own TypedDict instead.
RawJson: TypeAlias = dict[str, Any]
_Section = TypeVar("_Section", bound="DataclassInstance")


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """YAML file (with `base:` chains) + dotted `key=value` overrides -> validated Config."""
    raw: RawJson = _load_yaml_chain(Path(path), seen=()) if path else {}
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, prefix="")
    _derive(cfg)
    validate(cfg)
    return cfg


def config_from_dict(raw: RawJson) -> Config:
    cfg = _build(Config, raw, prefix="")
    _derive(cfg)
    validate(cfg)
    return cfg


def _derive(cfg: Config) -> None:
    """Settings that follow from others, as Megatron-LM derives them (with a warning, never silently)."""
    if cfg.actor.sequence_parallel and cfg.actor.tp == 1:
        # megatron/training/arguments.py: "disable sequence parallelism when tp=1" (it splits over TP ranks),
        # so `actor.tp=1` on a preset with sequence parallelism works as a one-key override
        # stacklevel=1: the cause is a config key, not a line of the caller's code
        warnings.warn("actor.sequence_parallel=true has no effect at actor.tp=1: turned off", stacklevel=1)
        cfg.actor.sequence_parallel = False


def _load_yaml_chain(path: Path, seen: tuple[Path, ...]) -> RawJson:
    path = path.resolve()
    if path in seen:
        raise ValueError(f"config {path}: `base:` chain loops back to itself")
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config {path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not (path.parent / str(base)).resolve().is_file():  # the file that names it is the one to fix
        raise ValueError(
            f"config {path}: `base: {base}` names {(path.parent / str(base)).resolve()}, which does not exist "
            "(a base is relative to the file that names it)"
        )
    merged = _load_yaml_chain(path.parent / str(base), seen + (path,))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: RawJson, src: RawJson) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


def _apply_override(raw: RawJson, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override '{item}': expected key=value, e.g. algorithm.eps_high=0.28")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override '{item}': '{part}' is a value, not a section")
    node[parts[-1]] = value


def _build(cls: type[_Section], raw: object, prefix: str) -> _Section:
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ValueError(f"config key '{where}': expected a section (mapping), got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{prefix}{key}'{hint} (allowed in {where}: {', '.join(fields)})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp: object, value: object, key: str) -> object:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a section's class (hints hold classes)
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ValueError(f"config key '{key}': {value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if origin is dict:
        key_tp, item_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}': expected a mapping of name: {item_tp.__name__}, got {value!r}")
        return {_coerce(key_tp, k, f"{key} (a name)"): _coerce(item_tp, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"config key '{key}': expected a list of {item_tp.__name__}, got {value!r}")
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key '{key}': expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` (no dot) as a string, not a float
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key '{key}': expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"config key '{key}': expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {tp} for {key}")


# --------------------------------------------------------------------------------------------
# Validation: values that type-check but cannot work. Each section checks its own keys (its validate()
# beside its fields); the rules that tie two sections together are _validate_across_sections'.


def _require(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}': {value!r} is not allowed; {allowed}")


def _require_core_list(key: str, cores: list[int]) -> None:
    _require(
        all(c >= 0 for c in cores) and len(set(cores)) == len(cores),
        key,
        cores,
        "distinct CPU core numbers >= 0 ([] = no pinning)",
    )


def validate(cfg: Config) -> None:
    for section in (cfg.rollout, cfg.algorithm, cfg.actor, cfg.trainer, cfg.tiny, cfg.data, cfg.slurm):
        section.validate()
    _validate_across_sections(cfg)


def _validate_bypass_across(r: RolloutConfig, a: AlgorithmConfig, ac: ActorConfig) -> None:
    """What algorithm.bypass_old_logprobs needs of the rollout and actor sections."""
    _require(
        r.max_staleness == 0 or not a.bypass_old_logprobs,
        "algorithm.bypass_old_logprobs",
        a.bypass_old_logprobs,
        f"false with rollout.max_staleness={r.max_staleness}: the decoupled objective of overlapped steps "
        "needs pi_prox, the trainer's log-probs under its current weights, which the bypass skips",
    )
    _require(
        ac.cp == 1 or not a.bypass_old_logprobs or (a.rejection in (None, "token") and a.veto_threshold is None),
        "actor.cp",
        ac.cp,
        "1 with algorithm.bypass_old_logprobs=true and a sequence-level rejection or the veto: they read the "
        "ratio pi_theta / pi_rollout of a whole response in the loss, where context parallelism splits it",
    )


def _validate_across_sections(cfg: Config) -> None:
    """The rules that tie one section's keys to another's."""
    r, a, ac, tn = cfg.rollout, cfg.algorithm, cfg.actor, cfg.tiny
    _validate_bypass_across(r, a, ac)
    _require(
        r.max_staleness == 0 or a.tis_cap is not None,
        "rollout.max_staleness",
        r.max_staleness,
        "0 unless algorithm.tis_cap is set: off-policy samples need the truncated behaviour-policy weight "
        "(docs/architecture.md, 'Overlapped steps')",
    )
    _require(
        not ac.quantization_aware or r.quantization == "fp8",
        "actor.quantization_aware",
        ac.quantization_aware,
        f"true only with rollout.quantization=fp8 (it is {r.quantization!r}): the "
        "trainer's forward reproduces the FP8 engines' weights, and these engines hold none",
    )
    _require(
        not a.dynamic_sampling or r.n >= 2,
        "rollout.n",
        r.n,
        "dynamic sampling needs n >= 2 (a group of one is always all-correct or all-wrong)",
    )
    _require(
        not a.overlong_shaping or a.overlong_buffer_length < r.max_response_length,
        "algorithm.overlong_buffer_length",
        a.overlong_buffer_length,
        f"must be < rollout.max_response_length ({r.max_response_length})",
    )
    for why in one_pass_conflicts(a) if ac.head_loss == "one_pass" else []:
        _require(False, "actor.head_loss", ac.head_loss, f"'separate' with {why}")
    if a.policy_loss == "gspo":
        _require(ac.cp == 1, "actor.cp", ac.cp, _GSPO_NEEDS["actor.cp"])
        _require(not ac.fused_policy_loss, "actor.fused_policy_loss", ac.fused_policy_loss, _GSPO_NEEDS["fused"])
    _require_sequence_fits(r, ac)
    _require(
        not ac.routing_replay or r.return_routed_experts,
        "actor.routing_replay",
        ac.routing_replay,
        "needs rollout.return_routed_experts=true (the engines must say which experts they used)",
    )
    if tn.enabled:
        # model.path may be set: `train` builds the tiny model, then hands its directory to the actor
        # ranks as model.path (with tiny.enabled still true)
        _require(not cfg.data.train_path, "data.train_path", cfg.data.train_path, _TINY_NEEDS["train_path"])
        _require(tn.num_kv_heads % ac.tp == 0, "tiny.num_kv_heads", tn.num_kv_heads, _TINY_NEEDS["kv"].format(ac.tp))
    if tn.enabled and tn.arch == "qwen3_moe":
        experts, width = tn.num_experts, tn.moe_intermediate_size
        _require(experts >= 1 and experts % ac.ep == 0, "tiny.num_experts", experts, _TINY_NEEDS["ep"].format(ac.ep))
        _require(
            width >= 1 and width % ac.expert_tp == 0,
            "tiny.moe_intermediate_size",
            width,
            _TINY_NEEDS["etp"].format(ac.expert_tp),
        )


def _require_sequence_fits(r: RolloutConfig, ac: ActorConfig) -> None:
    """Context parallelism runs on both attention backends (te: TE's kernels; torch: K/V all-gather,
    actor/context_parallel.py). What it does constrain is lengths: every sequence is padded to a
    multiple of 2*cp tokens (the load-balanced split), so the budget must hold a padded one."""
    longest = r.max_prompt_length + r.max_response_length
    seq_multiple = 2 * ac.cp if ac.cp > 1 else 1
    longest_padded = -(-longest // seq_multiple) * seq_multiple
    _require(
        ac.micro_batch_tokens >= longest_padded,
        "actor.micro_batch_tokens",
        ac.micro_batch_tokens,
        f"must hold one full sequence: >= rollout.max_prompt_length + "
        f"rollout.max_response_length ({longest})"
        + (f", padded to a multiple of 2*actor.cp = {seq_multiple} ({longest_padded})" if ac.cp > 1 else ""),
    )


def one_pass_conflicts(a: AlgorithmConfig) -> list[str]:
    """Why actor.head_loss=one_pass cannot compute this objective ([]: it can). The one-pass op
    (kernels/head_loss.py) takes dL/dlogp_t of sum_t w_t l_t / D inside its forward, so l_t must be dapo's
    per-token clipped term and w_t (aggregation weight x rollout correction) known before the pass; an
    explicit one_pass that cannot run is refused here rather than silently run as separate."""
    why = []
    if a.policy_loss == "gspo":
        why.append("algorithm.policy_loss=gspo (its ratio is a whole sequence's: not a per-token loss)")
    if a.use_kl:
        why.append("algorithm.use_kl=true (the KL term's gradient is not the op's; the op takes the policy loss only)")
    correction = (a.tis_cap, a.seq_is_cap, a.rejection, a.veto_threshold)
    if a.bypass_old_logprobs and any(x is not None for x in correction):
        why.append(
            "algorithm.bypass_old_logprobs=true and a rollout correction (its factor then reads the current "
            "policy's log-probs, which are not known before the pass)"
        )
    return why


_GSPO_NEEDS = {  # what algorithm.policy_loss=gspo needs of the actor
    "actor.cp": "1 with algorithm.policy_loss=gspo (its ratio averages a sequence's tokens, which context "
    "parallelism splits over ranks)",
    "fused": "false with algorithm.policy_loss=gspo (the fused kernel computes the token-level losses dapo and grpo)",
}
_TINY_NEEDS = {  # what tiny.enabled needs of the other sections
    "train_path": "leave it empty with tiny.enabled=true (the tiny model warm-starts on the synthetic task)",
    "kv": "must be a multiple of actor.tp ({}): tensor parallelism splits the KV heads",
    "ep": "must be a positive multiple of actor.ep ({})",
    "etp": "must be a positive multiple of the expert tensor parallel size ({})",
}
_SLURM_ONE_LINE = (
    "python",
    "engine_python",
    "container_image",
    "container_mounts",
    "engine_container_image",
    "engine_container_mounts",
)


_SLURM_SYNTAX = (  # (key, regex, message)
    ("partition", r"[A-Za-z0-9_.,+-]+", "a partition name (letters, digits, _ . , + -)"),
    ("account", r"[A-Za-z0-9_.@+-]+", "an account name (letters, digits, _ . @ + -)"),
    ("qos", r"[A-Za-z0-9_.+-]+", "a QOS name (letters, digits, _ . + -)"),
    ("constraint", r"[A-Za-z0-9_.,&|*\[\]()!:+-]+", "a Slurm constraint expression, e.g. h100&ib (no spaces)"),
    ("mem", r"[0-9]+[KMGT]?", "a size like 0 (all), 500G or 64000M"),
    # a colon or a dash is required: YAML 1.1 reads an unquoted 48:00:00 as the number 172800, which
    # Slurm would take as minutes
    (
        "time",
        r"[0-9]+-[0-9]+(:[0-9]+){0,2}|[0-9]+(:[0-9]+){1,2}|UNLIMITED|INFINITE",
        'a Slurm time like "48:00:00" or "2-00:00:00" (quote it in YAML: unquoted 48:00:00 reads as a number)',
    ),
)


# --------------------------------------------------------------------------------------------
# `dapo-megatron config show FILE [overrides]`


def main(argv: list[str]) -> int:
    """`dapo-megatron config show CONFIG.yaml [section.key=value ...]`: the resolved config as YAML."""
    import argparse

    parser = argparse.ArgumentParser(prog="dapo-megatron config", description="the resolved config of a run")
    sub = parser.add_subparsers(dest="action", required=True, metavar="show")
    show = sub.add_parser("show", help="print the resolved config as YAML (base: files, overrides, defaults)")
    show.add_argument("config", help="CONFIG.yaml")
    show.add_argument("overrides", nargs="*", help="section.key=value")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help: 0; a usage mistake: 2, argparse has said what
        return int(done.code or 0)
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0
