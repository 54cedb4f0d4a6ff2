"""The in-graph all-reduce of data-parallel training, inspected in one process (the graph is compiled,
never run: running it needs a process group, see tests/test_distributed.py), the engines' guards
that need no second process, and where expert parallelism's compiled deferred forward keeps its
operands (a world of one)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch.fx import GraphModule, Node

import sonar_fx
from sonar_fx.backend import SonarPartitioner
from sonar_fx.config import ConfigFieldError
from sonar_fx.distributed import ShardedGrads
from sonar_fx.engines import SINGLE_PROCESS, DDPEngine, ExpertParallelEngine, FSDP2Engine
from sonar_fx.errors import ProcessGroupRequired
from sonar_fx.methods import Execution, build_method
from sonar_fx.models import build_model
from sonar_fx.optim.reduction import refuse_unreduced
from sonar_fx.passes.graph_utils import is_view, node_order
from sonar_fx.passes.reduce_grads import GraphReduce
from sonar_fx.runtime import EXPERT_UPDATE_OP, registry

from helpers import CFG, assert_same_weights, batches

c10d = torch.ops._c10d_functional
REDUCE = GraphReduce("some-group", 2)


def capture_backward(reduce: GraphReduce | None) -> GraphModule:
    torch._dynamo.reset()
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    sonar_fx.prepare(model, CFG)
    graphs = []

    def backend(gm, example_inputs):
        experts = [i for i, x in enumerate(example_inputs) if registry.owner_of(x) is not None]
        partitioner = SonarPartitioner(experts, reduce=reduce)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = partitioner(joint, joint_inputs, **kwargs)
            graphs.append(bw)
            return fw, bw

        return aot_autograd(fw_compiler=boxed_nop, partition_fn=partition)(gm, example_inputs)

    torch.compile(model, backend=backend)(**batches(1)[0])  # forward only: the partition is done
    (bw,) = graphs
    return bw


def _producer(node: Node) -> Node:
    while is_view(node):
        node = node.args[0]
    return node


def test_each_expert_gradient_is_averaged_in_graph_before_its_update():
    bw = capture_backward(REDUCE)
    order = node_order(bw.graph)
    updates = [n for n in bw.graph.nodes if n.target is EXPERT_UPDATE_OP]
    assert len(updates) == 4
    producers = sorted((_producer(u.args[0].args[0].args[0].args[0]) for u in updates), key=order.get)
    for update in updates:
        wait, aliases, tag = update.args
        assert tag == REDUCE.tag == "mean-all-reduce/2@some-group"
        assert wait.target is c10d.wait_tensor.default
        work = wait.args[0]
        assert work.target is c10d.all_reduce.default and work.args[1:] == ("sum", "some-group")
        scaled = work.args[0]
        assert scaled.target is torch.ops.aten.mul.Tensor and scaled.args[1] == 0.5
        grad = scaled.args[0]
        assert order[grad] < order[scaled] < order[work], "issued right after the gradient"
        readers = [u for a in aliases for u in a.users if u is not update and not is_view(u)]
        assert all(order[r] < order[update] for r in readers), "update after every read of the weight"
        assert order[wait] < order[update]
        later = [p for p in producers if order[p] > order[_producer(grad)]]
        if later:  # waited for only just before the next expert's weight gradient
            assert order[wait] < order[later[0]]
            between = [n for n in bw.graph.nodes if order[work] < order[n] < order[wait]]
            assert any(n.op == "call_function" for n in between), "no compute overlaps the all-reduce"


def test_without_a_reduction_the_graph_has_no_collective():
    bw = capture_backward(None)
    targets = {n.target for n in bw.graph.nodes}
    assert c10d.all_reduce.default not in targets and c10d.wait_tensor.default not in targets
    assert all(len(n.args) == 2 for n in bw.graph.nodes if n.target is EXPERT_UPDATE_OP)


def test_cache_key_covers_the_reduction():
    assert SonarPartitioner({1}, reduce=REDUCE).uuid() != SonarPartitioner({1}).uuid()
    assert (
        SonarPartitioner({1}, reduce=REDUCE).uuid()
        != SonarPartitioner({1}, reduce=GraphReduce("g", 4)).uuid()
    )


def test_a_reduced_gradient_for_an_undistributed_optimizer_is_refused():
    with pytest.raises(sonar_fx.SonarUsageError, match="compiled for a distributed model"):
        refuse_unreduced("w", REDUCE.tag)


def test_fsdp2_refuses_an_update_from_a_compiled_graph():
    with pytest.raises(sonar_fx.SonarUsageError, match="unsharded, unreduced"):
        ShardedGrads().reduce_then_update("w", torch.zeros(1), path="graph", reduced="", update=print)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "expert_parallel", "shard_experts_"])
def test_engines_need_a_process_group(engine):
    import sonar_fx.distributed as sd

    model = build_model("tiny-reference", seed=0)
    args = (model,) if engine == "shard_experts_" else (model, CFG)
    with pytest.raises(
        ProcessGroupRequired, match=f"sonar_fx.distributed.{engine} needs .*init_process_group"
    ):
        getattr(sd, engine)(*args)
    assert getattr(model, "sonar", None) is None  # refused before anything was set up


@pytest.mark.parametrize(
    "engine, method, execution, cfg, field",
    [
        (ExpertParallelEngine(), "oib_all", Execution(), CFG, "method"),
        (DDPEngine(), "sonar_per_expert", Execution(), CFG, "method"),
        (FSDP2Engine(), "sonar", Execution(compiler="aot_eager", sonar_pass=False), CFG, "sonar_pass"),
        (FSDP2Engine(), "sonar", Execution(), sonar_fx.AdamWConfig(lr=1e-3, state_bits=4), "state_bits"),
        (FSDP2Engine(), "standard_no_expert_clip", Execution(), sonar_fx.AdamWConfig(lr=1e-3, state_bits=4),
         "state_bits"),
    ],
)  # fmt: skip
def test_an_engine_refuses_what_it_does_not_run_before_building(engine, method, execution, cfg, field):
    model = build_model("tiny-reference", seed=0)  # no process group: the refusal comes first
    with pytest.raises(ConfigFieldError) as caught:
        build_method(method, model, cfg, execution=execution, engine=engine)
    assert caught.value.field == field and f"the {engine.name} engine" in str(caught.value)
    assert getattr(model, "sonar", None) is None
    build_method(method, model, cfg, execution=execution, engine=SINGLE_PROCESS)  # one process runs it


@pytest.mark.parametrize(
    "cfg, match",
    [
        (
            sonar_fx.AdamWConfig(lr=1e-3, state_bits=4),
            r"state_bits=4 .*torchao.*state_bits=8 there, or 4 on ddp or ep",
        ),
        (
            sonar_fx.AdamWConfig(lr=1e-3, dense_state_bits=8),
            r"dense_state_bits=8 is not supported .*dense_state_bits=32",
        ),
    ],
)
def test_sharded_engines_refuse_what_nothing_verifies_naming_what_runs(cfg, match):
    with pytest.raises(sonar_fx.SonarUsageError, match=match):
        sonar_fx.prepare(build_model("tiny-reference", seed=0), cfg, distributed=ShardedGrads())


@pytest.mark.parametrize(
    "flags, refused",
    [
        (dict(parallel="fsdp2", state_bits=4), True),
        (dict(parallel="ddp", state_bits=4), False),
        (dict(parallel="fsdp2", state_bits=8, expert_clip="global"), False),
        (dict(parallel="ep", expert_clip="per_tensor"), False),
    ],
)
def test_cli_parallel_takes_clip_and_state_flags_but_4bit_shards(flags, refused):
    from sonar_fx.trainer.config import ConfigError, TrainConfig
    from sonar_fx.trainer.validate import optimizer_config

    if not refused:
        assert optimizer_config(TrainConfig(**flags), 1e-3).expert_clip == flags.get("expert_clip")
        return
    with pytest.raises(ConfigError, match="state_bits=4 is not supported on the fsdp2 engine"):
        optimizer_config(TrainConfig(**flags), 1e-3)


@pytest.fixture
def one_rank(tmp_path):
    """A world of one gloo process (this one), for layouts that need a process group but no peer."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


