"""A multi-node run, simulated on this machine: two `torchrun --nnodes 2 --nproc-per-node 1` launches (two
"nodes", static rendezvous on 127.0.0.1), fine-tuning with `--parallel fsdp2`. Node 1 is killed in
step 3 (SIGKILL, after the step-2 checkpoint; node 0 then fails on its next collective), both nodes
resume from the checkpoint, and the final weights on every rank are bitwise those of an uninterrupted
two-node run. FSDP2 because every rank writes its own shard (`checkpoint.rank1.pt` comes from the
other node); what differs between nodes (RANK, not LOCAL_RANK, names a rank) is the same code on
every engine, whose resume on one node tests/test_distributed_cli.py checks. The run uses Lion and the
per-tensor expert clip, so their checkpoint and resume are covered too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.subprocess]

TESTS = Path(__file__).parent
FLAGS = ["--parallel", "fsdp2", "--optimizer", "lion", "--lr", "1e-3", "--expert-clip", "per_tensor"]
ARGS = ["--model", "tiny-reference", "--compiler", "eager", "--train-size", "16", "--held-out", "4",
        "--steps", "4", "--save-every", "2", "--no-progress", "--max-grad-norm", "0.05"]  # fmt: skip


def two_nodes(out: Path, *extra: str, kill_node_1_in_step: int | None = None) -> list[Node]:
    """Launch both nodes and wait for both; returns what each did (node 0, node 1)."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    launches = []
    for node in (0, 1):
        rendezvous = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port]
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            *rendezvous,
        ]
        if node == 1 and kill_node_1_in_step is not None:
            program = [str(TESTS / "fault_child.py"), "kill-in-step", str(kill_node_1_in_step)]
        else:
            program = ["-m", "sonar_fx"]
        argv = [
            *torchrun,
            *program,
            "finetune",
            *ARGS,
            *FLAGS,
            "--out",
            str(out),
        ]
        launches.append(
            subprocess.Popen([*argv, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    nodes = []
    for launch in launches:
        try:
            log, _ = launch.communicate(timeout=300)
        finally:
            launch.kill()  # a node that outlived the timeout (a hung collective) ends here
        nodes.append(Node(launch.wait(), log.decode(errors="replace")[-2000:]))
    return nodes


def free_port() -> int:
    """A loopback port free now: torchrun's static rendezvous is a TCP store on node 0 (a file store,
    as `distributed_worker` uses, is no rendezvous torchrun offers across nodes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Node:
    code: int
    log: str


def weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0's shard is in checkpoint.pt, every other rank's in its own file."""
    name = "checkpoint.pt" if rank == 0 else f"checkpoint.rank{rank}.pt"
    return torch.load(out / name, weights_only=True)["model"]


def test_two_nodes_killed_and_resumed_equal_an_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    nodes = two_nodes(straight)
    assert [n.code for n in nodes] == [0, 0], nodes
    nodes = two_nodes(resumed, kill_node_1_in_step=3)
    assert nodes[0].code != 0 and nodes[1].code != 0, nodes  # node 1 killed, node 0 lost its peer
    at_2 = [weights(resumed, r) for r in (0, 1)]
    nodes = two_nodes(resumed, "--resume")
    assert [n.code for n in nodes] == [0, 0], nodes
    assert json.loads((resumed / "summary.json").read_text())["resumed_from_step"] == 2
    for rank in (0, 1):
        final, reference = weights(resumed, rank), weights(straight, rank)
        assert [k for k in reference if not torch.equal(reference[k], final[k])] == [], rank
        assert any(not torch.equal(at_2[rank][k], final[k]) for k in final), (
            rank
        )  # control: steps 3-4 trained
