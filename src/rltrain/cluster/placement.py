"""Which node holds which process: role bundles, a placement forecast, shortfall messages.

Pure (no Ray): :func:`role_bundles` turns a RunPlan into one placement group
per role; :func:`place` forecasts where Ray's PACK / SPREAD strategies put each
bundle on a list of nodes, and raises a ConfigError that says what is missing
when a role cannot fit, so a run fails at once instead of pending on a
placement group that can never be satisfied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rltrain.config.errors import ConfigError
from rltrain.config.schema import ClusterConfig
from rltrain.plan import RunPlan

# Ray bookkeeping resources that are not worth showing or matching on.
_HIDDEN_PREFIXES = ("node:", "accelerator_type:", "memory", "object_store_memory")
EPS = 1e-9


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster and its total resources (CPU, GPU, custom)."""

    node_id: str
    ip: str
    resources: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


@dataclass(frozen=True)
class RoleBundles:
    """One role's placement group: a bundle per process, in rank order, and its strategy."""

    role: str
    bundles: list[dict[str, float]]
    strategy: str  # PACK | SPREAD (Ray placement-group strategies)


def visible(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources, without Ray's bookkeeping entries; whole numbers as int."""
    out: dict[str, float] = {}
    for k, v in sorted(resources.items()):
        if k.startswith(_HIDDEN_PREFIXES) or v <= 0:
            continue
        out[k] = int(v) if float(v).is_integer() else round(v, 4)
    return out


def role_bundles(plan: RunPlan, cluster: ClusterConfig) -> list[RoleBundles]:
    """The placement groups of a run: trainer gangs first (the hardest to fit), then rollout."""
    strategy = "SPREAD" if cluster.placement == "spread" else "PACK"
    # Trainer gangs (policy, PPO's value) take the policy's markers; rollout its own.
    extras = {"rollout": cluster.rollout_resources}
    order = {"policy": 0, "value": 1, "rollout": 2}
    out = []
    for role in sorted(plan.roles, key=lambda r: order.get(r.name, 3)):
        bundle = {k: float(v) for k, v in role.bundle.items() if v > 0}
        extra = extras.get(role.name, cluster.policy_resources)
        bundle.update({k: float(v) for k, v in extra.items()})
        out.append(RoleBundles(role.name, [dict(bundle) for _ in range(role.world_size)], strategy))
    return out


def _fits(free: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in bundle.items())


def _take(free: dict[str, float], bundle: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def describe_nodes(nodes: list[NodeInfo]) -> str:
    """'2 nodes x {CPU: 16, GPU: 4}, 1 node x {CPU: 8}' (identical nodes grouped)."""
    counts = Counter(tuple(visible(n.resources).items()) for n in nodes)
    parts = []
    for res, n in counts.items():
        body = ", ".join(f"{k}: {v}" for k, v in res) or "no resources"
        parts.append(f"{n} node{'s' if n > 1 else ''} x {{{body}}}")
    return ", ".join(parts) if parts else "no nodes"


def _shortfall(rb: RoleBundles, nodes: list[NodeInfo], placed: list[str]) -> ConfigError:
    bundle = visible(rb.bundles[0])
    n = len(rb.bundles)
    totals = {k: round(v * n, 4) for k, v in rb.bundles[0].items()}
    needs = ", ".join(f"{visible({k: v}).get(k, v)} {k}" for k, v in totals.items())
    missing = [k for k in rb.bundles[0] if not any(k in node.resources for node in nodes)]
    if missing:
        key = "cluster.policy_resources" if rb.role == "policy" else "cluster.rollout_resources"
        fix = (
            f"no node offers {', '.join(repr(m) for m in missing)}: start a node with "
            f"`ray start --resources='{{\"{missing[0]}\": 1}}'` or remove it from {key}"
        )
    elif rb.role == "policy":
        fix = "add nodes, or lower dtensor.dp / dtensor.tp"
    else:
        fix = "add nodes, or lower rollout.replicas / rollout.tp"
    before = f" after {', '.join(placed)}" if placed else ""
    return ConfigError(
        f"{rb.role} needs {n} process(es) of {bundle} ({needs}) in one placement group; "
        f"the cluster has {describe_nodes(nodes)}{before}; {fix}."
    )


def place(roles: list[RoleBundles], nodes: list[NodeInfo]) -> dict[str, list[NodeInfo]]:
    """Forecast the node of every bundle (role -> nodes in rank order); ConfigError on a shortfall.

    PACK puts a whole role on one node when some node has room for all of it,
    else fills the roomiest nodes first; SPREAD gives each next process the
    node holding the fewest processes of its role. Roles are placed in order,
    each taking resources from the nodes before the next is placed.
    """
    free = {n.node_id: dict(n.resources) for n in nodes}
    out: dict[str, list[NodeInfo]] = {}
    placed: list[str] = []
    for rb in roles:
        chosen: list[NodeInfo] = []
        if rb.strategy == "PACK":
            whole = next((n for n in nodes if _all_fit(free[n.node_id], rb.bundles)), None)
            if whole is not None:
                for b in rb.bundles:
                    _take(free[whole.node_id], b)
                    chosen.append(whole)
        if not chosen:
            per_role: Counter[str] = Counter()
            for b in rb.bundles:
                fitting = [n for n in nodes if _fits(free[n.node_id], b)]
                if not fitting:
                    raise _shortfall(rb, nodes, placed)
                if rb.strategy == "SPREAD":
                    node = min(fitting, key=lambda n: per_role[n.node_id])
                else:  # PACK that spills over: stay on a node the role already uses
                    node = max(fitting, key=lambda n: (per_role[n.node_id], _room(free[n.node_id])))
                _take(free[node.node_id], b)
                per_role[node.node_id] += 1
                chosen.append(node)
        out[rb.role] = chosen
        placed.append(f"{rb.role} took {len(rb.bundles)} x {visible(rb.bundles[0])}")
    return out


def _all_fit(free: dict[str, float], bundles: list[dict[str, float]]) -> bool:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return _fits(free, need)


def _room(free: dict[str, float]) -> tuple[float, float]:
    return free.get("GPU", 0.0), free.get("CPU", 0.0)


def placement_rows(placement: dict[str, list[NodeInfo]]) -> dict[str, list[str]]:
    """role -> node label per rank, for plan.json and the plan tree."""
    return {role: [n.label for n in nodes] for role, nodes in placement.items()}
