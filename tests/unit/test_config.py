"""Config loading: every kind of mistake raises ValueError naming key and value; every preset validates;
the ablation ladder adds exactly one technique per rung and ends at the 32B DAPO recipe."""

from pathlib import Path

import pytest

from dapo_megatron import config as config_module
from dapo_megatron.config import Config, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DAPO_32B = CONFIGS / "runs" / "qwen2.5-32b_dapo.yaml"
PRESETS = sorted(CONFIGS.rglob("*.yaml"))


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _diff(a: Config, b: Config) -> set[str]:
    fa, fb = _flat(a.to_dict()), _flat(b.to_dict())
    return {k for k in fa if fa[k] != fb[k]}


def _error(overrides, path=DAPO_32B):
    with pytest.raises(ValueError) as err:
        load_config(path, overrides)
    return str(err.value)


def test_there_are_presets():
    names = {p.relative_to(CONFIGS).as_posix() for p in PRESETS}
    assert {
        "runs/qwen2.5-32b_dapo.yaml",
        "runs/qwen2.5-7b_dapo.yaml",
        "ablations/0_naive_grpo.yaml",
        "ablations/5_dynamic_sampling.yaml",
    } <= names


@pytest.mark.parametrize("path", PRESETS, ids=[p.relative_to(CONFIGS).as_posix() for p in PRESETS])
def test_every_preset_loads_and_validates(path):
    cfg = load_config(path)
    config_module.validate(cfg)
    assert isinstance(cfg, Config)


def test_32b_preset_holds_the_paper_hyper_parameters():
    cfg = load_config(DAPO_32B)
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    assert (a.eps_low, a.eps_high, a.clip_ratio_c, a.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.dynamic_sampling, a.max_num_gen_batches, a.overlong_shaping, a.overlong_buffer_length) == (
        True,
        10,
        True,
        4096,
    )
    assert (a.overlong_penalty_factor, a.use_kl) == (1.0, False)
    assert (r.n, r.temperature, r.top_p, r.max_prompt_length, r.max_response_length, r.gen_batch_size) == (
        16,
        1.0,
        1.0,
        2048,
        20480,
        1536,
    )
    assert (t.train_batch_size, t.mini_batch_size, t.lr, t.warmup_steps, t.weight_decay, t.grad_clip) == (
        512,
        32,
        1e-6,
        10,
        0.1,
        1.0,
    )
    assert (t.eval_n, t.eval_temperature, t.eval_top_p) == (32, 1.0, 0.7)


def test_defaults_validate():
    # the default dataclass values form a valid config (micro_batch_tokens must hold one full sequence)
    config_from_dict({})
    load_config(None)


# ---- the ablation ladder (paper Table 1) ----

RUNGS = [
    "0_naive_grpo.yaml",
    "1_overlong_filtering.yaml",
    "2_clip_higher.yaml",
    "3_soft_overlong_punishment.yaml",
    "4_token_level_loss.yaml",
    "5_dynamic_sampling.yaml",
]
# what each rung changes relative to the previous one (besides trainer.output_dir)
RUNG_ADDS = {
    1: {"algorithm.overlong_filter": True},
    2: {"algorithm.eps_high": 0.28, "algorithm.policy_loss": "dapo"},  # clip-higher: DAPO's loss
    3: {"algorithm.overlong_shaping": True, "algorithm.overlong_filter": False},
    4: {"algorithm.loss_agg_mode": "token-mean"},
    5: {"algorithm.dynamic_sampling": True, "algorithm.use_kl": False},
}


def test_rung_0_is_naive_grpo():
    a = load_config(CONFIGS / "ablations" / RUNGS[0]).algorithm
    assert (a.policy_loss, a.advantage) == ("grpo", "grpo")
    assert (a.eps_low, a.eps_high, a.loss_agg_mode) == (0.2, 0.2, "seq-mean-token-mean")
    assert (a.dynamic_sampling, a.overlong_shaping, a.overlong_filter) == (False, False, False)
    assert (a.use_kl, a.kl_kind, a.kl_coef) == (True, "k3", 0.001)


