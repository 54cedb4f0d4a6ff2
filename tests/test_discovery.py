"""Expert discovery finds experts by structure, whatever their names, or explains what it saw."""

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn

import sonar_fx
from sonar_fx import cli
from sonar_fx.distributed.expert_parallel import ExpertParallelExperts
from sonar_fx.experts.discovery import structural_layers
from sonar_fx.experts.report import discovery_report
from sonar_fx.models import TINY_MODELS, build_model, families
from sonar_fx.models.families import build_family, moe_model_types

from helpers import known_library_failure


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_finds_two_batched_tensors_per_layer(name):
    model = build_model(name)
    layers = sonar_fx.discover_experts(model)
    assert len(layers) == 2
    for layer in layers:
        up, down = layer.tensors
        assert (up.role, down.role) == ("up", "down")
        e = layer.num_experts
        assert up.param.shape[0] == down.param.shape[0] == e
        assert up.param.shape[1] == 2 * down.param.shape[2]  # (E, 2n, d) and (E, d, n)
        assert up.param.shape[2] == down.param.shape[1]


def test_expert_set_splits_trainable_parameters_in_model_order():
    model = build_model("tiny-olmoe")
    model.model.embed_tokens.weight.requires_grad_(False)
    experts = sonar_fx.ExpertSet.discover(model)
    split = experts.split(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, _ in split.trainable] == trainable and "model.embed_tokens.weight" not in trainable
    assert [n for n, _ in split.experts] == sorted(experts.names, key=trainable.index)
    assert {n for n, _ in split.dense} == set(trainable) - set(experts.names)
    assert all(".experts." not in n for n, _ in split.dense) and len(split.experts) == 4
    assert experts.names_by_id() == {id(p): n for n, p in split.experts}


def test_explicit_experts_by_name_and_by_parameter():
    model = build_model("tiny-olmoe")
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    by_name = sonar_fx.discover_experts(model, names)
    params = dict(model.named_parameters())
    by_param = sonar_fx.discover_experts(model, [params[n] for n in names])
    assert [t.name for t in by_name[0].tensors] == [t.name for t in by_param[0].tensors] == names
    with pytest.raises(ValueError, match="not a parameter name"):
        sonar_fx.discover_experts(model, ["nope"])
    with pytest.raises(ValueError, match="not a parameter of this model"):
        sonar_fx.discover_experts(model, [torch.nn.Parameter(torch.zeros(2, 2, 2))])
    params[names[0]].requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        sonar_fx.discover_experts(model, names)


def test_nothing_found_lists_3d_params_and_the_fix():
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(4, 3, 2))
    with pytest.raises(sonar_fx.NoExpertsFoundError) as err:
        sonar_fx.discover_experts(model)
    assert "weight: (4, 3, 2)" in str(err.value) and "experts=" in str(err.value)


# --- structure, not names: synthetic modules --------------------------------------------------------


class Declared(nn.Module):
    """An experts module with made-up parameter names and a declared count."""

    def __init__(self, e=4, shapes=((12, 8), (8, 6)), extra=None):
        super().__init__()
        self.num_local_experts = e
        for i, s in enumerate(shapes):
            setattr(self, f"w{i}", nn.Parameter(torch.zeros(e, *s) if len(s) == 2 else torch.zeros(*s)))
        for name, shape in (extra or {}).items():
            setattr(self, name, nn.Parameter(torch.zeros(*shape)))


def _wrap(**children):
    model = nn.Module()
    for name, child in children.items():
        setattr(model, name, child)
    return model


def test_any_names_with_a_declared_count_are_found_with_roles_and_biases():
    model = _wrap(moe=Declared(extra={"b0": (4, 12), "router_like": (4, 8, 1, 1)}))
    (layer,) = sonar_fx.discover_experts(model)
    roles = {t.name: t.role for t in layer.tensors}
    assert roles == {"moe.w0": "up", "moe.w1": "down", "moe.b0": "bias"}
    assert layer.layout == "batched" and layer.num_experts == 4
    (dense,) = sonar_fx.discover_experts(model, expert_biases="dense")
    assert [t.name for t in dense.tensors] == ["moe.w0", "moe.w1"] and dense.dense_biases == ("moe.b0",)


def test_without_a_declared_count_two_3d_tensors_with_one_leading_dim_are_needed():
    two = nn.Module()
    two.a, two.b = nn.Parameter(torch.zeros(4, 6, 8)), nn.Parameter(torch.zeros(4, 8, 3))
    assert [t.name for t in sonar_fx.discover_experts(_wrap(m=two))[0].tensors] == ["m.a", "m.b"]
    one = nn.Module()
    one.a = nn.Parameter(torch.zeros(4, 6, 8))
    with pytest.raises(sonar_fx.NoExpertsFoundError):
        sonar_fx.discover_experts(_wrap(m=one))


