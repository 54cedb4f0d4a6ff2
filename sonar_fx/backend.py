"""The "sonar" dynamo backend: AOTAutograd with the expert-update pass on every backward graph.

Wiring only. Expert parameters are recognised by identity among the dynamo example inputs (they are
the real `nn.Parameter` objects, bound to an optimizer in the runtime registry); their input indices
go to a partitioner that runs the default min-cut partition and then the backward pass, where it can
see the forward graph's saved values. Which parameter an update applies to is decided at run time
(see `sonar_fx.runtime`), so a graph dynamo reuses for another module of the same class is correct.
Inductor's caches key on the partitioner's uuid (the pass, the runtime op and this file's source, and
the expert input indices), so they never serve a graph compiled without the pass. A compiler failure
warns once and runs the graph eagerly, where the expert hooks do the updates; it never trains wrong.
Distributed runs: when the owning optimizer's reduction asks for it (DDP), the pass all-reduces each
expert gradient in the graph; under DDP's optimizer, which compiles bucket-sized subgraphs from fake
tensors, expert inputs are recognised through the fake mode's memo of the real parameters; an engine
that reduces after the graph (FSDP2) keeps its experts out of the pass, for the hooks.
The saving guard: each expert gradient a backward graph still returns after the pass (its hook would
update it after the whole graph, saving nothing) is reported to its owner, which warns or raises, and
the compiled function is wrapped so that the owner's meter sees those gradients alive together.
Dynamo's own control flow raised inside the backend (a restart of the trace under `dynamic=True`) is
passed through, never taken for a failure. A graph holding batched expert tensors that no optimizer
owns (a model never prepared) warns once.
Before the pass, an expert weight the partition did not save is handed to the backward graph
(`save_expert_params`), so that its update can bind to it.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

import sonar_fx.runtime
from sonar_fx.experts.structure import batched_by_shape
from sonar_fx.optim.backward_root import SONAR_BACKEND_FLAG, mark_graph_backward
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.optim.saving import LostGradient
from sonar_fx.passes import insert_updates
from sonar_fx.passes.defer_grads import expert_defer_pass
from sonar_fx.passes.find_expert_grads import returned_expert_grads
from sonar_fx.passes.insert_updates import expert_update_pass
from sonar_fx.passes.recompute_gathers import recompute_expert_gathers_pass
from sonar_fx.passes.reduce_grads import GraphReduce
from sonar_fx.passes.save_params import save_expert_params
from sonar_fx.runtime import registry
from sonar_fx.runtime.meter import ExpertGradMeter, meter_returned_grads

BackendCompiler = Literal["inductor", "aot_eager"]
Options = dict[str, Any] | None
"""`torch.compile(options=...)`: inductor settings by name."""
BackwardPass = Callable[..., GraphModule]
"""`(bw_gm, *, fw_gm, expert_inputs) -> bw_gm`: the production pass, or an ablation in tests."""
DYNAMO_SIGNALS = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)
"""Exceptions a backend raises to tell dynamo to trace again (`dynamic=True` tensorifies a float
scalar and restarts with `TensorifyScalarRestartAnalysis`) or to run the frame uncompiled: dynamo's
control flow, passed through, never taken for a compiler failure (a fallback would run the whole graph
eagerly, on the hooks, for what is only a request to trace it once more)."""

_SOURCES = (
    *sorted(str(p) for p in Path(insert_updates.__file__).parent.glob("*.py")),
    *sorted(str(p) for p in Path(sonar_fx.runtime.__file__).parent.glob("*.py")),
    __file__,
)


class SonarPartitioner(CustomPartitionerFn):
    """Default min-cut partition, then the expert-update pass on the backward graph; records what the
    pass left (expert gradients the graph still returns) for the saving guard."""

    def __init__(
        self,
        expert_inputs: Collection[int],
        *,
        bw_pass: BackwardPass = expert_update_pass,
        reduce: GraphReduce | None = None,
        save_params: bool = True,
        bw_knobs: dict[str, Any] | None = None,
    ) -> None:
        """`bw_knobs`: keyword arguments for `bw_pass`. `save_params=False` is the ablation that leaves
        an expert whose weight the partition did not save to the hooks (as before `save_expert_params`
        existed)."""
        self.expert_inputs = frozenset(expert_inputs)
        self.bw_pass = bw_pass
        self.reduce = reduce
        self.save_params = save_params
        self.bw_knobs = dict(bw_knobs or {})
        self.ran = False  # an inference graph (no grad needed) is never partitioned
        self.inserted = 0
        self.nested = 0
        """Nested subgraphs (a nested compile region) passed through unmapped."""
        self.returned: list[tuple[int, str]] = []
        """(input index, producer kind) of each expert gradient the backward graph still returns."""

    def __call__(self, gm: GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        self.ran = True
        primals = joint_inputs[0] if joint_inputs else None
        if self.bw_pass is expert_defer_pass and isinstance(primals, (list, tuple)):
            recompute_expert_gathers_pass(gm, self.expert_inputs)  # no weight moves before step()
        fw_gm, bw_gm = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        fw_inputs = fw_gm.graph.find_nodes(op="placeholder")
        if not isinstance(primals, (list, tuple)) or len(fw_inputs) != len(primals):
            # A nested subgraph: its inputs are not the dynamo graph's, so the input map does not apply.
            # Its expert gradients flow out to the enclosing graph, which the pass and the guard see.
            self.nested += 1
            return fw_gm, bw_gm
        if self.save_params:
            save_expert_params(fw_gm, bw_gm, self.expert_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"])
        knobs = {"reduce": self.reduce} if self.reduce is not None else {}
        knobs.update(self.bw_knobs)
        bw_gm = self.bw_pass(bw_gm, fw_gm=fw_gm, expert_inputs=self.expert_inputs, **knobs)
        self.inserted += len(bw_gm.meta["sonar_updates"])
        self.returned += returned_expert_grads(bw_gm, self.expert_inputs)
        return fw_gm, bw_gm

    def uuid(self) -> Any:
        bw_pass = f"{self.bw_pass.__module__}.{self.bw_pass.__qualname__}"
        knobs = f"{sorted(self.expert_inputs)}|{bw_pass}|{self.reduce}|{self.save_params}"
        knobs += f"|{sorted(self.bw_knobs.items())}"
        return get_hash_for_files(_SOURCES, knobs).hex()


@functools.cache
def sonar_backend(
    compiler: BackendCompiler = "inductor", *, fallback: bool = True, schedule: str | None = "in_backward"
) -> Callable[..., Callable[..., Any]]:
    """The dynamo backend for `compiler` and `schedule`. One object per setting, so every model compiled
    with the same setting shares dynamo's cache entries (graphs are reused across modules: binding is at
    run time), and none with another setting: dynamo's cache entries are guarded on their backend, so
    a graph rewritten for one schedule never runs for a model prepared with the other."""
    return make_sonar_backend(compiler, fallback=fallback, schedule=schedule)


def make_sonar_backend(
    compiler: BackendCompiler = "inductor",
    *,
    fallback: bool = True,
    bw_pass: BackwardPass = expert_update_pass,
    save_params: bool = True,
    schedule: str | None = None,
) -> Callable[..., Callable[..., Any]]:
    """A new dynamo backend; `bw_pass` replaces the backward pass and `save_params=False` drops the
    weight hand-over (ablations in tests and benchmarks). `schedule`: the pass for "in_backward" or
    "deferred" models; None (the registered "sonar" backend) takes the owning optimizer's."""
    if compiler not in ("inductor", "aot_eager"):
        raise ValueError(f"compiler={compiler!r}: the sonar backend compiles with 'inductor' or 'aot_eager'.")

    def backend(
        gm: GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: Options = None
    ) -> Callable[..., Any]:
        """`mode` and `options` are `torch.compile`'s, which hands them to a callable backend."""
        owners = expert_owners(example_inputs)
        if not owners:
            warn_unprepared(unbound_expert_inputs(gm))
        bound_inputs = list(owners)  # whatever updates them, their owners see each backward begin
        # An owner may stand for an optimizer (FSDP2's unsharded experts under the deferred schedule).
        stand_ins = (getattr(owner, "optimizer", owner) for owner in owners.values())
        optimizer = next((o for o in stand_ins if isinstance(o, SonarOptimizer)), None)
        reduce = graph_reduce(optimizer)
        reduction = optimizer.distributed if optimizer is not None else None
        if reduction is not None and reduction.in_graph == "hooks":
            owners = {}  # the engine reduces after the graph returns: the hooks update
        chosen, knobs = schedule_pass(optimizer, bw_pass, compiler, schedule)
        partitioner = SonarPartitioner(
            owners, bw_pass=chosen, reduce=reduce, save_params=save_params, bw_knobs=knobs
        )
        cache_hits = _aot_cache_hits()
        try:
            patches = _inductor_patches(compiler, mode, options)
            compiled = _compile(gm, example_inputs, compiler, partitioner if owners else None, patches)
        except DYNAMO_SIGNALS:
            raise  # dynamo restarts tracing (or skips the frame) itself: not a failure
        except Exception as err:
            if not fallback or optimizer is None:
                raise
            record_fallback(optimizer, err)
            return gm.forward
        if optimizer is not None:
            _record_compile(optimizer, partitioner, from_cache=_aot_cache_hits() > cache_hits)
        if bound_inputs:
            updated = updated_in_graph(partitioner, owners)
            compiled = mark_graph_backward(compiled, bound_inputs, updated_in_graph=updated)
        if not partitioner.returned:
            return compiled
        # Outside the fallback: a saving the user asked to be guarded is never traded for a silent one.
        guard_saving(partitioner, example_inputs, owners)
        return meter_returned_grads(compiled, [i for i, _ in partitioner.returned], meter_of)

    setattr(backend, SONAR_BACKEND_FLAG, True)  # prepare's forward hook traces to nothing under it
    return backend


