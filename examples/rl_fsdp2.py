"""A GRPO-style RL post-training step with Sonar's deferred schedule, on FSDP2 (or DDP), under torchrun.

    torchrun --nproc-per-node 2 examples/rl_fsdp2.py                  # Sonar deferred on FSDP2
    torchrun --nproc-per-node 2 examples/rl_fsdp2.py --plain          # the same loop on plain FSDP2
    torchrun --nproc-per-node 2 examples/rl_fsdp2.py --compare        # both, then a side-by-side summary
    torchrun --nproc-per-node 2 examples/rl_fsdp2.py --parallel ddp   # DDP instead of FSDP2

The loop is the one RL trainers run: each rank samples completions of its prompts from the policy
(no-grad forwards), scores them with a verifiable reward, normalises the rewards within each group of
completions of one prompt (the advantages), and takes the old log-probs from a no-grad forward of the
policy and the reference log-probs from a frozen copy of the initial model (the KL term). Each optimizer
step then runs several micro-batches of the clipped (PPO-style ratio clip) policy loss, syncing gradients
only at the last micro-batch (`set_requires_gradient_sync(False)` on FSDP2, `no_sync()` on DDP), clips
once over every parameter (`clip_grad_norm_`), and skips the step when that norm is not finite. A
rollout serves `--steps-per-rollout` optimizer steps (the later ones see a policy that has moved, so the
ratio clip acts).

Sonar runs the same lines with `schedule="deferred"` and `expert_clip="global"`: backward keeps the
operands of each expert weight gradient, and `step()` computes each expert gradient, reduces it as the
engine would, clips it by the norm over every parameter, updates and frees it, one tensor at a time.
The weights are bitwise those of the plain loop, while no expert gradient piles up across micro-batches.
Everything is local and runs on CPU over gloo: a tiny transformers MoE built from its config
(`from_config`), prompts drawn from a seeded generator, completions sampled from the policy.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.distributed.fsdp import unsharded_params
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.memory import storage_bytes
from sonar_fx.models import build_model

Parallel = Literal["fsdp2", "ddp"]
LOWERCASE = (ord("a"), ord("z"))
"""The reward's target: byte ids of lowercase letters (the tiny models' vocabulary is bytes)."""


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """One GRPO run: the model, the rollouts, the loss and the engine."""

    parallel: Parallel = "fsdp2"
    """The engine: FSDP2 (`fully_shard`, each experts module its own group) or DDP."""
    plain: bool = False
    """Train with the plain engine and torch's fused AdamW instead of Sonar (the comparison)."""
    compiler: Literal["eager", "aot_eager", "inductor"] = "eager"
    """Sonar's compiler; the plain run compiles the same way (per block on FSDP2)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    model: str = "tiny-olmoe"
    layers: int = 4
    experts: int = 32
    """Experts per layer: expert gradients grow with it, the kept operands do not."""
    steps: int = 3
    steps_per_rollout: int = 2
    """Optimizer steps that reuse one rollout (its old log-probs): after the first the ratio moves."""
    prompts_per_rank: int = 2
    group_size: int = 4
    """Completions sampled per prompt; advantages are normalised within each group."""
    prompt_len: int = 8
    completion_len: int = 8
    micro_batches: int = 4
    """Micro-batches per optimizer step (of prompts_per_rank x group_size sequences per rank)."""
    lr: float = 1e-2
    weight_decay: float = 0.01
    max_grad_norm: float = 0.05
    """The clip over every parameter (small enough to act at the tiny model's norms)."""
    clip_eps: float = 0.2
    """PPO's ratio clip: the surrogate uses clamp(ratio, 1 - eps, 1 + eps)."""
    kl_beta: float = 0.04
    temperature: float = 1.0
    seed: int = 0
    inf_at_step: int | None = None
    """Make rank 0's loss infinite in this step (0-based), to show every rank skipping it."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]


@dataclass
class RunResult:
    """What one run did, per step and at its peak (this rank)."""

    losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    """The norm over every parameter before clipping, as `clip_grad_norm_` returns it."""
    skipped: list[int] = field(default_factory=list)
    expert_grad_peak: int = 0
    """The most expert-gradient bytes alive at once on this rank (sampled after each backward; Sonar's
    own meter through `step()` as well)."""
    kept_operand_peak: int = 0
    """Sonar: the most bytes of kept operands (what it holds instead of expert gradients)."""
    expert_bytes: int = 0
    """All expert tensors' bytes, unsharded (what the plain engine accumulates across micro-batches)."""
    biggest_expert: int = 0


@dataclass(frozen=True)
class Rollout:
    """One rank's scored completions: what every optimizer step of this rollout trains on."""

    sequences: Tensor  # (B, P + C) int64: prompt then completion
    mask: Tensor  # (B, P + C - 1) float: 1 where the next token is a completion token
    rewards: Tensor  # (B,) float32
    advantages: Tensor  # (B,) float32, normalised within each group
    old_logp: Tensor  # (B, P + C - 1) float32: the policy's log-probs at rollout time
    ref_logp: Tensor  # (B, P + C - 1) float32: the frozen reference's


# ------------------------------------------------------------------------------------ building


def build_run(cfg: RLConfig) -> tuple[nn.Module, nn.Module, Any]:
    """(the module the loop calls, the model, its optimizer), Sonar's or plain torch's."""
    torch._dynamo.reset()
    model = build_model(
        cfg.model, dtype=cfg.torch_dtype, seed=cfg.seed, num_hidden_layers=cfg.layers, num_experts=cfg.experts
    )
    if cfg.plain:
        return plain_run(cfg, model)
    opt_cfg = sonar_fx.AdamWConfig(
        lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, expert_clip="global"
    )
    build = sd.fsdp2 if cfg.parallel == "fsdp2" else sd.ddp
    run = build(model, opt_cfg, compiler=cfg.compiler, schedule="deferred", nonfinite="skip")
    return run, model, run.sonar


def plain_run(cfg: RLConfig, model: nn.Module) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """The plain engine over every parameter (FSDP2 laid out as Sonar lays it out) and fused AdamW."""
    run: Any
    if cfg.parallel == "fsdp2":
        run = sd.fully_shard_experts(model)
        if cfg.compiler != "eager":
            for block in cast(Any, model).model.layers:
                block.compile(backend=cfg.compiler)
    else:
        wrapped = DistributedDataParallel(model)
        run = wrapped if cfg.compiler == "eager" else torch.compile(wrapped, backend=cfg.compiler)
    defaults = sonar_fx.AdamWConfig()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=defaults.betas, eps=defaults.eps,
        weight_decay=cfg.weight_decay, fused=True,
    )  # fmt: skip
    return run, model, opt