def test_convolutions_routers_and_mismatched_counts_are_not_experts():
    conv = nn.Conv1d(8, 8, 3, groups=8)
    conv.num_experts = 8  # even a conv declaring a count is never an experts module
    router = Declared(shapes=((4, 8),))  # (E, d): a router's shape
    router.w0 = nn.Parameter(torch.zeros(4, 8))
    mismatched = Declared(e=4, shapes=((5, 6, 8), (5, 8, 6)))
    model = _wrap(conv=conv, conv2=nn.Conv1d(8, 8, 3), router=router, mismatched=mismatched)
    with pytest.raises(sonar_fx.NoExpertsFoundError, match="declare an expert count"):
        sonar_fx.discover_experts(model)


def test_an_expert_parallel_shard_of_one_expert_per_rank_is_found_a_plain_one_expert_module_is_not():
    """As many experts as ranks leaves each rank (1, out, in) tensors. The shard declares its layout
    (`holds_expert_shard`), so its one local expert is found with its roles; the same tensors and
    counts on a module that does not declare it are not (a count of 1 is no evidence of experts)."""
    up, down = torch.zeros(1, 12, 8), torch.zeros(1, 8, 6)
    shard = ExpertParallelExperts(up.clone(), down.clone(), num_experts=2, group=None)  # type: ignore[arg-type]
    (layer,) = sonar_fx.discover_experts(_wrap(experts=shard))
    assert {t.name: t.role for t in layer.tensors} == {
        "experts.gate_up_proj": "up",
        "experts.down_proj": "down",
    }
    assert layer.layout == "batched" and layer.num_experts == 1
    undeclared = nn.Module()
    undeclared.gate_up_proj, undeclared.down_proj = nn.Parameter(up), nn.Parameter(down)
    undeclared.num_experts, undeclared.global_experts = 1, 2
    with pytest.raises(sonar_fx.NoExpertsFoundError):
        sonar_fx.discover_experts(_wrap(experts=undeclared))


def test_fused_2d_weights_are_taken_as_their_expert_view():
    fused = Declared(e=4, shapes=((20, 8), (20, 8)))
    for name, shape in (("w0", (20, 8)), ("w1", (20, 8)), ("w2", (20, 8))):
        setattr(fused, name, nn.Parameter(torch.zeros(*shape)))
    (layer,) = sonar_fx.discover_experts(_wrap(ffn=fused))
    assert layer.layout == "fused_2d"
    assert {t.expert_shape for t in layer.tensors} == {(4, 5, 8)}


# --- every MoE family of transformers, on the meta device ----------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function is test_every_family_routed_expert_is_found_and_nothing_else:
        types = _families(metafunc.config)
        metafunc.parametrize(
            "model_type", [pytest.param(t, marks=known_library_failure(discovery_of=t)) for t in types]
        )


def _families(config: pytest.Config) -> list[str]:
    """`moe_model_types()`, kept in pytest's cache: finding them builds every causal-LM config of
    transformers, ~5 s in each collecting process. Keyed by the transformers version and the source
    that decides (families.py), so a new transformers or a new rule finds them again."""
    source = hashlib.sha256(Path(families.__file__).read_bytes()).hexdigest()[:16]
    key = f"sonar_fx/moe_model_types/{transformers.__version__}/{source}"
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    found = cache.get(key, None) if cache is not None else None
    if found is None:
        found = list(moe_model_types())
        if cache is not None:
            cache.set(key, found)
    return found


def test_every_family_routed_expert_is_found_and_nothing_else(model_type):
    model = build_family(model_type, device="meta")
    params = dict(model.named_parameters())
    if model_type == "doge":  # embedding-style (E, d) experts: a router's shape, so never guessed
        with pytest.raises(sonar_fx.NoExpertsFoundError, match=r"down_embed\.weight"):
            sonar_fx.discover_experts(model)
        return
    layers = sonar_fx.discover_experts(model)
    claimed = {t.name for layer in layers for t in layer.tensors}
    assert layers and all(layer.num_experts == 8 for layer in layers)  # the tiny configs' E
    routed_3d = {n for n, p in params.items() if p.dim() == 3 and p.shape[0] == 8}
    assert routed_3d <= claimed, f"left dense: {sorted(routed_3d - claimed)}"
    assert not {n for n in claimed if params[n].dim() == 2 and params[n].shape[0] == 8 and "bias" not in n}
    assert not {n for n in claimed if "shared" in n}, "shared experts stay dense"
    assert all(t.expert_shape[0] in (8, 10) for layer in layers for t in layer.tensors)


def test_nemotron_h_non_gated_experts():
    (layer,) = sonar_fx.discover_experts(build_family("nemotron_h", device="meta"))
    up, down = layer.tensors
    assert up.name.endswith("experts.up_proj") and (up.role, down.role) == ("up", "down")
    assert up.expert_shape == (8, 32, 64) and "not gated" in layer.notes[0]


