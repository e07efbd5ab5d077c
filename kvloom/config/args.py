"""Command-line flags from ``EngineConfig``'s fields: one vLLM-named flag per knob, one section per group."""

from __future__ import annotations

import argparse
import dataclasses

from kvloom.config.compat import ARGUMENT_ALIASES
from kvloom.config.engine import GROUPS, EngineConfig
from kvloom.config.parsing import parse_bool
from kvloom.config.structured_outputs import StructuredOutputsConfig


def add_engine_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    """Add a vLLM-named flag (``--max-num-seqs``, ...) for every EngineConfig field, in one argument group per
    concern (model, cache, scheduler, parallel, speculative, backend), so ``--help`` shows them grouped."""
    aliases: dict[str, list[str]] = {}
    for alias, name in ARGUMENT_ALIASES.items():
        aliases.setdefault(name, []).append(_flag(alias))
    for group, knobs in EngineConfig.fields_by_group().items():
        section = parser.add_argument_group(GROUPS[group])
        for f in knobs:
            if not f.metadata["flag"] or (f.name == "model" and not include_model):
                continue
            _add_flag(section, f, aliases.get(f.name, []))
            if f.name == "structured_outputs_config":
                # vLLM's dotted flag for the one key most set.
                section.add_argument("--structured-outputs-config.backend", dest="structured_outputs_backend",
                                     default=None, help="the structured outputs backend: auto or xgrammar")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_flag(section: argparse._ArgumentGroup, f: dataclasses.Field, aliases: list[str]) -> None:
    help_text = f.metadata["help"]
    default = f.default if f.default is not dataclasses.MISSING else None
    declared = str(f.type).replace(" ", "")
    if declared in ("bool", "bool|None"):
        # --flag, --flag true|false, and --no-flag for a switch that may be on by default or unset.
        section.add_argument(_flag(f.name), *aliases, dest=f.name, nargs="?", const=True, default=default,
                             type=_bool_flag, help=f"{help_text} (default {default})")
        if default is not False:
            section.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                 help=f"turn off {f.name}")
    else:
        section.add_argument(_flag(f.name), *aliases, dest=f.name, type=_flag_type(declared), default=default,
                             help=help_text)


def _bool_flag(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _flag_type(declared: str) -> type:
    """int or float for fields declared so (optional or not); str for the rest (sizes, paths, JSON)."""
    for name, kind in (("int", int), ("float", float)):
        if declared in (name, f"{name}|None"):
            return kind
    return str


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from parsed flags (every field the namespace holds; the server's own flags are skipped)."""
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    backend = getattr(args, "structured_outputs_backend", None)
    if backend is not None:
        merged = StructuredOutputsConfig.from_value(values.get("structured_outputs_config"))
        merged.backend = backend
        values["structured_outputs_config"] = dataclasses.asdict(merged)
    return EngineConfig.from_kwargs(**values)
