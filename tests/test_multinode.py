"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): roles land where they are pinned.

The simulated cluster lives in a helper process of its own, so this test
never touches the session's Ray connection; the run attaches to it through
the CLI (`cluster=ray cluster.address=...`) the way a real multi-node run does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 * 2**20}


def serve_cluster() -> None:
    """Helper process: a head marked trainer_node and two nodes marked rollout_node.

    Prints the address and node ids as one JSON line, then holds the cluster
    until its stdin closes.
    """
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={**NODE_ARGS, "resources": {"trainer_node": 1}},
    )
    workers = [cluster.add_node(**NODE_ARGS, resources={"rollout_node": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    info = {
        "address": cluster.address,
        "head": cluster.head_node.node_id,
        "workers": [w.node_id for w in workers],
    }
    print(json.dumps(info), flush=True)
    sys.stdin.read()
    cluster.shutdown()


@pytest.fixture
def three_nodes():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import tests.test_multinode as t; t.serve_cluster()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line, "the simulated cluster did not start"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.timeout(600)
def test_grpo_across_three_nodes_learns(three_nodes, tmp_path):
    """Trainer on the head node, one rollout replica on each other node; the run learns."""
    out = tmp_path / "multinode"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.cli",
            "grpo",
            "cluster=ray",
            f"cluster.address={three_nodes['address']}",
            "+cluster.policy_resources.trainer_node=0.01",
            "+cluster.rollout_resources.rollout_node=0.01",
            "cluster.placement=spread",
            "cluster.torch_threads=1",
            "rollout.replicas=2",
            "max_steps=30",
            f"output_dir={out}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "checkpoint.save_final=false",
        ],
        capture_output=True,
        text=True,
        timeout=560,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    placement = json.loads((out / "plan.json").read_text())["placement"]
    node_of = {
        role: [re.search(r"\((\w+)\)", w).group(1) for w in where]
        for role, where in placement.items()
    }
    assert three_nodes["head"].startswith(node_of["policy"][0])
    assert sorted(node_of["rollout"]) == sorted(w[:8] for w in three_nodes["workers"])
    assert "rollout: rank 0 on" in proc.stdout  # the run start says which node holds which role

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and rows[-1]["weight_version"] == 30.0
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)
