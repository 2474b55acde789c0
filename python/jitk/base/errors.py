"""jitk's error base. Every exception jitk raises on purpose derives from JitkError and from
the builtin it always was (RuntimeError, ValueError, TypeError, TimeoutError, ...), so both
`except jitk.JitkError` and the older `except RuntimeError` catch it.

Every message starts with "jitk: ", added here where the raiser did not write it."""

from __future__ import annotations

PREFIX = "jitk: "


class JitkError(Exception):
    """Anything jitk raises on purpose."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        if args and isinstance(args[0], str) and not args[0].startswith(PREFIX):
            args = (PREFIX + args[0], *args[1:])
        super().__init__(*args, **kwargs)


class ArgumentError(JitkError, ValueError):
    """A public function was given a value it cannot take: the message names the parameter
    (or tensor and dimension), what was expected and what came."""


class ArgumentTypeError(JitkError, TypeError):
    """A public function was given an argument of the wrong type: the message names the
    parameter, the expected type and the one that came."""


class SettingError(JitkError, ValueError):
    """A JITK_* environment variable holds a value its rule refuses: the message names the
    variable, the value and the rule."""


class UnknownOpError(JitkError, KeyError):
    """An op name that names no registered jitk op (or none with what the caller needs): the
    message names where the name came from and lists the known ops."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return str(self.args[0]) if self.args else ""
