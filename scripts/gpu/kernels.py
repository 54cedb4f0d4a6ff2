"""The prepared GPU check for the expert kernel backends: numerics, exactness and memory per backend.

    python -m scripts.gpu.kernels                      # H200: every backend that can run there
    python -m scripts.gpu.kernels --device cpu --tiny  # CPU smoke: torch + scattermoe (interpreted)

Run as a script with `--device cpu`, it switches Triton's interpreter on (TRITON_INTERPRET=1) before
anything imports triton: torch._dynamo imports it, and triton.language binds its own jitted helpers
(which upstream ScatterMoE kernels call) to interpreter or compiler at that moment.

For every backend (torch, scattermoe, sonicmoe) that can run here:
1. numerics: the expert block's output and its gradients (hidden, routing weights, w_up, w_down)
   against the fp32 loop reference and against the torch backend, at tiny and full-size layer shapes;
2. exactness: Sonar against standard training that clips only dense gradients, with the SAME backend
   and execution mode, compared bitwise on every weight after a few steps (eager hooks, aot_eager or
   inductor pass);
3. memory: peak memory of one training step of both, and the saving against one layer of expert grads.
A backend that cannot run (missing package, GPU too old), or cannot run a dtype (sonic-moe: no fp32),
is listed with the reason; fp32 numerics state the backend's fp32 matmul precision (upstream
ScatterMoE forces TF32; the others follow torch's TF32 switch, IEEE by default). This script
measures and reports; it never asserts (the tests do) and never changes the models it measures beyond
selecting their kernel backend. On CUDA it turns on deterministic algorithms and eager attention so
that two runs of the same arithmetic are bitwise equal, which the exactness check needs.
"""

# ruff: noqa: E402 (the interpreter switch below must precede every import of torch)
from __future__ import annotations

import argparse
import os
import signal
import sys


def _interpreter_before_triton(argv: list[str]) -> None:
    """`--device cpu` runs Triton kernels interpreted: say so before torch imports triton."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda")
    if pre.parse_known_args(argv)[0].device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


if __name__ == "__main__":
    _interpreter_before_triton(sys.argv[1:])

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import common
from sonar_fx.config import AdamWConfig
from sonar_fx.environment import Environment
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.experts.kernels import (
    BACKENDS,
    BackendUnavailableError,
    ExpertLayout,
    experts_forward,
    get_backend,
    use_kernel_backend,
)
from sonar_fx.experts.kernels.scattermoe import fp32_matmul_precision
from sonar_fx.experts.kernels.scattermoe import implementation as scattermoe_implementation
from sonar_fx.experts.kernels.torch_backend import experts_forward_ref
from sonar_fx.measure import ArmResult, measure_arm
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.methods import build_method
from sonar_fx.models import build_model

SCRIPT = "gpu_kernels"
MODULE = "scripts.gpu.kernels"
# Layer shapes: T tokens (batch 2 x seq 256 on GPU), k top-k, E experts, d width, n expert width.
LAYER_SHAPES = {
    "tiny": dict(t=64, k=2, e=8, d=64, n=32),
    "olmoe": dict(t=512, k=8, e=64, d=2048, n=1024),
    "granite": dict(t=512, k=8, e=40, d=1536, n=512),
}
# OLMoE-1B-7B layer shapes with fewer layers, so every arm fits the device-time budget.
GPU_MODEL = dict(
    hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=50304, attn_implementation="eager",
)  # fmt: skip
OPT = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)
GRADS = ("out", "d_hidden", "d_weights", "d_w_up", "d_w_down")


@dataclass(frozen=True, kw_only=True)
class Config:
    device: str
    tiny: bool
    backends: tuple[str, ...]
    steps: int
    """Training steps per exactness arm (the last one is the measured step)."""
    layers: int
    """MoE layers of the GPU model (OLMoE layer shapes)."""
    compilers: tuple[str, ...]
    seed: int


@dataclass(frozen=True, kw_only=True)
class Numerics:
    backend: str
    implementation: str
    dtype: str
    shape: str
    matmul: str
    """How the backend's GEMMs multiply this dtype: "tf32" or "ieee" for fp32, else the dtype."""
    rel_err: dict[str, float]
    """max |backend - fp32 reference| / max |reference|, per output and gradient."""
    vs_torch_max_abs: dict[str, float]
    """max |backend - torch backend| in the same dtype (0 for torch itself)."""