@pytest.mark.parametrize("rung", range(1, len(RUNGS)))
def test_each_rung_changes_only_its_technique(rung):
    previous = load_config(CONFIGS / "ablations" / RUNGS[rung - 1])
    current = load_config(CONFIGS / "ablations" / RUNGS[rung])
    assert _diff(previous, current) == set(RUNG_ADDS[rung]) | {"trainer.output_dir"}
    flat = _flat(current.to_dict())
    for key, value in RUNG_ADDS[rung].items():
        assert flat[key] == value


def test_last_rung_is_the_32b_dapo_recipe():
    rung5 = load_config(CONFIGS / "ablations" / RUNGS[-1])
    assert _diff(rung5, load_config(DAPO_32B)) == {"trainer.output_dir"}
    outputs = {load_config(CONFIGS / "ablations" / r).trainer.output_dir for r in RUNGS}
    assert len(outputs) == len(RUNGS)  # every rung writes to its own directory


# ---- overrides ----


def test_overrides_apply_with_types():
    cfg = load_config(
        DAPO_32B,
        [
            "algorithm.eps_high=0.3",
            "actor.tp=4",
            "trainer.lr=2e-6",
            "algorithm.clip_ratio_c=null",
            "rollout.engine_urls=[http://a:1, http://b:2]",
        ],
    )
    assert cfg.algorithm.eps_high == 0.3 and cfg.actor.tp == 4
    assert cfg.trainer.lr == 2e-6  # YAML 1.1 reads "2e-6" as a string; the loader accepts it as a number
    assert cfg.algorithm.clip_ratio_c is None
    assert cfg.rollout.engine_urls == ["http://a:1", "http://b:2"]


# ---- each kind of mistake ----


@pytest.mark.parametrize(
    "overrides, needles",
    [
        # unknown keys, with the closest suggestion
        (["algorithm.eps_hgih=0.3"], ["algorithm.eps_hgih", "did you mean 'algorithm.eps_high'"]),
        (["algoritm.eps_high=0.3"], ["algoritm", "did you mean 'algorithm'"]),
        (["trainer.train_batchsize=8"], ["trainer.train_batchsize", "did you mean 'trainer.train_batch_size'"]),
        # wrong types
        (["actor.tp=two"], ["actor.tp", "'two'", "integer"]),
        (["actor.tp=2.5"], ["actor.tp", "2.5", "integer"]),
        (["trainer.lr=fast"], ["trainer.lr", "'fast'", "number"]),
        (["algorithm.dynamic_sampling=maybe"], ["algorithm.dynamic_sampling", "'maybe'", "true or false"]),
        (["algorithm.loss_agg_mode=token_mean"], ["algorithm.loss_agg_mode", "'token_mean'", "token-mean"]),
        (["rollout.engine_urls=http://a:1"], ["rollout.engine_urls", "http://a:1", "list"]),
        (["algorithm=3"], ["algorithm", "3", "section"]),
        # impossible values
        (["algorithm.eps_low=-0.1"], ["algorithm.eps_low", "-0.1", "[0, 1)"]),
        (["algorithm.eps_high=-0.2"], ["algorithm.eps_high", "-0.2", ">= 0"]),
        (["algorithm.clip_ratio_c=0.5"], ["algorithm.clip_ratio_c", "0.5", "> 1"]),
        (
            ["trainer.mini_batch_size=33"],
            ["trainer.mini_batch_size", "33", "must divide trainer.train_batch_size (512)"],
        ),
        (["rollout.n=1"], ["rollout.n", "1", "dynamic sampling needs n >= 2"]),
        (
            ["actor.cp=2", "actor.pp=1", "rollout.max_prompt_length=2049", "actor.micro_batch_tokens=22529"],
            ["actor.micro_batch_tokens", "22529", "2*actor.cp = 4 (22532)"],
        ),
        (["actor.micro_batch_tokens=4096"], ["actor.micro_batch_tokens", "4096", "22528"]),
        (
            ["algorithm.overlong_buffer_length=20480"],
            ["algorithm.overlong_buffer_length", "20480", "< rollout.max_response_length"],
        ),
        (["actor.world_size=100"], ["actor.world_size", "100", "tp*pp*cp = 16"]),
        (["rollout.top_p=0"], ["rollout.top_p", "0", "(0, 1]"]),
        (["rollout.engine_restarts=-1"], ["rollout.engine_restarts", "-1", ">= 0"]),
        (["rollout.engine_restarts=1.5"], ["rollout.engine_restarts", "1.5"]),
        (["rollout.engine_wait_s=-5"], ["rollout.engine_wait_s", "-5", ">= 0"]),
        (["trainer.lr=nan"], ["trainer.lr", "nan", "> 0"]),
        (["actor.vpp=2", "actor.pp=1"], ["actor.vpp", "2", "pp > 1"]),
        # bad override syntax
        (["algorithm.eps_high"], ["algorithm.eps_high", "expected key=value"]),
        (["=0.3"], ["=0.3", "expected key=value"]),
        (["algorithm.eps_high.x=1"], ["algorithm.eps_high.x=1", "'eps_high' is a value, not a section"]),
    ],
)
def test_mistakes_raise_naming_key_and_value(overrides, needles):
    message = _error(overrides)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_context_parallelism_is_allowed_on_the_torch_backend():
    cfg = load_config(DAPO_32B, ["actor.cp=2", "actor.pp=1", "actor.attention_backend=torch"])
    assert cfg.actor.cp == 2 and cfg.actor.attention_backend == "torch"


