"""A service's options, declared once: each field of a frozen dataclass carries its flag.

    @dataclass(frozen=True, slots=True)
    class SchedulerOptions(Options):
        max_num_seqs: int = option(64, "batch size limit", type=POSITIVE)
        enable_prefix_caching: bool = option(True, "reuse cached prefix pages", flag="--no-prefix-caching")
        port: int = option(50052, "where it listens", type=PORT, cluster=False)

    SchedulerOptions.add_arguments(parser)              # the process's own parser (python -m scheduler.main)
    SchedulerOptions.add_arguments(parser, cluster=True)  # `tokenmill serve`: only the fields it offers as is
    options = SchedulerOptions.from_args(args)          # the same names back, no Namespace patching
    argv = options.to_argv()                            # what a child needs to rebuild an equal object

A field declared with `option()` is a flag; a field declared with plain `field()` is not (a composite a
class builds in its own `from_args`, such as TLS settings). `cluster=False` marks what a cluster sets
for each child itself (addresses, ports, values several services share): `tokenmill serve` does not offer
it under the service's name. Booleans follow one rule: a field that defaults to False is switched on by
its flag; one that defaults to True is switched off by `--no-<name>` (or the flag given).

`to_argv()` writes only what differs from the declared default, so a child parses the same declaration
back to an equal object (a test checks the round trip for every service).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Options")


def ranged(kind: Callable, low=None, high=None, low_open: bool = False, what: str = "") -> Callable[[str], Any]:
    """An argparse type that names the value and the allowed range when it rejects one."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {what}")
        return value

    return parse


PORT = ranged(int, 0, 65535, what="a port in 0..65535 (0 picks a free one)")
POSITIVE = ranged(int, 1, what=">= 1")
POSITIVE_FLOAT = ranged(float, 0.0, low_open=True, what="> 0")
NON_NEGATIVE_FLOAT = ranged(float, 0.0, what=">= 0")
NON_NEGATIVE_INT = ranged(int, 0, what=">= 0")
PROBABILITY = ranged(float, 0.0, 1.0, low_open=True, what="in (0, 1]")
SEED = ranged(int, 0, 2**64 - 1, what="in 0..2^64-1")
TOP_K = ranged(int, -1, what=">= -1 (-1 or 0 disables)")


def POWER_OF_TWO(text: str) -> int:  # noqa: N802 - reads like the other argument types
    value = POSITIVE(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two (the worker requires one)")
    return value


@dataclass(frozen=True, slots=True)
class Flag:
    help: str
    flags: tuple[str, ...] = ()  # empty: --field-name (--no-field-name for a boolean that defaults to True)
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    cluster: bool = True  # offered by `tokenmill serve` as is; False: the cluster sets it per child
    env: str | None = None  # the parser's default comes from this variable when it is set (kept out of argv)
    metavar: str | None = None


def option(default: Any, help: str, *, flag: str | Sequence[str] = (), type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, cluster: bool = True, env: str | None = None,
           metavar: str | None = None) -> Any:
    """A dataclass field that is also a flag. `default` may be a tuple (the flag then takes one or more values)."""
    names = (flag,) if isinstance(flag, str) else tuple(flag)
    return field(default=default, metadata={"flag": Flag(help, names, type, choices, cluster, env, metavar)})


def _flag_of(item: Field) -> Flag | None:
    return item.metadata.get("flag")


def _names(item: Field, flag: Flag) -> tuple[str, ...]:
    if flag.flags:
        return flag.flags
    dashed = item.name.replace("_", "-")
    return (f"--no-{dashed}",) if item.default is True else (f"--{dashed}",)


class Options:
    """Mixin of the three methods every service's options dataclass offers (STYLE.md habit 16)."""

    __slots__ = ()
    # a title for the `tokenmill serve --help` group of this service's flags
    GROUP: ClassVar[str] = ""

    @classmethod
    def flagged_fields(cls, *, cluster: bool = False) -> list[tuple[Field, Flag]]:
        found = [(item, _flag_of(item)) for item in fields(cls) if _flag_of(item) is not None]
        return [(item, flag) for item, flag in found if flag.cluster or not cluster]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                      cluster: bool = False) -> None:
        """cluster=True: only the flags `tokenmill serve` offers under the service's own names."""
        for item, flag in cls.flagged_fields(cluster=cluster):
            default = os.environ.get(flag.env, item.default) if flag.env else item.default
            # no default shown for one read from the environment: it may hold a password (a Redis URL)
            bare = "%(default)" in flag.help or flag.env or item.default in (None, False, True, (), "")
            help_text = flag.help if bare else f"{flag.help} (default: %(default)s)"
            if isinstance(item.default, bool):
                parser.add_argument(*_names(item, flag), dest=item.name, help=help_text, default=item.default,
                                    action="store_false" if item.default else "store_true")
                if item.default and not flag.flags:
                    # the plain form of a switch that is on by default is taken too (it says the default), so
                    # a command written when it was off by default (--async-scheduling) still works
                    parser.add_argument(f"--{item.name.replace('_', '-')}", dest=item.name, action="store_true",
                                        help=argparse.SUPPRESS)
                continue
            extra: dict[str, Any] = {"nargs": "+"} if isinstance(item.default, tuple) else {}
            parser.add_argument(*_names(item, flag), dest=item.name, default=default, type=flag.type,
                                choices=flag.choices, metavar=flag.metavar, help=help_text, **extra)

    @classmethod
    def service_parser(cls, module: str, description: str | None,
                       *more: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
        """The `python -m <module>` command line of the service these options belong to: its flags, then
        what only its process takes (TLS files, the secret, the metrics port), each added by one of more."""
        parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
        cls.add_arguments(parser)
        for add in more:
            add(parser)
        return parser

    @classmethod
    def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
        """The flagged fields from args (a missing name keeps its default), then overrides (composite fields)."""
        values: dict[str, Any] = {}
        for item, _ in cls.flagged_fields():
            if hasattr(args, item.name):
                value = getattr(args, item.name)
                values[item.name] = tuple(value) if isinstance(item.default, tuple) and value is not None else value
        return cls(**{**values, **overrides})

    def to_argv(self) -> list[str]:
        """The flags that rebuild this object in a child: every value that differs from its default.
        A field read from the environment (env=...) is never written: the cluster passes it there."""
        argv: list[str] = []
        for item, flag in self.flagged_fields():
            value = getattr(self, item.name)
            if flag.env or value == item.default or (value is None and item.default is MISSING):
                continue
            name = _names(item, flag)[0]
            if isinstance(item.default, bool):
                argv.append(name)
            elif isinstance(value, (tuple, list)):
                argv += [name, *map(str, value)]
            elif value is not None:
                argv += [name, str(value)]
            else:
                raise ValueError(f"{type(self).__name__}.{item.name}=None has no flag form (its default is "
                                 f"{item.default!r}); declare the default None to let it be unset")
        return argv
