"""``mergeqp list``: the registered names a config or a command can use, with one line on each.

Every name a user chooses is an entry of a registry (``docs/architecture.md``); with ``--import``
(or a config's ``imports:``) a user's own entries join them, and this command shows them too, so a
user can check that a module registered what they meant before writing a config that names it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, did_you_mean


def _first_line(text: Any, limit: int = 150) -> str:
    """The first sentence of ``text``'s first paragraph, on one line, without reST's double backquotes
    (at most ``limit`` characters)."""
    paragraph = " ".join(str(text or "").strip().split("\n\n")[0].split()).replace("``", "")
    end = re.search(r"(?<!\.)\.(?!\.)(\s|$)", paragraph)
    line = paragraph if end is None else paragraph[:end.start() + 1]
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


def _doc(obj: Any) -> str:
    return _first_line(getattr(obj, "__doc__", None))


def _constraints() -> list[dict[str, Any]]:
    from ..constraints.parse import CONSTRAINT_SETS, LAYER_CONSTRAINTS  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _doc(p) or "(its parser has no docstring)",
             **({"note": "built per layer: not in a QP over several layers"} if n in LAYER_CONSTRAINTS else {})}
            for n, p in CONSTRAINT_SETS.items()]


def _solvers() -> list[dict[str, Any]]:
    from ..solvers.registry import SOLVERS  # deferred: the CLI layer imports lazily

    out = [{"name": "auto", "description": "the registered solver measured fastest for the problem and set, with "
                                           "fallbacks when its point does not certify"}]
    for name, solver in SOLVERS.items():
        missing = solver.available()
        out.append({"name": name, "description": _doc(type(solver)),
                    **({"note": f"not available here: {_first_line(missing)}"} if missing else {})})
    return out


def _parametrisations() -> list[dict[str, Any]]:
    from ..stats.parametrisation import PARAMETRISATIONS  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _doc(type(p))} for n, p in PARAMETRISATIONS.items()]


def _bases() -> list[dict[str, Any]]:
    from ..stats.bases import BASES  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _first_line(e.description),
             **({} if e.checkpoint_source is not None else {"note": "Python statistics only (not in mergeqp merge)"})}
            for n, e in BASES.items()]


def _methods() -> list[dict[str, Any]]:
    from ..merge.registry import MERGE_METHODS  # deferred: the CLI layer imports lazily
    from ..run.model_methods import MODEL_METHODS  # deferred: the CLI layer imports lazily

    # (a model method's name selects it in a config over a state-dict method of the same name)
    return ([{"name": "qp", "description": "the convex QP merge (method.mode, parametrisation, constraints, solver)"},
             {"name": "auto", "description": "the recommended merge: the start chosen on held-out calibration batches, "
                                             "then a trust region (the default when no method is given)"}]
            + [{"name": n, "description": _first_line(m.summary)} for n, m in MERGE_METHODS.items()
               if n not in MODEL_METHODS]
            + [{"name": n, "description": _first_line(m.summary), "note": "runs on the live models"}
               for n, m in MODEL_METHODS.items()])


def _modes() -> list[dict[str, Any]]:
    from ..merge.modes import MERGE_MODES  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _first_line(m.description)} for n, m in MERGE_MODES.items()]


def _metrics() -> list[dict[str, Any]]:
    from ..output_metrics import OUTPUT_METRICS  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _first_line(m.description)} for n, m in OUTPUT_METRICS.items()]


def _architectures() -> list[dict[str, Any]]:
    from ..run.architectures import ARCHITECTURES  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": f"{getattr(c, '__module__', '?')}.{getattr(c, '__qualname__', n)}"}
            for n, c in ARCHITECTURES.items()]


def _families() -> list[dict[str, Any]]:
    from ..solvers.instance_families import FAMILIES  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": f"n = {f.n} ({f.K} x {f.r}): {_first_line(f.description) or f.set_type}"}
            for n, f in FAMILIES.items()]


def _domains() -> list[dict[str, Any]]:
    from ..experiments.lm import DEFAULT_DOMAINS, DOMAINS  # deferred: the CLI layer imports lazily

    return [{"name": n, "description": _doc(loader) or "(its loader has no docstring)",
             **({"note": "a default"} if n in DEFAULT_DOMAINS else {})} for n, loader in DOMAINS.items()]


#: kind -> (where a config or command names it, the entries)
KINDS: dict[str, tuple[str, Callable[[], list[dict[str, Any]]]]] = {
    "constraints": ("method.constraints, --constraint", _constraints),
    "solvers": ("method.solver, --solver", _solvers),
    "parametrisations": ("method.parametrisation", _parametrisations),
    "bases": ("method.basis", _bases),
    "methods": ("method.name, method.start", _methods),
    "modes": ("method.mode", _modes),
    "metrics": ("output.metric", _metrics),
    "architectures": ("config.json's architectures, besides every class transformers knows", _architectures),
    "families": ("bench --family, also as FAMILY:key=value:...", _families),
    "domains": ("experiment lm --domains", _domains),
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "list", help="list the registered names a config or command can use (your own too, with --import)",
        description="List the registered names of each kind, with one line on each: the built-in entries and "
                    "those that modules named by --import (or $MERGEQP_IMPORT) registered.")
    p.add_argument("kinds", nargs="*", metavar="KIND", help=f"which kinds (default: all): {', '.join(KINDS)}")
    p.add_argument("--json", action="store_true", help="print one JSON object {kind: [{name, description, ...}]}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    kinds = list(dict.fromkeys(args.kinds)) or list(KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ConfigError(f"unknown kind {bad[0]!r}{did_you_mean(bad[0], KINDS)}; valid kinds: {', '.join(KINDS)}")
    listed = {k: KINDS[k][1]() for k in kinds}
    if args.json:
        print(json.dumps(listed, indent=2))
        return 0
    for i, kind in enumerate(kinds):
        where, _ = KINDS[kind]
        print(("\n" if i else "") + f"{kind} ({where}):")
        entries = listed[kind]
        if not entries:
            print("  (none registered)")
        width = max((len(e["name"]) for e in entries), default=0)
        for e in entries:
            tail = f"  [{e['note']}]" if e.get("note") else ""
            print(f"  {e['name']:<{width}}  {e['description']}{tail}")
    return 0
