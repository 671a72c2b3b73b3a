"""The frozen parallel layout (distributed/layout.py) that model_parallel() yields equals megatron's
parallel_state field by field, on real gloo ranks, for the layouts two ranks can hold; and the values
are the hand-computed ones of megatron's "tp-cp-ep-dp-pp" order (so a field read from the wrong
getter, or two fields swapped, fails even where megatron would agree with itself)."""

from __future__ import annotations

import dataclasses

import pytest

GROUPS = ("tp_group", "pp_group", "cp_group", "dp_group", "dp_cp_group", "ep_group", "etp_group")


def _layout_beside_megatron(sizes: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dapo_megatron.actor.parallel import model_parallel

    with model_parallel(**sizes) as layout:
        megatron = {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "vpp_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "is_first_stage": ps.is_pipeline_first_stage(ignore_virtual=True),
            "is_last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
            "cp_rank": ps.get_context_parallel_rank(),
            "cp_size": ps.get_context_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "dp_cp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
            "dp_cp_size": ps.get_data_parallel_world_size(with_context_parallel=True),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "ep_size": ps.get_expert_model_parallel_world_size(),
            "etp_rank": ps.get_expert_tensor_parallel_rank(),
            "etp_size": ps.get_expert_tensor_parallel_world_size(),
            "tp_group": ps.get_tensor_model_parallel_group(),
            "pp_group": ps.get_pipeline_model_parallel_group(),
            "cp_group": ps.get_context_parallel_group(),
            "dp_group": ps.get_data_parallel_group(),
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
            "ep_group": ps.get_expert_model_parallel_group(),
            "etp_group": ps.get_expert_tensor_parallel_group(),
        }
        same_groups = {name: getattr(layout, name) is megatron[name] for name in GROUPS}
        ranks = {
            f.name: dist.get_process_group_ranks(getattr(layout, f.name))
            for f in dataclasses.fields(layout)
            if f.name.endswith("_group")
        }
        values = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if not f.name.endswith("_group")}
        megatron_values = {k: v for k, v in megatron.items() if not k.endswith("_group")}
        try:
            layout.tp_rank = 5  # frozen: a consumer cannot change its copy
            frozen = False
        except dataclasses.FrozenInstanceError:
            frozen = True
    return {
        "values": values,
        "megatron": megatron_values,
        "same_groups": same_groups,
        "ranks": ranks,
        "frozen": frozen,
        "sizes": layout.sizes,
    }


# (model_parallel sizes, per rank: the hand-computed fields that differ between the two ranks, and the
# member ranks of the groups; every field not listed is rank 0 / size 1 / not None as below)
CASES = {
    "tp2": (
        {"tp": 2},
        dict(tp_rank=[0, 1], tp_size=2, etp_rank=[0, 1], etp_size=2),
        dict(tp_group=[0, 1], etp_group=[0, 1], replica_group=[0, 1]),
    ),
    "dp2_ep2": (
        {"ep": 2},
        dict(dp_rank=[0, 1], dp_size=2, dp_cp_rank=[0, 1], dp_cp_size=2, ep_rank=[0, 1], ep_size=2),
        dict(dp_group=[0, 1], dp_cp_group=[0, 1], ep_group=[0, 1]),
    ),
    "pp2_vpp2": (
        {"pp": 2, "vpp": 2},
        dict(pp_rank=[0, 1], pp_size=2, vpp_size=2, is_first_stage=[True, False], is_last_stage=[False, True]),
        dict(pp_group=[0, 1], replica_group=[0, 1]),
    ),
    "cp2": (
        {"cp": 2},
        dict(cp_rank=[0, 1], cp_size=2, dp_cp_rank=[0, 1], dp_cp_size=2),
        dict(cp_group=[0, 1], dp_cp_group=[0, 1], replica_group=[0, 1]),
    ),
    "tp2_etp1_ep2": (
        {"tp": 2, "ep": 2, "etp": 1},
        dict(tp_rank=[0, 1], tp_size=2, ep_rank=[0, 1], ep_size=2),
        dict(tp_group=[0, 1], ep_group=[0, 1], replica_group=[0, 1]),
    ),
}

ALONE = dict(
    tp_rank=0,
    tp_size=1,
    pp_rank=0,
    pp_size=1,
    vpp_size=None,
    is_first_stage=True,
    is_last_stage=True,
    cp_rank=0,
    cp_size=1,
    dp_rank=0,
    dp_size=1,
    dp_cp_rank=0,
    dp_cp_size=1,
    ep_rank=0,
    ep_size=1,
    etp_rank=0,
    etp_size=1,
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_equals_megatrons_parallel_state_on_two_gloo_ranks(rank_pool, case):
    sizes, varying, groups = CASES[case]
    for rank, got in enumerate(rank_pool(2).run(_layout_beside_megatron, sizes)):
        assert got["values"] == got["megatron"], case  # every rank / size / stage field
        assert got["same_groups"] == dict.fromkeys(GROUPS, True), case  # megatron's own group objects
        expected = {**ALONE, "rank": rank, "world_size": 2}
        expected.update({k: v[rank] if isinstance(v, list) else v for k, v in varying.items()})
        assert got["values"] == expected, case
        alone = {name: [rank] for name in (*GROUPS, "replica_group")}
        assert got["ranks"] == {**alone, **groups}, case
        assert got["frozen"]
        etp = sizes.get("etp", sizes.get("tp", 1))
        assert got["sizes"] == {
            "tp": sizes.get("tp", 1),
            "pp": sizes.get("pp", 1),
            "cp": sizes.get("cp", 1),
            "vpp": sizes.get("vpp"),
            "ep": sizes.get("ep", 1),
            "etp": etp,
        }
