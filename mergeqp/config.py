"""Reading a ``mergeqp merge`` configuration: YAML file -> validated :class:`MergeConfig`.

The schema itself (every block, its keys and checks) is the run layer's typed input,
:mod:`mergeqp.run.schema`; this module reads the file, resolves relative paths against its folder
and turns pydantic's errors into one :class:`~mergeqp.errors.ConfigError` that names each bad key.
The full reference is ``docs/hf.md``.
"""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import ConfigError, MergeQPError
from .io.text import read_text
from .plugins import import_plugins
from .run.schema import (
    BLOCK_SHAPES,
    BaselineSpec,
    CalibrationOptions,
    MergeConfig,
    MethodConfig,
    ModelEntry,
    OutputConfig,
    PromptSource,
    check_paths,
    default_model_name,
)

__all__ = ["BaselineSpec", "CalibrationOptions", "MergeConfig", "MethodConfig", "ModelEntry", "OutputConfig",
           "PromptSource", "check_paths", "load_config", "parse_config"]


#: what a missing key is for, where that is not obvious from its name
_MISSING_HINTS = {
    "layers": (" (the linear layers to merge: names or globs, e.g. [model.layers.*.mlp.down_proj] for the "
               "down-projections of every block; with a layer that matches nothing, mergeqp merge --dry-run "
               "lists the model's linear layers)"),
}


def _model_label(data: Any, index: int) -> str:
    """``models[NAME]`` for the ``index``-th entry of a config's ``models`` (its ``name``, else the name
    its path gives it, as the run's other messages call it), ``models[#N]`` (counted from 1) otherwise;
    schema errors said ``models.0`` (a review, stop 74)."""
    models = data.get("models") if isinstance(data, dict) else None
    entry = models[index] if isinstance(models, list) and 0 <= index < len(models) else None
    if isinstance(entry, dict):
        name = entry.get("name")
        if isinstance(name, str) and name:
            return f"models[{name}]"
        if isinstance(entry.get("path"), str) and entry["path"] and default_model_name(entry["path"]):
            return f"models[{default_model_name(entry['path'])}]"
    return f"models[#{index + 1}]"


def _location(loc: Sequence[Any], data: Any) -> str:
    """A pydantic error location as the config's keys: ``models[ft1].weight`` for ``models.1.weight``."""
    parts = [str(x) for x in loc if not str(x).startswith("function-")]
    if len(parts) >= 2 and parts[0] == "models" and parts[1].isdigit():
        head = _model_label(data, int(parts[1]))
        return head + "".join(f".{p}" for p in parts[2:])
    return ".".join(parts)


def _format_errors(exc: ValidationError, source: str, data: Any = None) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = _location(err.get("loc", ()), data)
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        block = re.search(r"instance of (\w+)", msg)
        if block and block.group(1) in BLOCK_SHAPES:
            msg = f"expected {BLOCK_SHAPES[block.group(1)]}, got {type(err.get('input')).__name__} {err.get('input')!r:.60}"
        if err.get("type") == "missing":
            msg = "required key is missing" + _MISSING_HINTS.get(loc, "")
        if err.get("type") == "string_type" and isinstance(err.get("input"), (int, float)):
            # YAML reads 1e3, 3.10 or 007 as numbers: a name meant as text is quoted
            msg += f" (YAML read {err.get('input')!r} as a number: put the text in quotes)"
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return ConfigError(f"invalid config {source}:\n" + "\n".join(lines))


def parse_config(data: Any, root: str | Path = ".", source: str = "<dict>",
                 config_file: str | Path | None = None) -> MergeConfig:
    """Validate a config mapping (as read from YAML; ``config_file``: the file it came from, which
    outputs must never overwrite). Its ``imports`` (your own modules) are imported first, so that the
    rest may name what they register. Raises :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping, got {type(data).__name__}")
    for internal in ("root", "config_file"):
        if internal in data:
            raise ConfigError(f"invalid config {source}:\n  {internal}: unknown key {internal!r}")
    extra = {"config_file": str(config_file)} if config_file is not None else {}
    imports = data.get("imports")
    if isinstance(imports, str):
        data = {**data, "imports": [imports]}
        imports = [imports]
    if imports is not None:  # before the rest: the file may name what these modules register
        if not isinstance(imports, list) or not all(isinstance(m, str) and m.strip() for m in imports):
            raise ConfigError(f"invalid config {source}:\n  imports: a list of .py files (relative to the "
                              f"config's folder) or module names, got {imports!r}")
        import_plugins(imports, label=f"{source}: imports:", root=root)
    try:
        return MergeConfig.model_validate({**data, "root": str(root), **extra})
    except ValidationError as exc:
        raise _format_errors(exc, source, data) from None


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-9`` and ``5E3`` are numbers (YAML 1.1, which
    PyYAML implements, reads an exponent without a dot as a string, and the strict schema then refused
    ``tol: 1e-9``), as are ``.5``, ``1.``, ``.inf`` and ``.nan``; integers stay integers. A key written
    twice in one mapping is an error naming both lines, as YAML 1.2 requires (PyYAML keeps the last
    silently: stop 60 review, a second ``method:`` line replaced the QP block without a word); keys a
    merge (``<<``) brings in may still be overridden."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._checked_mappings: set[int] = set()

    def flatten_mapping(self, node: Any) -> None:
        # checked as written, before the merge keys' entries join it (PyYAML flattens a mapping merged into
        # another in place, possibly before its own turn: stop 60 review, a chain of merges was refused)
        if id(node) not in self._checked_mappings:
            self._checked_mappings.add(id(node))
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping (lines {first.start_mark.line + 1} and "
                        f"{key_node.start_mark.line + 1}); YAML would keep only the last: write it once",
                        key_node.start_mark)
        super().flatten_mapping(node)


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """``text`` as YAML, with floats written as YAML 1.2 (and most users) write them (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path) -> MergeConfig:
    """Read and validate a YAML config file (relative paths resolve against its folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"config {p} is a folder; name the YAML file")
    if not p.is_file():
        if p.exists():  # /dev/null, a pipe, a socket: not "not found"
            raise ConfigError(f"config {p} is not a regular file (a device, pipe or socket); name the YAML file")
        raise ConfigError(f"config file not found: {p}")
    try:
        text = read_text(p, "config")
    except MergeQPError as exc:  # not UTF-8 (a traceback until stop 67), unreadable
        raise ConfigError(str(exc)) from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        # (PyYAML calls the text "<unicode string>": name the file in the positions it gives)
        where = str(exc).replace('in "<unicode string>"', f'in "{p}"')
        raise ConfigError(f"config {p} is not valid YAML: {where}") from None
    if data is None:
        raise ConfigError(f"config {p} is empty (no YAML mapping in it; docs/hf.md shows one)")
    return parse_config(data, root=p.resolve().parent, source=str(p), config_file=p.resolve())