def schedule_pass(
    optimizer: SonarOptimizer | None, bw_pass: BackwardPass, compiler: str, schedule: str | None
) -> tuple[BackwardPass, dict[str, Any]]:
    """The backward pass for `schedule` (None: the owner's): the deferred schedule hands operands over
    instead of updating (under inductor its op copies them, as inductor reuses buffers it considers
    dead, and a program computes in float32 what inductor's fused kernels keep in float32)."""
    if schedule is None:
        schedule = optimizer.schedule if optimizer is not None else "in_backward"
    if schedule != "deferred" or bw_pass is not expert_update_pass:
        return bw_pass, {}
    inductor = compiler == "inductor"
    return expert_defer_pass, {"own_operands": inductor, "fused_precision": inductor}


def updated_in_graph(partitioner: SonarPartitioner, owners: dict[int, object]) -> list[int]:
    """The expert inputs the graph's backward updates in place (the update pass, less the gradients it
    still returns to the hooks): a second forward of one before a backward is refused, and so is a
    backward that also feeds one from outside the graph (`mark_graph_backward`)."""
    if partitioner.bw_pass is not expert_update_pass:
        return []  # the deferred schedule moves no weight in backward; an ablation's pass is its own
    returned = {index for index, _ in partitioner.returned}
    return [index for index in owners if index not in returned]