def test_n_of_one_is_fine_without_dynamic_sampling():
    assert load_config(DAPO_32B, ["rollout.n=1", "algorithm.dynamic_sampling=false"]).rollout.n == 1


def test_file_mistakes(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert f"config file not found: {missing}" in _error([], path=missing)
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "run.yaml"
    child.write_text("base: ../presets/base.yaml\n")  # the file that names a missing base is the one to fix
    assert _error([], path=child) == (
        f"config {child}: `base: ../presets/base.yaml` names {tmp_path / 'presets' / 'base.yaml'}, which does "
        "not exist (a base is relative to the file that names it)"
    )

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\ntrainer:\n  lr: 1.0e-6\n")
    b.write_text("base: a.yaml\n")
    message = _error([], path=a)
    assert "loops back" in message and str(a) in message

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer: [1, 2\n")
    assert "not valid YAML" in _error([], path=bad_yaml)

    top_list = tmp_path / "list.yaml"
    top_list.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in _error([], path=top_list)

    bad_key_in_file = tmp_path / "typo.yaml"
    bad_key_in_file.write_text(f"base: {DAPO_32B}\nrollout:\n  temprature: 0.7\n")
    assert "did you mean 'rollout.temperature'" in _error([], path=bad_key_in_file)


def test_config_show_prints_the_resolved_config(capsys):
    assert config_module.main(["show", str(DAPO_32B), "algorithm.eps_high=0.3"]) == 0
    out = capsys.readouterr().out
    assert "eps_high: 0.3" in out and "train_batch_size: 512" in out
    assert config_module.main([]) == 2


def test_model_tokenizer_is_not_a_key():
    """Prompts, the engines and eval all read the tokenizer from model.path: a separate model.tokenizer
    would be ignored, so setting it is an error naming the key rather than silently having no effect."""
    with pytest.raises(ValueError, match=r"unknown config key 'model.tokenizer' \(allowed in model: path, arch\)"):
        load_config(str(Path(__file__).resolve().parents[2] / "configs/runs/tiny_cpu.yaml"), ["model.tokenizer=/x"])
