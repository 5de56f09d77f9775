"""Runtime options under upstream Tokamax's names (`tokamax_pass.config`).

Each option has a default; a program-wide value, given as `--tokamax_<name>=value` (or
`--tokamax_<name>` / `--notokamax_<name>` for a boolean) on the command line; and a value
for a block of code, `with option(value):`, innermost first. The block's value wins over
the program-wide one, which wins over the default. Only the `--tokamax_*` arguments of
`sys.argv` are read: the rest of the command line belongs to the host program.

Where absl is installed, each option is also the absl flag `tokamax_<name>`, as upstream's
are, and the flag's value is the program-wide value: the flag takes the `--tokamax_*`
arguments of `sys.argv` when this module is imported (so a program that never parses
absl's flags sees them), `absl.app.run` parses it, `FLAGS.tokamax_<name> = value` and
`flagsaver` set it, and `option.flag` is its `FlagHolder`.

Both values are keys of JAX's jit caches (`jax.make_user_context`), so a function jitted
under one value of an option is traced again under another: ops read the options while
they are traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

import jax

try:
    from absl import flags as absl_flags
except ImportError:  # absl is optional: the command line is then read directly
    absl_flags = None  # type: ignore[assignment]

_UNSET = object()
# The words absl's boolean flags take, so a value means the same with or without absl.
_TRUE, _FALSE = ("1", "true", "t"), ("0", "false", "f")
# Flag name -> the jit-cache key that mirrors that absl flag's value.
_FLAG_KEYS: dict[str, Any] = {}


def _parse_bool(value: Any) -> bool:
    """`value` as a bool: a bool, the int 0 or 1 (as absl's flags take them), or a word
    of `_TRUE` / `_FALSE`; `ValueError` otherwise."""
    if isinstance(value, str):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    elif isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(value)


@dataclasses.dataclass(frozen=True)
class CommandLineFlag:
    """`option.flag` where absl is not installed: the flag's name, default and the value
    the command line gives it (absl's `FlagHolder` has these three)."""

    option: ConfigOption

    @property
    def name(self) -> str:
        return self.option.flag_name

    @property
    def default(self) -> Any:
        return self.option.default

    @property
    def value(self) -> Any:
        return self.option.program_value()


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One option: `option.value` reads it, `with option(value):` sets it for a block.

    `choices`: the values an enum option takes (`None`: a boolean option).
    """

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    _scoped: Any = dataclasses.field(init=False, repr=False, compare=False)
    _flag: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_scoped", jax.make_user_context(_UNSET))
        object.__setattr__(self, "_flag", (CommandLineFlag(self) if absl_flags is None
                                           else _define_absl_flag(self)))

    @property
    def flag_name(self) -> str:
        return f"tokamax_{self.name}"

    @property
    def flag(self) -> Any:
        """The program-wide flag: absl's `FlagHolder` where absl is installed, otherwise a
        `CommandLineFlag` (`.name`, `.default`, `.value`)."""
        return self._flag

    def parse(self, value: Any) -> Any:
        """`value` (or its text) as this option's value; `ValueError` when it is not one."""
        try:
            if self.choices is None:
                return value if isinstance(value, bool) else _parse_bool(value)
            if value not in self.choices:
                raise ValueError(value)
            return value
        except ValueError:
            allowed = ("a boolean (or 0 / 1)" if self.choices is None
                       else f"one of {self.choices}")
            raise ValueError(f"Invalid value for config `{self.flag_name}`: {value!r} "
                             f"(takes {allowed})") from None

    def __call__(self, value: Any) -> contextlib.AbstractContextManager[Any]:
        """A context manager setting `value` for its block; `ValueError` here, as upstream,
        where `value` is not one of this option's values."""
        return self._scoped(self.parse(value))

    @property
    def value(self) -> Any:
        scoped = self._scoped.value
        return self.program_value() if scoped is _UNSET else scoped

    def program_value(self) -> Any:
        """The value outside any `with` block: the absl flag's where absl is installed,
        else the command line's `--tokamax_<name>` arguments, else the default."""
        if not isinstance(self._flag, CommandLineFlag):
            return self.parse(absl_flags.FLAGS[self.flag_name].value)
        given = command_line_value(self, _program_args())
        return self.default if given is _UNSET else self.parse(given)


def _define_absl_flag(option: ConfigOption) -> Any:
    """Defines `option`'s absl flag, whose every value is mirrored into a jit-cache key,
    with the value the command line gives it.

    `allow_override`: where upstream Tokamax defines the same flag in the same program,
    the one defined last is registered, and both packages read that one."""
    assert absl_flags is not None
    _FLAG_KEYS[option.flag_name] = jax.make_user_context(None)
    flag: Any
    if option.choices is None:
        flag = _KeyedBooleanFlag(option.flag_name, option.default, option.help,
                                 allow_override=True)
    else:
        flag = _KeyedEnumFlag(option.flag_name, option.default, option.help, option.choices,
                              allow_override=True)
    given = command_line_value(option, _program_args())
    if given is not _UNSET:
        flag.parse(given)
        flag.using_default_value = False
    return absl_flags.DEFINE_flag(flag)


class _JitKeyedValue:
    """An absl flag whose value, whenever set (parsing, `FLAGS.x = v`, `flagsaver`), is
    also the global value of its jit-cache key: jitted functions traced under the old
    value are traced again."""

    name: str
    _value: Any

    @property
    def value(self) -> Any:
        return self._value

    @value.setter
    def value(self, value: Any) -> None:
        self._value = value
        key = _FLAG_KEYS.get(self.name)
        if key is not None:
            key.set_global(repr(value))  # a repr: any value a caller sets is hashable


if absl_flags is not None:
    class _KeyedBooleanFlag(_JitKeyedValue, absl_flags.BooleanFlag):
        pass

    class _KeyedEnumFlag(_JitKeyedValue, absl_flags.EnumFlag):
        pass


def _program_args() -> list[str]:
    """The program's arguments; none where Python is embedded without a `sys.argv`."""
    return getattr(sys, "argv", [])[1:]


def command_line_value(option: ConfigOption, args: list[str]) -> Any:
    """The last value `args` give `option` (`--flag=v`, `--flag v`, `--flag`, `--noflag`),
    as text or a bool; `_UNSET` where they give none."""
    found: Any = _UNSET
    for i, arg in enumerate(args):
        name, has_value, text = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            continue
        if name == option.flag_name:
            if has_value:
                found = text
            elif option.choices is None:
                found = True
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                found = args[i + 1]
        elif name == f"no{option.flag_name}" and option.choices is None and not has_value:
            found = False
    return found


autotuning_cache_miss_fallback = ConfigOption(
    "autotuning_cache_miss_fallback", "heuristics",
    "What a call whose op takes a config gets when no pinned config, active autotuning "
    "result or cache answers it: 'heuristics' (the op's heuristic config), 'autotune' "
    "(its candidate configs measured now, the fastest kept and cached) or 'error' "
    "(ValueError).", choices=("heuristics", "autotune", "error"))

cross_compile = ConfigOption(
    "cross_compile", False,
    "Lower kernels for hardware this machine lacks. Implementations here are checked "
    "against the platform being lowered for (jax.export's platforms), never against the "
    "local devices, so lowering for another machine works with either value.")

ignore_autotuning_cache = ConfigOption(
    "ignore_autotuning_cache", False,
    "Look up no config and no measurement in active autotuning results or the user and "
    "library caches: pinned configs, then heuristics (or the cache-miss fallback).")

OPTIONS: tuple[ConfigOption, ...] = (
    autotuning_cache_miss_fallback, cross_compile, ignore_autotuning_cache)
