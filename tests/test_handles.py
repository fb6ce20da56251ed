"""The typed boundary between the controller and its workers, checked without Ray.

Every worker method the role handles call (``actor.call(PolicyWorker.train, ...)``)
exists on the worker classes with annotated parameters that take the arguments
given; both engines implement the Engine protocol with its signatures; and no
file but the dispatch point passes a method's name as a string.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rltrain.rollout.base import Engine
from rltrain.rollout.torch_engine import TorchEngine
from rltrain.rollout.vllm_engine import VLLMEngine
from rltrain.train.fsdp import FSDPTrainer
from rltrain.train.policy_worker import PolicyWorker
from rltrain.train.reference_worker import ReferenceWorker
from rltrain.train.sharded_model import ShardedModel
from rltrain.train.value_worker import ValueWorker

SRC = Path(__file__).resolve().parents[1] / "src" / "rltrain"
CALLERS = [
    SRC / "cluster" / "handles.py",
    SRC / "cluster" / "pool.py",
    SRC / "cluster" / "workers.py",
    SRC / "cluster" / "inprocess.py",
]
# The class a call names -> the worker classes that answer it on the actors.
IMPLEMENTERS: dict[str, list[type]] = {
    "PolicyWorker": [PolicyWorker],
    "ValueWorker": [ValueWorker],
    "ReferenceWorker": [ReferenceWorker],
    "FSDPTrainer": [PolicyWorker, ValueWorker],
    # every gang's ranks: the trainers and the reference copies beside the engines
    "ShardedModel": [PolicyWorker, ValueWorker, ReferenceWorker],
    "Engine": [TorchEngine, VLLMEngine],
}
NAMED = {
    "PolicyWorker": PolicyWorker,
    "ValueWorker": ValueWorker,
    "ReferenceWorker": ReferenceWorker,
    "FSDPTrainer": FSDPTrainer,
    "ShardedModel": ShardedModel,
}


def _worker_calls() -> list[tuple[str, str, int, set[str], str]]:
    """(class, method, positional args, keyword names, where) of every ``.call(Cls.m, ...)``
    and ``.call_after(before, Cls.m, ...)`` in the callers."""
    found = []
    for path in CALLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            skip = {"call": 0, "call_after": 1}.get(node.func.attr)
            if skip is None or len(node.args) <= skip:
                continue
            method = node.args[skip]
            assert isinstance(method, ast.Attribute) and isinstance(method.value, ast.Name), (
                f"{path.name}:{node.lineno}: call a worker method as Class.method"
            )
            found.append(
                (
                    method.value.id,
                    method.attr,
                    len(node.args) - skip - 1,
                    {k.arg for k in node.keywords if k.arg},
                    f"{path.name}:{node.lineno}",
                )
            )
    return found


def test_every_method_the_handles_call_exists_with_its_annotated_signature():
    calls = _worker_calls()
    called = {(c, m) for c, m, *_ in calls}
    # The handles cover the split step, refit, checkpoints and the engines' whole protocol.
    for needed in [
        ("PolicyWorker", "begin_train_step"),
        ("PolicyWorker", "train_microbatch"),
        ("PolicyWorker", "finish_train_step"),
        ("PolicyWorker", "abort_train_step"),
        ("PolicyWorker", "compute_passes"),
        ("ValueWorker", "compute_passes"),
        ("PolicyWorker", "train"),
        ("ValueWorker", "train"),
        ("Engine", "generate"),
        ("Engine", "init_refit"),
        ("PolicyWorker", "init_refit"),
    ]:
        assert needed in called, needed
    for cls_name, method, n_args, keywords, where in calls:
        assert cls_name in IMPLEMENTERS, f"{where}: {cls_name}.{method} is no worker class"
        for cls in IMPLEMENTERS[cls_name]:
            fn = getattr(cls, method, None)
            assert callable(fn), f"{where}: {cls.__name__} has no method {method}"
            sig = inspect.signature(fn)
            params = list(sig.parameters.values())[1:]  # after self
            for p in params:
                assert p.annotation is not inspect.Parameter.empty, (
                    f"{cls.__name__}.{method}({p.name}) has no annotation"
                )
            assert sig.return_annotation is not inspect.Signature.empty, (
                f"{cls.__name__}.{method} has no return annotation"
            )
            args = [object()] * (1 + n_args)
            sig.bind(*args, **dict.fromkeys(keywords))  # raises on a mismatch


def test_both_engines_implement_the_engine_protocol_with_its_signatures():
    protocol = [
        name
        for name, fn in vars(Engine).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    ]
    assert {"generate", "init_refit", "refit_receive", "sleep", "wake_up", "shutdown"} <= set(
        protocol
    )
    for cls in (TorchEngine, VLLMEngine):
        for name in protocol:
            want = inspect.signature(getattr(Engine, name))
            got = inspect.signature(getattr(cls, name))
            assert [(p.name, p.annotation) for p in got.parameters.values()] == [
                (p.name, p.annotation) for p in want.parameters.values()
            ], f"{cls.__name__}.{name}{got} differs from Engine.{name}{want}"
            assert got.return_annotation == want.return_annotation, f"{cls.__name__}.{name}"


def test_the_controller_side_names_worker_methods_nowhere_as_strings():
    """Only cluster/actors.py turns a method into its name; nothing else calls an actor
    method by a string (``.call("train")``, ``.remote("train")``, ``getattr(w, "train")``)."""
    files = [*CALLERS, *sorted((SRC / "algorithms").glob("*.py")), SRC / "runner.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            first = node.args[0]
            name = node.func.attr if isinstance(node.func, ast.Attribute) else None
            by_string = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if name in ("call", "call_after", "remote", "call_between") and by_string:
                pytest.fail(f"{path.name}:{node.lineno}: a worker method named by a string")
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1:
                second = node.args[1]
                if isinstance(second, ast.Constant) and second.value in _worker_methods():
                    pytest.fail(f"{path.name}:{node.lineno}: getattr of a worker method")


def _worker_methods() -> set[str]:
    return {
        name
        for cls in (PolicyWorker, ValueWorker, TorchEngine, VLLMEngine)
        for name, _ in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


class _Recorder:
    """A worker that records what it was asked, and fails on request."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.log: list[str] = []

    def wake_up(self) -> None:
        self.log.append("wake_up")

    def work(self, x: int, scale: int = 1) -> int:
        self.log.append(f"work {x}")
        return x * scale

    def fail(self) -> None:
        raise ValueError(f"{self.tag} cannot")