_warned_unprepared = False


def warn_unprepared(unbound: Sequence[str]) -> None:
    """Once per process: a graph came to the sonar backend holding batched expert tensors (`unbound`,
    `unbound_expert_inputs`) that no Sonar optimizer owns (the model was never prepared), so it compiles
    as plain AOTAutograd and nothing is updated in backward. Decided by the graph's own tensors, whatever
    else is alive: a prepared model beside it changes nothing, and a graph holding no expert tensor (a
    prepared model's loss after a graph break) is not this."""
    global _warned_unprepared
    if _warned_unprepared or not unbound:
        return
    _warned_unprepared = True
    shown = ", ".join(unbound[:2]) + (f" and {len(unbound) - 2} more" if len(unbound) > 2 else "")
    warnings.warn(
        f"sonar backend: this graph holds {len(unbound)} batched expert tensor(s) that no Sonar optimizer "
        f"owns ({shown}), so it compiles as a plain torch.compile and none of them is updated in backward. "
        "Call opt = sonar_fx.prepare(model, cfg) before torch.compile(model, backend='sonar'), or use "
        "sonar_fx.compile(model, cfg); a model you do not train with Sonar needs no sonar backend.",
        stacklevel=2,
    )


def unbound_expert_inputs(gm: GraphModule) -> list[str]:
    """The parameter inputs of dynamo's graph `gm` that their module holds as batched experts, judged
    by shape alone (`batched_by_shape`, the discovery rule for a module that declares no expert count:
    the graph has no modules, only each input's source, which names the module it was read from). The
    caller asks only when none of the graph's inputs is a bound expert tensor."""
    by_module: dict[str, dict[str, tuple[int, ...]]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        source, value = getattr(arg, "source", None), getattr(arg, "example", None)
        if source is None or not isinstance(value, nn.Parameter) or isinstance(value, FakeTensor):
            continue
        # L['self']._modules['mlp']._parameters['w'] (modules inlined) or L['self'].mlp.w: "mlp.w"
        name = re.sub(r"\._(?:modules|parameters)\['([^']*)'\]", r".\1", source.name)
        name = re.sub(r"^L\['[^']*'\]\.?", "", name)
        module = name.rpartition(".")[0]
        by_module.setdefault(module, {})[name] = tuple(value.shape)
    return [name for shapes in by_module.values() for name in batched_by_shape(shapes)]


def guard_saving(
    partitioner: SonarPartitioner, example_inputs: Sequence[object], owners: dict[int, object]
) -> None:
    """Tell each owner which of its expert gradients this graph returns un-rewritten (the saving guard
    warns, or raises under on_saving_lost="raise")."""
    lost: dict[int, list[LostGradient]] = {}
    for index, kind in partitioner.returned:
        owner, param = owners.get(index), example_inputs[index]
        if isinstance(owner, SonarOptimizer) and isinstance(param, torch.Tensor):
            grad = LostGradient(
                name=owner.expert_name(param), kind=kind, nbytes=param.numel() * param.element_size()
            )
            lost.setdefault(id(owner), []).append(grad)
    by_id = {id(o): o for o in owners.values() if isinstance(o, SonarOptimizer)}
    for key, grads in lost.items():
        by_id[key].saving.graph_returns(grads, nested=partitioner.nested)


def meter_of(param: torch.Tensor) -> ExpertGradMeter | None:
    owner = registry.owner_of(param)
    return owner.meter if owner is not None else None


def expert_owners(example_inputs: Sequence[object]) -> dict[int, object]:
    """Input index -> owner, for the inputs that are bound expert parameters. A fake input (a subgraph
    of DDP's optimizer) counts when its fake mode made it from a bound parameter."""
    owners: dict[int, object] = {}
    fakes: dict[int, int] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, FakeTensor):
            fakes[id(x)] = i
        elif isinstance(x, torch.Tensor) and (owner := registry.owner_of(x)) is not None:
            owners[i] = owner
    modes = {id(x.fake_mode): x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)}
    for param, owner in registry.bound() if fakes else ():
        for mode in modes.values():
            fake = mode.fake_tensor_converter._get_memo(param)
            if fake is not None and id(fake) in fakes:
                owners[fakes[id(fake)]] = owner
    return owners


