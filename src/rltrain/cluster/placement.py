"""Which node holds which process: role bundles, a placement forecast, shortfall messages.

Pure (no Ray): :func:`role_bundles` turns a RunPlan into placement groups: one
per role, except that roles sharing GPUs (``RunPlan.gpu_layout``) share one
group with a bundle per GPU, each process asking for its fraction of its
bundle's GPU, so Ray gives every process of one bundle the same GPU id;
:func:`place` forecasts where Ray's PACK / SPREAD strategies put each bundle
on a list of nodes, and raises a ConfigError that says what is missing when a
role cannot fit, so a run fails at once instead of pending on a placement
group that can never be satisfied.
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
# Trainer gangs first (the hardest to fit), then the rollout pool.
ROLE_ORDER = {"policy": 0, "value": 1, "rollout": 2, "reference": 3}


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
class Slot:
    """One process in a placement group: its role and rank, its bundle, what it asks for."""

    role: str
    rank: int
    bundle_index: int
    resources: dict[str, float]


@dataclass(frozen=True)
class RoleBundles:
    """One placement group: its bundles, its strategy and the processes in them.

    A role's own group (``slots`` empty) holds one process per bundle, rank
    order, each asking for its whole bundle. A shared group ("policy+rollout")
    holds a bundle per GPU and lists its processes in ``slots``.
    """

    role: str
    bundles: list[dict[str, float]]
    strategy: str  # PACK | SPREAD (Ray placement-group strategies)
    slots: tuple[Slot, ...] = ()

    def processes(self) -> list[Slot]:
        """Every process of the group with its bundle and request."""
        if self.slots:
            return list(self.slots)
        return [Slot(self.role, i, i, dict(b)) for i, b in enumerate(self.bundles)]


def visible(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources, without Ray's bookkeeping entries; whole numbers as int."""
    out: dict[str, float] = {}
    for k, v in sorted(resources.items()):
        if k.startswith(_HIDDEN_PREFIXES) or v <= 0:
            continue
        out[k] = int(v) if float(v).is_integer() else round(v, 4)
    return out


def role_bundles(plan: RunPlan, cluster: ClusterConfig) -> list[RoleBundles]:
    """The placement groups of a run: trainer gangs first (the hardest to fit), then rollout.

    Roles that share GPUs (``plan.gpu_layout``) come first, in one group with a
    bundle per policy rank's GPU: policy rank i, value rank i (critic colocated)
    and every rollout replica (engines colocated, on policy rank 0's GPU) sit in
    bundle i and ask for their share of its one GPU.
    """
    strategy = "SPREAD" if cluster.placement == "spread" else "PACK"
    # Trainer gangs (policy, PPO's value) take the policy's markers; rollout its own.
    extras = {"rollout": cluster.rollout_resources}

    def request(role) -> dict[str, float]:
        out = {k: float(v) for k, v in role.bundle.items() if v > 0}
        out.update(
            {k: float(v) for k, v in extras.get(role.name, cluster.policy_resources).items()}
        )
        return out

    lay = plan.gpu_layout
    colocated = lay is not None and (lay.rollout_colocated or lay.value_colocated)
    sharing = {"policy"} if colocated else set()
    if sharing and lay is not None:
        sharing |= {"value"} if lay.value_colocated else set()
        sharing |= {"rollout"} if lay.rollout_colocated else set()
    out = []
    if sharing:
        out.append(_shared_group(plan, sharing, request, strategy))
    beside = lay is not None and any(r.name == "reference" for r in plan.roles)
    for role in sorted(plan.roles, key=lambda r: ROLE_ORDER.get(r.name, 4)):
        if role.name in sharing:
            continue
        if beside and role.name == "rollout":
            # rollout.hosts_reference: each replica's GPU shared with a reference copy
            out.append(_beside_engines_group(plan, request, strategy))
        elif not (beside and role.name == "reference"):
            out.append(RoleBundles(role.name, [request(role)] * role.world_size, strategy))
    return out


def _beside_engines_group(plan: RunPlan, request, strategy: str) -> RoleBundles:
    """One group for the replicas (one GPU each) and the reference copies beside them:
    replica i and reference rank i in bundle i, each asking for its share of its GPU."""
    n = plan.role("rollout").world_size
    # the copy asks for its share of the GPU and CPUs only: the replica beside it pins the
    # bundle's node (cluster.rollout_resources), once
    ref = {k: v for k, v in request(plan.role("reference")).items() if k in ("CPU", "GPU")}
    slots = [Slot("rollout", rank, rank, request(plan.role("rollout"))) for rank in range(n)]
    slots += [Slot("reference", rank, rank, dict(ref)) for rank in range(n)]
    return RoleBundles("rollout+reference", _gpu_bundles(slots, n), strategy, tuple(slots))


