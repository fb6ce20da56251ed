"""Math answer reward on the ``math-verify`` library.

``score(response, reference)`` compares the final answer of free model text
with a reference answer symbolically (``72`` = ``72.0`` = ``\\boxed{72}``,
``7/2`` = ``\\frac{7}{2}``). math-verify's own timeouts use ``signal.alarm``,
which only works in the main thread (it raises elsewhere), so they are turned
off here: rltrain's reward runner (:mod:`rltrain.rewards.registry`) bounds
every call by ``reward.timeout_s`` instead.
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Thousands separators inside numbers ("1,234,567"); commas elsewhere (tuples, lists) stay.
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is deliberate."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledNotice())


def reference_answer(reference: str) -> str:
    """The answer part of a reference: the text after the last ``####`` (GSM8K), else all of it."""
    if "####" in reference:
        reference = reference.rsplit("####", 1)[1]
    return _THOUSANDS.sub("", reference.strip())


def response_answer(response: str) -> str:
    """The part of a response that states its answer.

    A ``####`` marker (GSM8K style) wins: the first line after the last one.
    Otherwise the whole text, in which math-verify looks for the last
    ``\\boxed{}``, then "final answer is ...", then the last number stated.
    """
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        response = tail.splitlines()[0] if tail else ""
    return _THOUSANDS.sub("", response)


def score(response: str, reference: str) -> float:
    """1.0 when the response's final answer equals the reference's, else 0.0.

    ``reference`` is a bare answer ("72", "\\frac{7}{2}") or a whole GSM8K
    solution ending in ``#### 72``. No timeout inside: call it through the
    reward runner (or bound it yourself) when answers can be pathological.
    """
    gold = parse(reference_answer(reference), list(_GOLD_CONFIG), parsing_timeout=None)
    if not gold:
        return 0.0
    pred = parse(response_answer(response), list(_PRED_CONFIG), parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
