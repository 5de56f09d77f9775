"""`Plan`: the table of every op in an optimized program and how it was resolved, and of
every plain-JAX pattern the pass matched (rewritten or left alone, and why)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokamax_pass.core import prediction, spec
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.passes.patterns import RewriteMatch
from tokamax_pass.passes.rewrite import Decision
from tokamax_pass.tables import render_table

_COLUMNS = ("path", "platform", "arguments", "implementation", "config", "source")
_MATCH_COLUMNS = ("pattern", "path", "source line", "outcome")


def format_arguments(ba: BoundArguments) -> str:
    """`x=bf16[32,2048,16,64], scale=f32[64]` (array arguments), `vmap` levels appended."""
    parts = [f"{name}={spec.encode(value)}" for name, value in ba.arguments.items()
             if spec.is_array(value)]
    parts += [f"vmap({level.size})" for level in ba.vmap]
    return ", ".join(parts)


def format_config(config: Any) -> str:
    if config is None or isinstance(config, NullConfig):
        return "-"
    fields = spec.encode_config(config) or {}
    return f"{type(config).__name__}({', '.join(f'{k}={v}' for k, v in fields.items())})"


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One op call on one platform: where, on what, which kernel and config, and why."""

    path: str
    platform: str
    device_kind: str | None
    arguments: str
    implementation: str
    op: str
    config: str
    source: str
    bound: Mapping[str, Any]  # the full bound-arguments spec (op with config + argument specs)
    # The implementation the target itself would run, where this machine cannot lower it
    # (`"cudnn"`, exporting from a CPU machine for cuda): this row's runs in its place.
    fallback_from: str | None = None

    @classmethod
    def from_decision(cls, decision: Decision) -> PlanRow:
        op = decision.choice.op
        return cls(
            path=decision.path,
            platform=decision.target.platform,
            device_kind=decision.target.device_kind,
            arguments=format_arguments(decision.choice.bound),
            implementation=prediction.kernel_implementation(op),
            op=prediction.op_name(op),
            config=format_config(op.config),
            source=decision.choice.described(decision.source),
            bound=decision.choice.bound.to_spec(),
            fallback_from=decision.choice.fallback_from,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanRow:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)
                      if f.name in data or f.default is dataclasses.MISSING})


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every op call of a program, in program order (one row per target platform), and
    every equation a plain-JAX pattern matched (`matches`)."""

    rows: tuple[PlanRow, ...]
    matches: tuple[RewriteMatch, ...] = ()

    @classmethod
    def from_decisions(cls, decisions: Sequence[Decision],
                       matches: Sequence[RewriteMatch] = ()) -> Plan:
        return cls(tuple(PlanRow.from_decision(d) for d in decisions), tuple(matches))

    def __iter__(self) -> Iterator[PlanRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PlanRow:
        return self.rows[index]

    def __str__(self) -> str:
        table = format_table(
            _COLUMNS,
            [[getattr(r, c) if c != "implementation" else f"{r.implementation} ({r.op})"
              for c in _COLUMNS] for r in self.rows],
        )
        if not self.matches:
            return table
        return table + "\nplain-JAX patterns:\n" + format_table(
            _MATCH_COLUMNS,
            [[m.pattern, m.path, m.source_line or "-", m.outcome] for m in self.matches])


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table of op calls, or a line saying there are none."""
    return render_table(columns, rows) if rows else "(no tokamax_pass ops)"