@dataclass(frozen=True, kw_only=True)
class Exactness:
    backend: str
    compiler: str
    dtype: str
    steps: int
    tensors: int
    differing: list[str]
    """Weights that are not bitwise equal to standard_no_expert_clip's (empty: exact)."""
    max_abs_diff: float
    updates_in_graph: int
    updates_by_hook: int
    standard_peak_mib: float
    sonar_peak_mib: float
    expert_grad_mib_per_layer: float
    layers: int


def layer_problem(shape: dict[str, int], dtype: torch.dtype, device: str, seed: int):
    """Leaves (hidden, routing weights, w_up (E, 2n, d), w_down (E, d, n)) and top-k indices."""
    g = torch.Generator().manual_seed(seed)
    t, k, e, d, n = (shape[key] for key in ("t", "k", "e", "d", "n"))
    index_Tk = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    fp32 = [
        torch.randn(t, d, generator=g),
        torch.softmax(torch.randn(t, k, generator=g), dim=-1),
        torch.randn(e, 2 * n, d, generator=g) * d**-0.5,
        torch.randn(e, d, n, generator=g) * n**-0.5,
    ]
    return [x.to(device, dtype).requires_grad_() for x in fp32], index_Tk.to(device)


def outputs_and_grads(fn, leaves: list[Tensor], index_Tk: Tensor) -> list[Tensor]:
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = fn(leaves[0], index_Tk, *leaves[1:])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * grad_out).sum().backward()
    return [out.detach().float()] + [x.grad.float() for x in leaves]  # type: ignore[union-attr]


def check_numerics(cfg: Config, backend: str, dtype: torch.dtype, shape_name: str) -> Numerics:
    leaves, index_Tk = layer_problem(LAYER_SHAPES[shape_name], dtype, cfg.device, cfg.seed)
    layout = ExpertLayout()
    got = outputs_and_grads(lambda *a: experts_forward(backend, *a), leaves, index_Tk)
    ref = outputs_and_grads(
        lambda h, i, w, up, down: experts_forward_ref(h, i, w, up, down, layout),
        [x.detach().float() for x in leaves],
        index_Tk,
    )
    base = outputs_and_grads(lambda *a: experts_forward("torch", *a), leaves, index_Tk)
    rel = {n: ((g - r).abs().max() / r.abs().max()).item() for n, g, r in zip(GRADS, got, ref, strict=True)}
    vs_torch = {n: (g - b).abs().max().item() for n, g, b in zip(GRADS, got, base, strict=True)}
    return Numerics(
        backend=backend, implementation=_implementation(backend), dtype=str(dtype).removeprefix("torch."),
        shape=shape_name, matmul=_matmul(backend, dtype), rel_err=rel, vs_torch_max_abs=vs_torch,
    )  # fmt: skip


def _implementation(backend: str) -> str:
    return scattermoe_implementation() if backend == "scattermoe" else backend


