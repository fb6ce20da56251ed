"""Sweep overrides -> trials, through Hydra's own override parser.

``optim.lr=1e-3,3e-3 seed=range(0,2) precision=fp32`` is parsed by
``OverridesParser``; every discrete sweep (comma list, ``choice()``,
``range()``) is enumerated with ``sweep_string_iterator`` exactly as Hydra's
BasicSweeper does, and the trials are the cartesian product of the swept keys,
each with every fixed override. ``interval()`` has no finite grid: it is only
accepted by the Optuna search, which samples it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from rltrain.config.errors import ConfigError

# Keys the sweep owns: every trial shares one cluster, and each trial's output
# folder is placed inside the sweep folder.
SWEEP_OWNED = ("cluster", "output_dir", "run_name")


@dataclass(frozen=True)
class SweptParam:
    """One swept key. ``values`` are override strings (Hydra quoting kept); for an
    interval, ``low``/``high`` bound it and ``log`` samples it on a log scale."""

    key: str
    kind: str  # "choice" (comma list / choice() / range()) | "interval"
    values: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False


@dataclass
class SweepSpace:
    """The parsed command line: overrides that apply to every trial, and the swept keys."""

    fixed: list[str] = field(default_factory=list)
    params: list[SweptParam] = field(default_factory=list)

    def grid(self) -> list[list[str]]:
        """Every trial's overrides (fixed first, then one value per swept key, in order)."""
        intervals = [p.key for p in self.params if p.kind == "interval"]
        if intervals:
            raise ConfigError(
                f"'{intervals[0]}=interval(...)' is a continuous range with no grid to enumerate; "
                "use a comma list, choice() or range(), or sample it with --search optuna."
            )
        axes = [[f"{p.key}={v}" for v in p.values] for p in self.params]
        return [[*self.fixed, *combo] for combo in itertools.product(*axes)]

    def corners(self) -> list[list[str]]:
        """Overrides that bound the search space: every choice value x both ends of each
        interval. Pre-validating these catches a bad value before an Optuna search starts."""
        axes = []
        for p in self.params:
            if p.kind == "interval":
                assert p.low is not None and p.high is not None
                ends = (int(p.low), int(p.high)) if p.integer else (p.low, p.high)
                axes.append([f"{p.key}={v!r}" for v in dict.fromkeys(ends)])
            else:
                axes.append([f"{p.key}={v}" for v in p.values])
        return [[*self.fixed, *combo] for combo in itertools.product(*axes)]


def parse_sweep(overrides: list[str]) -> SweepSpace:
    """Parse sweep overrides with Hydra's grammar; raises ConfigError naming the bad override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    space = SweepSpace()
    seen: set[str] = set()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            first = str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"cannot parse sweep override '{text}': {first} "
                "(use key=value, key=a,b,c, key=range(0,3) or key=choice(a,b))."
            ) from exc
        key = override.get_key_element()
        bare = override.key_or_group
        if bare in seen:
            raise ConfigError(f"'{bare}' is given twice; give each key once (a,b,c sweeps it).")
        seen.add(bare)
        if not override.is_sweep_override():
            space.fixed.append(f"{key}={override.get_value_element_as_str()}")
            continue
        owned = next((k for k in SWEEP_OWNED if bare == k or bare.startswith(k + ".")), None)
        if owned is not None:
            raise ConfigError(
                f"'{bare}' cannot vary between trials: every trial of a sweep shares its cluster "
                "and is written inside the sweep folder; give it a single value."
            )
        value = override.value()
        if isinstance(value, IntervalSweep):
            integer = isinstance(value.start, int) and isinstance(value.end, int)
            space.params.append(
                SweptParam(
                    key,
                    "interval",
                    low=value.start,
                    high=value.end,
                    log="log" in value.tags,
                    integer=integer,
                )
            )
            continue
        try:
            values = tuple(override.sweep_string_iterator())
        except HydraException as exc:
            raise ConfigError(
                f"'{text}': {str(exc).splitlines()[0]}; list the values explicitly (a,b,c)."
            ) from exc
        if not values:
            raise ConfigError(f"'{text}' sweeps over no values; give at least one.")
        space.params.append(SweptParam(key, "choice", values=values))
    return space


def trial_label(overrides: list[str], space: SweepSpace) -> str:
    """The swept part of a trial's overrides, for tables and error messages."""
    swept = {p.key for p in space.params}
    return " ".join(o for o in overrides if o.split("=", 1)[0] in swept) or "(no swept keys)"