def graph_reduce(optimizer: SonarOptimizer | None) -> GraphReduce | None:
    """The all-reduce a graph applies to the experts of `optimizer` (data parallel), or None."""
    reduction = optimizer.distributed if optimizer is not None else None
    if reduction is None or reduction.in_graph != "all_reduce":
        return None
    if reduction.group_name is None:
        raise ValueError(f"{reduction.name}: in_graph='all_reduce' needs a process group name")
    return GraphReduce(reduction.group_name, reduction.world_size)


def _inductor_patches(compiler: str, mode: str | None, options: Options) -> dict[str, Any]:
    """Inductor's settings for `torch.compile(mode=..., options=...)`, as torch's own inductor backend
    derives them (`mode="reduce-overhead"`: CUDA graphs; the update op keeps itself out of them)."""
    if compiler != "inductor":
        if (mode or "default") != "default" or options:
            raise ValueError(f"mode={mode!r} and options= need compiler='inductor' (got {compiler!r})")
        return {}
    patches = dict(torch._inductor.list_mode_options(mode)) if (mode or "default") != "default" else {}
    return {**patches, **(options or {})}


def _compile(
    gm: GraphModule,
    example_inputs: list[Any],
    compiler: str,
    partitioner: SonarPartitioner | None,
    patches: dict[str, Any],
) -> Callable[..., Any]:
    if compiler == "aot_eager":
        partition_fn = partitioner or min_cut_rematerialization_partition
        backend = aot_autograd(
            fw_compiler=boxed_nop, partition_fn=partition_fn, keep_inference_input_mutations=True
        )
        return backend(gm, example_inputs)
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # Compile the backward now, not lazily at the first backward(), so that its failures reach the
    # fallback before any forward has run on this graph.
    with (
        inductor_config.patch(custom_partitioner_fn=partitioner),
        torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
    ):
        return cast(Callable[..., Any], compile_fx(gm, example_inputs, config_patches=patches))


def _aot_cache_hits() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


def _record_compile(optimizer: SonarOptimizer, partitioner: SonarPartitioner, *, from_cache: bool) -> None:
    # Served by inductor's AOTAutograd cache: compiled WITH the pass (the cache key holds the
    # partitioner's uuid) in an earlier process, so the partitioner did not run to count.
    compile_id = torch._guards.CompileContext.current_compile_id()
    optimizer.stats.record_graph(
        from_cache=from_cache,
        inserted=partitioner.inserted if partitioner.ran else None,
        recompile=compile_id is not None and (compile_id.frame_compile_id or 0) > 0,
    )


def record_fallback(optimizer: SonarOptimizer, err: Exception) -> str:
    """Note why compilation fell back to eager hooks; warn once per cause."""
    cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if optimizer.stats.record_fallback(cause):
        warnings.warn(
            f"sonar: compilation failed ({cause}); this graph runs eagerly and its expert tensors are "
            "updated by hooks. Pass fallback=False to raise instead.",
            stacklevel=2,
        )
    return cause


@torch._dynamo.register_backend(name="sonar")
def sonar(
    gm: GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: Options = None
) -> Callable[..., Any]:
    """`torch.compile(model, backend="sonar")` after `sonar_fx.prepare(model, cfg)`: inductor + the pass."""
    # The owner's schedule: a model prepared with schedule="deferred" gets the deferred pass.
    return sonar_backend("inductor", schedule=None)(gm, example_inputs, mode=mode, options=options)


setattr(sonar, SONAR_BACKEND_FLAG, True)