def _matmul(backend: str, dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return str(dtype).removeprefix("torch.")
    if backend == "scattermoe":
        return fp32_matmul_precision()
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def build(cfg: Config, dtype: torch.dtype) -> nn.Module:
    if cfg.tiny:
        return build_model("tiny-olmoe", dtype=dtype, seed=cfg.seed).to(cfg.device)
    with torch.device(cfg.device):  # initialise on the GPU: a CPU init of these shapes takes minutes
        return build_model(
            "tiny-olmoe", dtype=dtype, seed=cfg.seed, num_hidden_layers=cfg.layers, **GPU_MODEL
        )


def batches(cfg: Config, vocab: int) -> list[dict[str, Tensor]]:
    batch, seq = (2, 16) if cfg.tiny else (2, 256)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = [torch.randint(0, vocab, (batch, seq), generator=g).to(cfg.device) for _ in range(cfg.steps)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def train(cfg: Config, backend: str, method: str, compiler: str, dtype: torch.dtype):
    """(model, TrainingMethod, peak bytes of the last step) after `cfg.steps` steps."""
    torch._dynamo.reset()
    model = build(cfg, dtype)
    use_kernel_backend(model, backend)
    run = build_method(method, model, OPT, compiler=compiler)
    data = batches(cfg, int(getattr(model.config, "vocab_size")))  # noqa: B009 (typed Module | Tensor)
    label = f"{method} · {backend} · {compiler}"
    result = measure_arm(ArmResult(label=label), run.train_step, data[:-1], data[-1], device=cfg.device)
    if result.error is not None:
        raise RuntimeError(result.error)
    return model, run, result.peak_bytes


def check_exactness(cfg: Config, backend: str, compiler: str, dtype: torch.dtype) -> Exactness:
    # standard_no_expert_clip runs in the same mode, except that the aot_eager pass is compared with
    # eager (both run the same aten ops); inductor is compared with inductor.
    twin_compiler = "eager" if compiler == "aot_eager" else compiler
    twin, _, twin_peak = train(cfg, backend, "standard_no_expert_clip", twin_compiler, dtype)
    sonar, run, sonar_peak = train(cfg, backend, "sonar", compiler, dtype)
    mine, theirs = dict(sonar.named_parameters()), dict(twin.named_parameters())
    differing = [name for name, p in mine.items() if not torch.equal(p, theirs[name])]
    max_diff = max(((mine[n] - theirs[n]).abs().max().item() for n in differing), default=0.0)
    layers = discover_experts(sonar)
    report = run.optimizer.report()
    return Exactness(
        backend=backend, compiler=compiler, dtype=str(dtype).removeprefix("torch."), steps=cfg.steps,
        tensors=len(mine), differing=differing, max_abs_diff=max_diff,
        updates_in_graph=report["updates_in_graph"], updates_by_hook=report["updates_by_hook"],
        standard_peak_mib=common.mib(twin_peak), sonar_peak_mib=common.mib(sonar_peak),
        expert_grad_mib_per_layer=common.mib(ExpertGradBytes.of(layers).one_layer), layers=len(layers),
    )  # fmt: skip


def unavailable(cfg: Config, backend: str, dtype: torch.dtype) -> str | None:
    """Why `backend` cannot run `dtype` here (missing package, old GPU, unsupported dtype), or None."""
    try:
        get_backend(backend).check(torch.device(cfg.device), dtype)
    except (BackendUnavailableError, ValueError) as err:
        return str(err)
    return None


class TimeLimit(BaseException):
    """SIGTERM (a `timeout` around the script): stop measuring, but still write what was measured."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise TimeLimit


def run_checks(cfg: Config) -> tuple[list[Numerics], list[Exactness], dict[str, str], dict[str, str]]:
    numerics: list[Numerics] = []
    exactness: list[Exactness] = []
    failures: dict[str, str] = {}
    missing: dict[str, str] = {}
    try:
        _run_checks(cfg, numerics, exactness, failures, missing)
    except TimeLimit:
        failures["time limit"] = "stopped by SIGTERM; the checks after the last row were not run"
    return numerics, exactness, missing, failures


def _run_checks(
    cfg: Config, numerics: list[Numerics], exactness: list[Exactness], failures: dict, missing: dict
) -> None:
    dtypes = [torch.float32] if cfg.device == "cpu" else [torch.bfloat16, torch.float32]
    shapes = ["tiny"] if cfg.tiny else list(LAYER_SHAPES)
    for backend in cfg.backends:
        runnable = []
        for dtype in dtypes:
            reason = unavailable(cfg, backend, dtype)
            if reason is not None:  # skipped with the reason, never run into a kernel that cannot take it
                missing[f"{backend} {str(dtype).removeprefix('torch.')}"] = reason
                continue
            runnable.append(dtype)
            for shape in shapes:
                key = f"numerics {backend} {dtype} {shape}"
                _attempt(key, failures, numerics, partial(check_numerics, cfg, backend, dtype, shape))
        for compiler in cfg.compilers if runnable else ():
            key = f"exactness {backend} {compiler}"
            _attempt(key, failures, exactness, partial(check_exactness, cfg, backend, compiler, runnable[0]))


def _attempt(key: str, failures: dict[str, str], results: list, fn) -> None:
    """Run one check; a failure is recorded with its cause and the other checks go on."""
    print(f"... {key}", flush=True)
    try:
        results.append(fn())
    except Exception as err:  # a broken backend must not hide the results of the others
        failures[key] = f"{type(err).__name__}: {err}"
        print(f"    FAILED: {failures[key]}", flush=True)


def tables(numerics: list[Numerics], exactness: list[Exactness], missing, failures) -> list[common.Table]:
    num_rows = [
        [r.backend, r.implementation, r.dtype, r.matmul, r.shape]
        + [f"{r.rel_err[g]:.1e}" for g in GRADS]
        + [f"{max(r.vs_torch_max_abs.values()):.1e}"]
        for r in numerics
    ]
    ex_rows = [_exactness_row(r) for r in exactness]
    out = [
        common.Table(
            title="Numerics against the fp32 reference",
            headers=[
                "backend",
                "kernels",
                "dtype",
                "matmul",
                "shape",
                *[f"rel {g}" for g in GRADS],
                "max|vs torch|",
            ],
            rows=num_rows,
            note="rel: max abs error / max abs value of the fp32 loop reference; vs torch: same dtype. "
            "matmul: tf32 or ieee for fp32 GEMMs (upstream ScatterMoE hard-codes TF32).",
        ),
        common.Table(
            title="Exactness and memory: sonar vs standard_no_expert_clip, same backend and mode",
            headers=[
                "backend",
                "mode",
                "dtype",
                "steps",
                "bitwise",
                "upd graph/hook",
                "std MiB",
                "sonar MiB",
                "saved MiB",
                "saved / layer grads",
            ],
            rows=ex_rows,
            note="Peaks of the last step; expected saving ~ (L - 1) layers of expert gradients.",
        ),
    ]
    problems = [[k, v[:160]] for k, v in {**missing, **failures}.items()]
    if problems:
        out.append(common.Table(title="Not run or failed", headers=["what", "why"], rows=problems))
    return out


def _exactness_row(r: Exactness) -> list[str]:
    saved = r.standard_peak_mib - r.sonar_peak_mib
    bitwise = "yes" if not r.differing else f"NO: {len(r.differing)}/{r.tensors} (max {r.max_abs_diff:.1e})"
    return [
        r.backend, r.compiler, r.dtype, str(r.steps), bitwise, f"{r.updates_in_graph}/{r.updates_by_hook}",
        _mib(r.standard_peak_mib), _mib(r.sonar_peak_mib), _mib(saved),
        f"{saved / max(r.expert_grad_mib_per_layer, 1e-9):.2f}",
    ]  # fmt: skip


def _mib(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def configure(args: Any) -> Config:
    if args.device == "cpu":
        if not args.tiny:
            raise SystemExit("--device cpu runs only the --tiny smoke mode (add --tiny).")
        # Run as a script, this was set before triton was imported (see the module docstring); called
        # in-process, the project's own kernels still follow it (they are jitted per mode at call time).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run with --device cpu --tiny for the CPU smoke mode.")
    else:
        # Bitwise comparisons need run-to-run determinism (cuBLAS workspace, no atomics in backward).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    backends = tuple(b for b in args.backends if b in BACKENDS) if args.backends else tuple(BACKENDS)
    if args.device == "cpu":
        backends = tuple(b for b in backends if b != "sonicmoe")
    compilers = ("eager", "aot_eager") if args.device == "cpu" else ("eager", "inductor")
    steps = 2 if args.quick or args.tiny else 3
    return Config(
        device=args.device, tiny=args.tiny or args.device == "cpu", backends=backends, steps=steps,
        layers=args.layers, compilers=tuple(args.compilers or compilers), seed=args.seed,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = common.parser(MODULE, __doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes only (the CPU smoke mode)")
    p.add_argument("--backends", nargs="*", choices=list(BACKENDS), help="default: all")
    p.add_argument("--compilers", nargs="*", choices=["eager", "aot_eager", "inductor"])
    p.add_argument("--layers", type=int, default=2, help="MoE layers of the GPU model (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.setup(args)
    cfg = configure(args)
    inv = common.Invocation(
        script=SCRIPT, command=common.command(MODULE, argv), args=args, cfg=cfg,
        env=Environment.now(cfg.device),  # date and load at the start, as `Environment` documents
    )  # fmt: skip
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    numerics, exactness, missing, failures = run_checks(cfg)
    inv.finish(
        tables(numerics, exactness, missing, failures),
        records=[{"numerics": asdict(r)} for r in numerics] + [{"exactness": asdict(r)} for r in exactness],
    )


if __name__ == "__main__":
    main()
