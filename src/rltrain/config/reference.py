"""The config reference, generated from the schema: ``python -m rltrain.config.reference``.

Writes ``docs/config-reference.md`` (or prints it with ``--stdout``): one table
per config node of :mod:`rltrain.config.schema`, every key with its type, its
default and the comment or docstring that explains it. The schema stays the one
source; ``tests/test_docs.py`` fails when the committed page differs from what
this module renders.

A field's text is, in this order of preference: a string literal right after
the field (an attribute docstring), the ``#`` comment lines right above it, and
its trailing ``#`` comment. Imports nothing beyond the standard library and the
schema, so it runs anywhere.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from rltrain.config import schema

DOC = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"

# The nodes in the order a user meets them; any schema node not listed follows.
NODE_ORDER = [
    "",
    "algorithm",
    "train",
    "optim",
    "precision",
    "precision.grad_scaler",
    "dtensor",
    "refit",
    "rollout",
    "rollout.vllm",
    "model",
    "model.tiny",
    "data",
    "reward",
    "eval",
    "checkpoint",
    "logger",
    "cluster",
    "value",
    "value.dtensor",
    "env",
]

# Config groups whose option sets the node (conf/<group>/<option>.yaml).
GROUP_OF = {
    "algorithm": "algorithm",
    "precision": "precision",
    "dtensor": "parallelism",
    "refit": "refit",
    "rollout": "rollout",
    "model": "model",
    "data": "data",
    "cluster": "cluster",
    "logger": "logger",
    "env": "env",
}


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One key of the reference."""

    key: str  # dotted, e.g. "optim.lr"
    type: str
    default: str
    text: str


def field_texts(cls: type) -> dict[str, str]:
    """Field name -> its explanation from the class source (docstring, comments above, trailing)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    texts: dict[str, str] = {}
    statements = body.body
    for i, node in enumerate(statements):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        after = statements[i + 1] if i + 1 < len(statements) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            texts[name] = " ".join(inspect.cleandoc(after.value.value).split())
            continue
        above: list[str] = []
        row = node.lineno - 2  # 0-based index of the line above the field
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        trailing = _trailing_comment(lines[node.lineno - 1 : (node.end_lineno or node.lineno)])
        texts[name] = " ".join(" ".join([*above, trailing]).split())
    return texts


def _trailing_comment(lines: list[str]) -> str:
    """The ``#`` comment on the field's own lines, outside string literals."""
    import io
    import tokenize

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, IndentationError):
        return ""
    return " ".join(t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT)


def _type_name(tp: object) -> str:
    """A readable annotation: ``float``, ``int | None``, ``dict[str, float]``, a Literal's values."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp)).replace("'", "")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value} ({value // 2**20} MiB)"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value) if not isinstance(value, (list, dict)) else (str(value) or "[]")


def collect(
    cls: type = schema.RunConfig, prefix: str = ""
) -> dict[str, tuple[type, list[FieldDoc]]]:
    """Every node under ``cls``: dotted node name -> (its dataclass, its leaf keys)."""
    # Names of the schema and of the module that defines the node (the env node's own).
    hints = typing.get_type_hints(cls, {**vars(schema), **vars(sys.modules[cls.__module__])})
    texts = field_texts(cls)
    nodes: dict[str, tuple[type, list[FieldDoc]]] = {prefix.rstrip("."): (cls, [])}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nodes.update(collect(typing.cast(type, tp), f"{prefix}{f.name}."))
            continue
        nodes[prefix.rstrip(".")][1].append(
            FieldDoc(f"{prefix}{f.name}", _type_name(tp), _default_text(f), texts.get(f.name, ""))
        )
    return nodes


def _cell(text: str) -> str:
    """``text`` safe in a table cell: pipes escaped, and ``<name>`` outside code spans
    escaped so that it is not taken for an HTML tag."""
    if "\\|" not in text:
        text = text.replace("|", "\\|")
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render() -> str:
    """docs/config-reference.md as a string."""
    nodes = collect()
    order = [n for n in NODE_ORDER if n in nodes] + [n for n in nodes if n not in NODE_ORDER]
    out = [
        "# Config reference",
        "",
        "Generated from `src/rltrain/config/schema.py` by `python -m rltrain.config.reference`",
        "(run it after changing the schema; `tests/test_docs.py` fails while this page is stale).",
        "Every key below can be set on the command line as `key=value`; a config group",
        "(`group=option`, see the [user guide](user-guide.md#config-groups-and-overrides)) sets",
        "several at once, and recipes set any of them. Defaults are the schema's; a group",
        "option or recipe may set another value (`rltrain plan ... --json` shows the",
        "resolved config of a run).",
        "",
        "Nodes: " + ", ".join(f"[`{n or 'top level'}`](#{_anchor(n)})" for n in order) + ".",
        "",
    ]
    for name in order:
        cls, keys = nodes[name]
        if not keys:
            continue
        out.append(f"## {_title(name)}")
        out.append("")
        doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        group = GROUP_OF.get(name)
        if group:
            doc += f" Set by the `{group}` config group (`conf/{group}/`)."
        if doc:
            out += [doc.strip(), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for k in keys:
            out.append(f"| `{k.key}` | {_cell(k.type)} | `{k.default}` | {_cell(k.text)} |")
        out.append("")
    return "\n".join(out)


def _title(node: str) -> str:
    return f"`{node}`" if node else "Top level"


def _anchor(node: str) -> str:
    """The GitHub anchor of the node's heading."""
    return node.replace(".", "") if node else "top-level"


def main(argv: list[str]) -> int:
    text = render()
    if "--stdout" in argv:
        sys.stdout.write(text)
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
