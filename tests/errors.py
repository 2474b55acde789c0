"""expect_error: the assertion every validation test makes."""

import pytest


def expect_error(call, *fragments, kind=RuntimeError) -> str:
    """Runs `call`, which must raise `kind` with every fragment in its message; returns it."""
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message