def test_longcat_zero_computation_experts_counted_as_transformers_stores_them():
    """LongCat-Flash routes each token over 8 computing and 2 zero-computation (identity) experts.
    transformers < 5.25 stores the 2 as extra gate_up rows (never read: updated whole, with the layer);
    5.25 stores only the 8 computing experts (a transformers experts module) and routes the 2 around
    it. Either way E is 8, and the router's 10 outputs stay dense."""
    model = build_family("longcat_flash", device="meta")
    layers = sonar_fx.discover_experts(model)
    up, down = layers[0].tensors
    zero_rows_stored = Version(transformers.__version__) < Version("5.25")
    up_rows = 10 if zero_rows_stored else 8
    assert (up.expert_shape[0], down.expert_shape[0], layers[0].num_experts) == (up_rows, 8, 8)
    assert ("zero-computation" in layers[0].notes[0]) == zero_rows_stored
    router = model.model.layers[0].mlp.router.classifier.weight
    claimed = {id(t.param) for layer in layers for t in layer.tensors}
    assert router.shape[0] == 10 and id(router) not in claimed


def test_jetmoe_per_expert_linears_grouped_per_layer_attention_included():
    layers = sonar_fx.discover_experts(build_family("jetmoe", device="meta"))
    assert [layer.name for layer in layers] == [
        f"model.layers.{i}.{part}" for i in (0, 1) for part in ("mlp", "self_attention.experts")
    ]
    assert all(layer.layout == "parallel_linear" and len(layer.tensors) == 2 for layer in layers)
    assert [t.role for t in layers[0].tensors] == ["up", "down"]


def test_dbrx_fused_weights_and_gpt_oss_biases_both_policies():
    (dbrx, _) = sonar_fx.discover_experts(build_family("dbrx", device="meta"))
    assert [t.expert_shape for t in dbrx.tensors] == [(8, 32, 64)] * 3
    model = build_family("gpt_oss", device="meta")
    with_biases = sonar_fx.discover_experts(model, expert_biases="experts")
    assert [t.role for t in with_biases[0].tensors] == ["up", "down", "bias", "bias"]
    dense = sonar_fx.discover_experts(model, expert_biases="dense")
    assert [t.role for t in dense[0].tensors] == ["up", "down"]
    assert dense[0].dense_biases == tuple(t.name for t in with_biases[0].tensors[2:])
    with pytest.raises(ValueError, match="expert_biases"):
        sonar_fx.discover_experts(model, expert_biases="yes")


def test_report_lists_shared_experts_and_router_as_dense():
    report = discovery_report(build_family("qwen2_moe", device="meta"))
    block = report["layers"][0]
    kinds = {d["module"].rsplit(".", 1)[-1]: d["kind"] for d in block["dense_in_block"]}
    assert kinds == {"gate": "router", "shared_expert": "dense", "shared_expert_gate": "dense"}
    assert "dense by design" in report["shared_experts"]
    assert 0 < report["expert_fraction"] < 1
    json.dumps(report)  # plain data


# --- frozen experts -----------------------------------------------------------------------------


def test_partly_frozen_layer_keeps_its_partner_an_expert_and_warns():
    model = build_model("tiny-olmoe")
    model.model.layers[0].mlp.experts.gate_up_proj.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"Partly frozen.*layers\.0\.mlp\.experts\.gate_up_proj"):
        layers = sonar_fx.discover_experts(model)
    assert [t.name for t in layers[0].tensors] == ["model.layers.0.mlp.experts.down_proj"]
    assert layers[0].frozen == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert len(layers[1].tensors) == 2


def test_all_experts_frozen_says_so():
    model = build_model("tiny-olmoe")
    for layer in structural_layers(model):
        for t in layer.tensors:
            t.param.requires_grad_(False)
    with pytest.raises(sonar_fx.NoExpertsFoundError, match="frozen"):
        sonar_fx.discover_experts(model)


def test_unfrozen_model_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sonar_fx.discover_experts(build_model("tiny-olmoe"))


# --- sonar-fx inspect -----------------------------------------------------------------------------


def test_inspect_prints_layers_json_and_errors(capsys):
    assert cli.main(["inspect", "--model", "tiny-olmoe"]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.down_proj" in text and "dense by design" in text
    assert cli.main(["inspect", "--model", "hf:gpt_oss", "--json", "--expert-biases", "dense"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"][0]["dense_biases"] and report["expert_biases"] == "dense"
    assert cli.main(["inspect", "--model", "hf:doge"]) == 2
    assert "up_embed.weight" in capsys.readouterr().out
    assert cli.main(["inspect", "--model", "no-such-model"]) == 2
    assert "hf:<model_type>" in capsys.readouterr().err