UPPER = ["layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"]


@pytest.mark.parametrize("given", ["names", "parameters", None])
@pytest.mark.filterwarnings("error::FutureWarning")  # none from the all-to-all (it was deprecated)
def test_fsdp2_ep_lays_out_only_the_experts_given(one_rank, given):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    import sonar_fx.distributed as sd

    model = build_model("tiny-reference", seed=0)
    experts = {"names": UPPER, "parameters": [model.get_parameter(n) for n in UPPER], None: None}[given]
    lower_before = model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    model = sd.fsdp2_ep(model, CFG, mesh=mesh, experts=experts)
    expected = ["layers.1.mlp.experts"] if given else ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    laid_out = [n for n, m in model.named_modules() if isinstance(m, sd.ExpertParallelExperts)]
    own_groups = [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n.endswith("experts")]
    assert laid_out == own_groups == expected
    assert sd.expert_names(model.sonar) == [
        f"{n}.{t}" for n in expected for t in ("gate_up_proj", "down_proj")
    ]
    (batch,) = batches(1)
    model(**batch).loss.backward()
    model.sonar.step()
    lower = model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(lower.full_tensor(), lower_before)  # trained, by Sonar or as a dense tensor


def test_fsdp2_ep_refuses_half_an_experts_module(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    import sonar_fx.distributed as sd

    model = build_model("tiny-reference", seed=0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    with pytest.raises(sonar_fx.SonarUsageError, match=r"part of layers.1.mlp.experts but not .*down_proj"):
        sd.fsdp2_ep(model, CFG, mesh=mesh, experts=UPPER[:1])
    assert getattr(model, "sonar", None) is None


def mixed_expert_counts() -> torch.nn.Module:
    """tiny-reference with 4 experts in layer 0 and 3 in layer 1: two ranks split the first, not the
    second (a refusal that came at layer 1 would find layer 0 sharded already)."""
    model = build_model("tiny-reference", seed=0, num_experts=4)
    model.layers[1].mlp = build_model("tiny-reference", seed=1, num_experts=3).layers[1].mlp
    return model


@pytest.fixture
def a_world_of_two(monkeypatch):
    """What the refusal reads of the world, set to 2 ranks: the check comes before any collective, so one
    process shows it (the command line on 2 spawned ranks: test_distributed_trainer_deferred)."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)


@pytest.mark.parametrize("entry", ["expert_parallel", "shard_experts_"])
def test_expert_parallel_refuses_experts_the_world_cannot_split_before_any_module_moves(
    one_rank, a_world_of_two, entry
):
    import sonar_fx.distributed as sd

    model = mixed_expert_counts()
    modules = dict(model.named_modules())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = (model,) if entry == "shard_experts_" else (model, CFG)
    with pytest.raises(sonar_fx.SonarUsageError) as caught:
        getattr(sd, entry)(*args)
    said = str(caught.value)
    assert "layers.1.mlp.experts holds 3 experts, which expert parallelism cannot split" in said
    assert "evenly over 2 ranks" in said
    assert "run on a number of ranks that divides 3" in said and "an ep_size that divides 3 and 2" in said
    assert dict(model.named_modules()) == modules  # layer 0's experts, which 2 ranks split, stay whole
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert getattr(model, "sonar", None) is None


def test_shard_experts_splits_what_the_world_divides(one_rank):
    """The control: the same model over this world of one rank is laid out, every layer."""
    import sonar_fx.distributed as sd

    model = mixed_expert_counts()
    assert sd.shard_experts_(model) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert isinstance(model.layers[1].mlp.experts, sd.ExpertParallelExperts)


@pytest.mark.parametrize("method", ["sonar", "standard"])
def test_ep_engine_refuses_experts_the_world_cannot_split_naming_the_layer(a_world_of_two, method):
    """What `--parallel ep` builds with (Sonar, or a baseline's layout): `ConfigFieldError` on "parallel"
    (the command line's exit 2 naming --parallel), before any process group is asked to lay anything out."""
    model = build_model("tiny-reference", seed=0, num_experts=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigFieldError) as caught:
        build_method(method, model, CFG, engine=ExpertParallelEngine())
    assert caught.value.field == "parallel"
    assert "layers.0.mlp.experts holds 3 experts" in str(caught.value) and "over 2 ranks" in str(caught.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert getattr(model, "sonar", None) is None


@pytest.fixture
def redistribute_notes(monkeypatch):
    """The records DTensor's redistribution logger lets through (after its filters), with its
    once-per-mesh memory emptied so that every norm below may note again."""
    import logging

    from torch.distributed.tensor import _redistribute

    monkeypatch.setattr(_redistribute, "_warned_flatten_issues", set())
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(_redistribute.__name__)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_fsdp2_ep_clip_norm_is_torchtitans_without_dtensors_sequential_all_reduce_note(
    one_rank, redistribute_notes
):
    """The baselines' clip over every parameter on FSDP2 x EP: bitwise torchtitan's norm written here
    (which, unfiltered, logs DTensor's "2 sequential all_reduce operations" note: the control), and the
    engine's own call logs nothing."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, _redistribute

    from sonar_fx.engines import FSDP2EPEngine

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    every_rank = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    torch.manual_seed(0)
    params = []
    for i, sub in enumerate([mesh["dp"], every_rank, mesh["dp"]]):  # expert, dense, expert
        p = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 3), sub, [Shard(0)]))
        p.grad = DTensor.from_local(torch.randn(4, 3) * (i + 1), sub, [Shard(0)])
        params.append(p)
    experts = {id(params[0]), id(params[2])}
    as_2d = [DTensor.from_local(params[i].grad.to_local(), mesh, [Shard(0), Shard(0)]) for i in (0, 2)]
    ep_norm = torch.nn.utils.get_total_norm(as_2d).full_tensor()
    dense_norm = torch.nn.utils.get_total_norm([params[1].grad]).full_tensor()
    expected = ep_norm**2 + dense_norm**2
    expected **= 1.0 / 2
    assert any("2 sequential all_reduce operations" in note for note in redistribute_notes)
    redistribute_notes.clear()
    _redistribute._warned_flatten_issues.clear()  # the engine's norm would note again, were it not quiet
    got = FSDP2EPEngine().total_norm(params, experts)
    assert torch.equal(got, expected) and redistribute_notes == []


def _deferred_ep_trained(traced: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, int]:
    """tiny-reference on expert parallelism over a world of one, aot_eager, schedule="deferred": two
    steps of two micro-batches (no_sync on the first). `traced`: the layout's own modules declare that
    their GEMMs trace into the graph (what `expert_parallel` sets); False is the capture's path.
    Returns the model and how many times the eager capture was entered."""
    import sonar_fx.distributed as sd
    from sonar_fx.optim.defer_eager import DeferGemms

    entered = [0]
    enter = DeferGemms.__enter__

    def counted(mode: DeferGemms) -> DeferGemms:
        entered[0] += 1
        return enter(mode)

    monkeypatch.setattr(DeferGemms, "__enter__", counted)
    torch._dynamo.reset()
    model = sd.expert_parallel(
        build_model("tiny-reference", seed=0), CFG, compiler="aot_eager", schedule="deferred"
    )
    for module in model.modules():
        if isinstance(module, sd.ExpertParallelExperts):
            assert module.traced_when_compiled
            module.traced_when_compiled = traced
    for step in range(2):
        first, last = batches(
            2, batch=1, seq=8, seed=step
        )  # few tokens: the operands stay below each gradient
        with model.no_sync():
            model(**first).loss.backward()
        model(**last).loss.backward()
        model.sonar.step()
        model.sonar.zero_grad()
    return model, entered[0]


def test_compiled_expert_parallel_defers_in_the_graph_bitwise_as_the_capture_does(one_rank, monkeypatch):
    """Under expert parallelism's compiled blocks the eager capture stays out of the experts' forward
    (its mode would run their GEMMs eagerly, op by op): the graph pass keeps their operands, and the
    weights are bitwise those the capture's path trains (itself bitwise the plain engine: the
    multiprocess cases). The control: a module that does not declare it enters the capture."""
    traced, captures = _deferred_ep_trained(True, monkeypatch)
    captured, captures_control = _deferred_ep_trained(False, monkeypatch)
    assert captures == 0 and captures_control == 2 * 2 * 2  # 2 experts modules x 2 micro-batches x 2 steps
    assert_same_weights(traced, captured)
