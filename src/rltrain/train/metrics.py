"""Train-step metrics that know how to reduce themselves over micro batches and ranks.

Every metric a micro batch reports declares a :class:`MetricKind`; the value
it passes is local to the micro batch:

=================  =====================================  =================================
kind               value a micro batch adds                reduced value
=================  =====================================  =================================
``TOKEN_MEAN``     sum over its valid tokens               global sum / global token count
``SEQUENCE_MEAN``  sum over its sequences                  global sum / global sequence count
``SUM``            a sum (or a count)                      global sum
``MIN``/``MAX``    the micro batch's min/max               global min/max
=================  =====================================  =================================

A count is a ``SUM`` and is never averaged. The token and sequence counts
themselves ride along in the same all-reduce as the sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum

import torch


class MetricKind(str, Enum):
    """How a metric is reduced over micro batches and data-parallel ranks."""

    TOKEN_MEAN = "token_mean"
    SEQUENCE_MEAN = "sequence_mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_IDENTITY = {MetricKind.MIN: math.inf, MetricKind.MAX: -math.inf}


class StepMetrics:
    """Local accumulator of one optimizer step's micro-batch metrics (one per rank).

    Values may be 0-d tensors on the accelerator: they are folded on the
    device and read back once, in :meth:`reduce`, so micro batches never
    wait for the host.
    """

    def __init__(self) -> None:
        self.tokens: float | torch.Tensor = 0.0
        self.sequences: float | torch.Tensor = 0.0
        self.kinds: dict[str, MetricKind] = {}
        self.values: dict[str, float | torch.Tensor] = {}

    def add_counts(self, tokens: float | torch.Tensor, sequences: float | torch.Tensor) -> None:
        self.tokens = self.tokens + _detach(tokens)
        self.sequences = self.sequences + _detach(sequences)

    def add(self, name: str, kind: MetricKind, value: float | torch.Tensor) -> None:
        """Fold one micro batch's local value in; a name keeps the kind it was first given."""
        value = _detach(value)
        known = self.kinds.setdefault(name, kind)
        if known is not kind:
            raise ValueError(f"metric {name} declared as {known.value}, then as {kind.value}")
        if name not in self.values:
            self.values[name] = value
        elif kind is MetricKind.MIN:
            self.values[name] = _pick(torch.minimum, min, self.values[name], value)
        elif kind is MetricKind.MAX:
            self.values[name] = _pick(torch.maximum, max, self.values[name], value)
        else:
            self.values[name] = self.values[name] + value

    def reduce(
        self,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        all_reduce_max: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[dict[str, float], float, float]:
        """Reduce over ranks: (metrics, global tokens, global sequences).

        Two collectives (one SUM for counts and sums, one MAX for max and
        negated min), called on every rank of the group with the same metric
        names (ranks that saw only empty micro batches report the identities).
        """
        names = sorted(self.kinds)
        summed = [n for n in names if self.kinds[n] not in _IDENTITY]
        extreme = [n for n in names if self.kinds[n] in _IDENTITY]
        sums = all_reduce_sum(
            _stack([self.tokens, self.sequences] + [self.values[n] for n in summed])
        ).tolist()
        tokens, sequences = sums[0], sums[1]
        out: dict[str, float] = {}
        for name, total in zip(summed, sums[2:], strict=True):
            kind = self.kinds[name]
            if kind is MetricKind.TOKEN_MEAN:
                out[name] = total / max(tokens, 1.0)
            elif kind is MetricKind.SEQUENCE_MEAN:
                out[name] = total / max(sequences, 1.0)
            else:
                out[name] = total
        if extreme:
            signed = [
                self.values[n] if self.kinds[n] is MetricKind.MAX else -self.values[n]
                for n in extreme
            ]
            maxed = all_reduce_max(_stack(signed)).tolist()
            for name, v in zip(extreme, maxed, strict=True):
                out[name] = v if self.kinds[name] is MetricKind.MAX else -v
        return out, tokens, sequences


def _detach(value: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return float(value)


def _pick(tensor_fn, float_fn, a, b):
    """min/max of two floats, or of tensors (on the device of whichever is one)."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return float_fn(a, b)
    device = a.device if isinstance(a, torch.Tensor) else b.device
    return tensor_fn(
        torch.as_tensor(a, dtype=torch.float64, device=device),
        torch.as_tensor(b, dtype=torch.float64, device=device),
    )


def _stack(values: list[float | torch.Tensor]) -> torch.Tensor:
    """One float64 CPU tensor (a single device-to-host copy for device values)."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if device is None:
        return torch.tensor(values, dtype=torch.float64)
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values]
    ).cpu()