def test_local_actor_runs_calls_at_once_and_names_a_failing_worker():
    """cluster.in_process: a LocalActor's calls run in this process, in call order (a
    before-method first), and a worker's exception becomes the WorkerError a Ray actor's
    failure gives, naming the worker."""
    from rltrain.cluster.actors import LocalActor, WorkerError, ready, wait_all

    actor: LocalActor[_Recorder] = LocalActor("policy rank 0")
    # the build returns its seconds and the parts the worker timed (none here)
    (built,) = wait_all([actor.build(_Recorder, "p")], None, "building workers")
    assert set(built) == {"build_s"} and built["build_s"] >= 0
    first = actor.call(_Recorder.work, 2, scale=3)
    second = actor.call_after([_Recorder.wake_up], _Recorder.work, 5)
    assert actor.host.worker.log == ["work 2", "wake_up", "work 5"]  # ran before any wait
    assert ready([first, second], 0.0) == [0, 1]
    assert wait_all([first, second], 1.0, "generate") == [6, 5]
    failed = actor.call(_Recorder.fail)
    with pytest.raises(WorkerError, match=r"^train: policy rank 0 failed: ValueError: p cannot"):
        wait_all([first, failed], 1.0, "train")
    assert wait_all([actor.where()], None, "start-up")[0]["node_id"] == "local"
    with pytest.raises(NotImplementedError):
        actor.call_beside(_Recorder.work, 1)
