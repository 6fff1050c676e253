"""Every EngineConfig setting and every method knob as a command-line flag (kebab-case),
and the config those flags describe. Shared by `sparsevllm generate`, `serve` and the
benchmarks, so each of them accepts the same engine flags."""

from __future__ import annotations

import argparse
import typing

from sparsevllm.config import FIELD_HELP, EngineConfig
from sparsevllm.sparse.registry import all_specs, knob_owners
from sparsevllm.sparse.spec import SettingValue, base_type


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field and per method knob, same name in kebab-case."""
    group = parser.add_argument_group("engine (EngineConfig fields)")
    group.add_argument(
        "--config", metavar="FILE", help="JSON file of engine settings; flags override it."
    )
    hints = typing.get_type_hints(EngineConfig)
    defaults = EngineConfig.knob_defaults()
    for name in EngineConfig.field_names():
        _add_setting(group, name, base_type(hints[name]), FIELD_HELP[name], defaults[name])
    seen: set[str] = set()  # knobs shared by several methods (PyramidKV extends SnapKV's)
    for spec in all_specs():
        names = [n for n in spec.knobs.names() if n not in seen]
        if not names:
            continue
        owners = ", ".join(knob_owners(names[0]))
        knobs = parser.add_argument_group(f"knobs of {owners} (see sparsevllm methods)")
        knob_defaults = spec.knobs.defaults()
        for name in names:
            help_text = spec.knobs.help(name)
            _add_setting(knobs, name, spec.knobs.type_of(name), help_text, knob_defaults[name])
        seen.update(names)


def _add_setting(
    group: argparse._ArgumentGroup,
    name: str,
    kind: type[object],
    help_text: str,
    default: SettingValue,
) -> None:
    flag = "--" + name.replace("_", "-")
    shown = "unset" if default is None else default
    text = f"{help_text} (default: {shown})".replace("%", "%%")
    if kind is bool:
        group.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
        )
        return
    # A tuple is a comma-separated list, parsed by the knob's validation.
    parse = kind if kind in (int, float) else str
    group.add_argument(flag, type=parse, default=argparse.SUPPRESS, help=text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.option_names()
    given = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "config", None):
        return EngineConfig.from_json(args.config, **given)
    return EngineConfig.from_dict(given)