def _gpu_bundles(slots: list[Slot], n: int) -> list[dict[str, float]]:
    """``n`` whole-GPU bundles holding ``slots``: each bundle asks for the sum of its
    processes' requests, and the whole GPU (their shares add up to at most 1)."""
    bundles: list[dict[str, float]] = [{} for _ in range(n)]
    for slot in slots:
        b = bundles[slot.bundle_index]
        for k, v in slot.resources.items():
            b[k] = round(b.get(k, 0.0) + v, 4)
    for b in bundles:
        b["GPU"] = 1.0
    return bundles


def _shared_group(plan: RunPlan, sharing: set[str], request, strategy: str) -> RoleBundles:
    """One group for the roles that share GPUs: a whole-GPU bundle per policy rank."""
    order = ROLE_ORDER
    n = plan.role("policy").world_size
    slots = []
    for role in sorted((r for r in plan.roles if r.name in sharing), key=lambda r: order[r.name]):
        for rank in range(role.world_size):
            # Engines go where policy rank 0 packs the IPC refit; value rank i beside policy rank i.
            slots.append(
                Slot(role.name, rank, 0 if role.name == "rollout" else rank, request(role))
            )
    name = "+".join(sorted(sharing, key=lambda r: order[r]))
    return RoleBundles(name, _gpu_bundles(slots, n), strategy, tuple(slots))


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
        from_rollout = all(s.role == "rollout" for s in rb.processes() if missing[0] in s.resources)
        key = "cluster.rollout_resources" if from_rollout else "cluster.policy_resources"
        fix = (
            f"no node offers {', '.join(repr(m) for m in missing)}: start a node with "
            f"`ray start --resources='{{\"{missing[0]}\": 1}}'` or remove it from {key}"
        )
    elif rb.role.startswith("policy"):
        fix = "add nodes, or lower dtensor.dp / dtensor.tp"
    elif rb.role == "value":
        fix = "add nodes, or lower value.dtensor.dp / value.dtensor.tp"
    else:
        fix = "add nodes, or lower rollout.replicas / rollout.tp"
    before = f" after {', '.join(placed)}" if placed else ""
    what = "GPU bundle(s)" if rb.slots else "process(es)"
    return ConfigError(
        f"{rb.role} needs {n} {what} of {bundle} ({needs}) in one placement group; "
        f"the cluster has {describe_nodes(nodes)}{before}; {fix}."
    )


def place(roles: list[RoleBundles], nodes: list[NodeInfo]) -> dict[str, list[NodeInfo]]:
    """Forecast the node of every process (role -> nodes in rank order); ConfigError on a shortfall.

    PACK puts a whole group on one node when some node has room for all of it,
    else fills the roomiest nodes first; SPREAD gives each next bundle the node
    holding the fewest bundles of its group. Groups are placed in order, each
    taking resources from the nodes before the next is placed; the processes
    of a shared group land on their bundle's node.
    """
    free = {n.node_id: dict(n.resources) for n in nodes}
    out: dict[str, list[NodeInfo]] = {}
    for rb, chosen in zip(roles, _place_bundles(roles, nodes, free), strict=True):
        for slot in sorted(rb.processes(), key=lambda s: (ROLE_ORDER.get(s.role, 3), s.rank)):
            out.setdefault(slot.role, []).append(chosen[slot.bundle_index])
    return out


def _place_bundles(
    roles: list[RoleBundles], nodes: list[NodeInfo], free: dict[str, dict[str, float]]
) -> list[list[NodeInfo]]:
    """The node of every bundle of every group, in group order."""
    out: list[list[NodeInfo]] = []
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
        out.append(chosen)
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


def placement_rows(placement: dict[str, list[NodeInfo]]) -> dict[str, tuple[str, ...]]:
    """role -> node label per rank, for plan.json and the plan tree."""
    return {role: tuple(n.label for n in nodes) for role, nodes in placement.items()}


def shared_gpu_mismatch(
    groups: list[RoleBundles], gpus: dict[tuple[str, int], tuple[str, tuple[str, ...]]]
) -> str | None:
    """Check that the processes of each shared GPU bundle got one and the same GPU.

    ``gpus`` maps (role, rank) to (node id, GPU ids Ray gave that process).
    Returns a sentence naming the first bundle whose processes got different
    GPUs, or none, or None when every shared bundle is one GPU.
    """
    for rb in groups:
        by_bundle: dict[int, list[Slot]] = {}
        for slot in rb.slots:
            by_bundle.setdefault(slot.bundle_index, []).append(slot)
        for index, slots in sorted(by_bundle.items()):
            got = [gpus[(s.role, s.rank)] for s in slots]
            if len(set(got)) > 1 or any(len(ids) != 1 for _, ids in got):
                seen = ", ".join(
                    f"{s.role} rank {s.rank}: GPU {','.join(ids) or 'none'} on node {node[:8]}"
                    for s, (node, ids) in zip(slots, got, strict=True)
                )
                return (
                    f"the processes of {rb.role} bundle {index} should share one GPU but Ray gave "
                    f"them {seen}"
                )
    return None
