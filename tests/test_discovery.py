"""Expert discovery finds each architecture's batched tensors, or explains what it saw."""

import pytest
import torch

import sonar_fx
from sonar_fx.models import TINY_MODELS, build_model


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


def test_nothing_found_lists_3d_params_and_the_fix():
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(4, 3, 2))
    with pytest.raises(sonar_fx.NoExpertsFoundError) as err:
        sonar_fx.discover_experts(model)
    assert "weight: (4, 3, 2)" in str(err.value) and "experts=" in str(err.value)