def build_reference(cfg: RLConfig) -> nn.Module:
    """The frozen reference: the policy's initial weights, whole on every rank, never trained."""
    reference = build_model(
        cfg.model, dtype=cfg.torch_dtype, seed=cfg.seed, num_hidden_layers=cfg.layers, num_experts=cfg.experts
    )
    return reference.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------ rollouts


def token_logprobs(run: nn.Module, sequences: Tensor) -> Tensor:
    """log p(token t+1 | tokens <= t) for every position: (B, T - 1), float32."""
    logits = run(input_ids=sequences, use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def sample(run: nn.Module, prompts: Tensor, cfg: RLConfig, generator: torch.Generator) -> Tensor:
    """Append `completion_len` tokens sampled from the policy at `temperature` (no KV cache: tiny)."""
    sequences = prompts
    for _ in range(cfg.completion_len):
        logits = run(input_ids=sequences, use_cache=False).logits[:, -1].float()
        probs = torch.softmax(logits / cfg.temperature, dim=-1)
        sequences = torch.cat([sequences, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return sequences


def rewards_of(completions: Tensor) -> Tensor:
    """A verifiable reward: the share of completion tokens that are lowercase letters."""
    low, high = LOWERCASE
    return ((completions >= low) & (completions <= high)).float().mean(dim=1)


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std (+ 1e-4)."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)


@torch.no_grad()
def rollout(run: nn.Module, reference: nn.Module, cfg: RLConfig, step: int) -> Rollout:
    """Sample, score and take the old and reference log-probs of this rank's prompts."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + dist.get_rank())
    prompts = torch.randint(0, 256, (cfg.prompts_per_rank, cfg.prompt_len), generator=generator)
    sequences = sample(run, prompts.repeat_interleave(cfg.group_size, dim=0), cfg, generator)
    rewards = rewards_of(sequences[:, cfg.prompt_len :])
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1)
    mask[:, cfg.prompt_len - 1 :] = 1.0
    return Rollout(
        sequences=sequences,
        mask=mask,
        rewards=rewards,
        advantages=group_advantages(rewards, cfg.group_size),
        old_logp=token_logprobs(run, sequences),
        ref_logp=token_logprobs(reference, sequences),
    )


# ------------------------------------------------------------------------------------ the loss


def grpo_loss(logp: Tensor, batch: dict[str, Tensor], cfg: RLConfig, n_tokens: int) -> tuple[Tensor, Tensor]:
    """The clipped surrogate plus beta * KL to the reference (k3 estimator), summed over this
    micro-batch's completion tokens and divided by the rank's completion tokens in the whole step, so
    the micro-batches add up to the token mean. Returns (loss, tokens whose ratio was clipped)."""
    ratio = torch.exp(logp - batch["old_logp"])
    advantages = batch["advantages"][:, None]
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    log_ref_ratio = batch["ref_logp"] - logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
    per_token = -surrogate + cfg.kl_beta * kl
    mask = batch["mask"]
    return (per_token * mask).sum() / n_tokens, ((ratio != clipped).float() * mask).sum()


def micro_batches(data: Rollout, count: int) -> Iterator[dict[str, Tensor]]:
    fields = dict(
        sequences=data.sequences, mask=data.mask, advantages=data.advantages,
        old_logp=data.old_logp, ref_logp=data.ref_logp,
    )  # fmt: skip
    chunks = {name: t.chunk(count) for name, t in fields.items()}
    for i in range(count):
        yield {name: parts[i] for name, parts in chunks.items()}


def gradient_sync(run: Any, cfg: RLConfig, last: bool) -> contextlib.AbstractContextManager[Any]:
    """Sync gradients only at the last micro-batch: DDP's `no_sync()`, FSDP2's
    `set_requires_gradient_sync(False)` (then True for the last), the engines' accumulation recipe."""
    if cfg.parallel == "fsdp2":
        run.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    module = getattr(run, "_orig_mod", run)  # a torch.compile'd DDP wrapper
    return contextlib.nullcontext() if last else module.no_sync()


# ------------------------------------------------------------------------------------ the loop


def expert_grad_bytes_alive(model: nn.Module, experts: list[Tensor], cfg: RLConfig) -> int:
    """Bytes of expert gradients alive now on this rank: their `.grad` (an FSDP2 shard, or DDP's whole
    tensor) and, on FSDP2, the unsharded gradients it accumulates across unsynced micro-batches."""
    grads = [p.grad for p in experts if p.grad is not None]
    if cfg.parallel == "fsdp2":
        grads += [u.grad for u in unsharded_params(model, experts) if u.grad is not None]
    return storage_bytes(grads)


def optimizer_step(opt: Any, model: nn.Module, cfg: RLConfig) -> tuple[float, bool]:
    """Clip over every parameter, step unless the norm is not finite, zero the gradients.
    Returns (the norm before clipping, whether the step was skipped)."""
    if cfg.plain:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            opt.step()
        opt.zero_grad()
        return float(norm), skipped
    before = opt.report()["skipped_steps"]
    opt.step()  # Sonar: the same clip over every parameter; nonfinite="skip" skips the step on every rank
    opt.zero_grad()
    return opt.grad_norms()["total"], opt.report()["skipped_steps"] > before


def train_step(
    run: nn.Module,
    model: nn.Module,
    opt: Any,
    data: Rollout,
    cfg: RLConfig,
    step: int,
    result: RunResult,
    experts: list[Tensor],
) -> dict[str, float]:
    """One optimizer step over `cfg.micro_batches` micro-batches of `data`; `result` gets its memory."""
    n_tokens = int(data.mask.sum())
    loss_sum, clipped_tokens = 0.0, 0.0
    for i, batch in enumerate(micro_batches(data, cfg.micro_batches)):
        with gradient_sync(run, cfg, last=i == cfg.micro_batches - 1):
            loss, clipped = grpo_loss(token_logprobs(run, batch["sequences"]), batch, cfg, n_tokens)
            if step == cfg.inf_at_step and i == 0 and dist.get_rank() == 0:
                loss = loss * float("inf")
            loss.backward()
        loss_sum += float(loss.detach())
        clipped_tokens += float(clipped)
        result.expert_grad_peak = max(result.expert_grad_peak, expert_grad_bytes_alive(model, experts, cfg))
    if not cfg.plain:
        result.kept_operand_peak = max(result.kept_operand_peak, opt.deferred.live_bytes)
    norm, skipped = optimizer_step(opt, model, cfg)
    if not cfg.plain:  # Sonar's meter saw each expert gradient computed at step()
        measured = opt.report()["expert_grad_bytes"]["measured_peak"] or 0
        result.expert_grad_peak = max(result.expert_grad_peak, measured)
    return {"loss": loss_sum, "norm": norm, "skipped": float(skipped), "clip_frac": clipped_tokens / n_tokens}


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def train(cfg: RLConfig, *, log: bool = True) -> tuple[nn.Module, RunResult]:
    """Run `cfg.steps` optimizer steps on this rank's process group; (the trained model, what it did)."""
    run, model, opt = build_run(cfg)
    reference = build_reference(cfg)
    experts = list[Tensor](ExpertSet.discover(model).params)
    sizes = [p.numel() * p.element_size() for p in experts]  # a DTensor's numel: the whole tensor's
    result = RunResult(expert_bytes=sum(sizes), biggest_expert=max(sizes))
    data: Rollout | None = None
    for step in range(cfg.steps):
        if step % cfg.steps_per_rollout == 0:
            data = rollout(run, reference, cfg, step)
        assert data is not None
        stats = train_step(run, model, opt, data, cfg, step, result, experts)
        loss, reward = mean_over_ranks(stats["loss"]), mean_over_ranks(float(data.rewards.mean()))
        result.losses.append(loss)
        result.rewards.append(reward)
        result.norms.append(stats["norm"])
        if stats["skipped"]:
            result.skipped.append(step)
        if log and dist.get_rank() == 0:
            print(
                f"[{arm(cfg)}] step {step + 1}/{cfg.steps}  loss {loss:+.5f}  reward {reward:.3f}  "
                f"grad norm {stats['norm']:.4f}{'  SKIPPED (non-finite norm)' if stats['skipped'] else ''}"
                f"  ratio clipped {stats['clip_frac']:.1%}  expert grads alive (peak) "
                f"{result.expert_grad_peak / 1024:.1f} KiB",
                flush=True,
            )
    return model, result


def arm(cfg: RLConfig) -> str:
    return f"{'plain' if cfg.plain else 'sonar'} {cfg.parallel}"


# ------------------------------------------------------------------------------------ the command


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole (an FSDP2 shard gathered): what both runs are compared on."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def summary(results: dict[str, RunResult], bitwise: bool | None) -> str:
    """The runs side by side; with both, what Sonar saved (gradients, and net of its kept operands)."""

    def kib(n: int) -> str:
        return f"{n / 1024:.1f} KiB"

    widths = [12, 12, 11, 9, 21, 22]
    header = ["run", "final loss", "last norm", "skipped", "expert grads (peak)", "kept operands (peak)"]
    rows = [header]
    for name, r in results.items():
        rows.append(
            [name, f"{r.losses[-1]:+.5f}", f"{r.norms[-1]:.4f}", str(len(r.skipped)), kib(r.expert_grad_peak)]
        )
        rows[-1].append(kib(r.kept_operand_peak) if name.startswith("sonar") else "-")
    lines = [
        row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))
        for row in rows
    ]
    first = next(iter(results.values()))
    lines.append(
        f"expert tensors (whole): {kib(first.expert_bytes)}, the biggest {kib(first.biggest_expert)}"
    )
    if len(results) == 2:
        ours, plain = results.values()
        saved = plain.expert_grad_peak - ours.expert_grad_peak
        lines.append(
            f"saved per rank: {kib(saved)} of expert gradients, {kib(saved - ours.kept_operand_peak)} net"
        )
    if bitwise is not None:
        lines.append(f"weights bitwise equal to the plain run on every rank: {'yes' if bitwise else 'NO'}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[RLConfig, bool]:
    """The run's config from the command line, and whether to run both arms (--compare)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = RLConfig()
    parser.add_argument("--parallel", choices=["fsdp2", "ddp"], default=defaults.parallel)
    parser.add_argument("--plain", action="store_true", help="the plain engine and torch's AdamW")
    parser.add_argument("--compare", action="store_true", help="Sonar, then plain; compare the weights")
    parser.add_argument("--compiler", choices=["eager", "aot_eager", "inductor"], default=defaults.compiler)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=defaults.dtype)
    parser.add_argument("--model", choices=["tiny-olmoe", "tiny-qwen3moe"], default=defaults.model)
    for name, help_text in [
        ("layers", "decoder layers"),
        ("experts", "experts per layer"),
        ("steps", "optimizer steps"),
        ("steps_per_rollout", "optimizer steps per rollout"),
        ("prompts_per_rank", "prompts per rank per rollout"),
        ("group_size", "completions per prompt"),
        ("prompt_len", "prompt tokens"),
        ("completion_len", "sampled tokens per completion"),
        ("micro_batches", "micro-batches per optimizer step"),
        ("seed", "seed of the weights and the prompts"),
    ]:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name), help=help_text
        )
    for name in ("lr", "weight_decay", "max_grad_norm", "clip_eps", "kl_beta", "temperature"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--inf-at-step", type=int, default=None, help="make rank 0's loss inf at this step")
    args = vars(parser.parse_args(argv))
    compare = args.pop("compare")
    cfg = RLConfig(**args)
    if (cfg.prompts_per_rank * cfg.group_size) % cfg.micro_batches:
        parser.error("--micro-batches must divide --prompts-per-rank x --group-size")
    return cfg, compare


def main(argv: Sequence[str] | None = None) -> None:
    cfg, compare = parse_args(argv)
    dist.init_process_group("gloo")
    try:
        arms = [replace(cfg, plain=False), replace(cfg, plain=True)] if compare else [cfg]
        results, weights = {}, []
        for arm_cfg in arms:
            model, results[arm(arm_cfg)] = train(arm_cfg)
            weights.append(full_weights(model))
        bitwise = None
        if compare:  # every rank compares its copy of the full tensors; all must agree
            same = all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
            flag = torch.tensor([int(same)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            bitwise = bool(flag)
        if dist.get_rank() == 0:
            print(summary(results, bitwise), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
