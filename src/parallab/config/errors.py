"""The error every check raises for bad input: one line that names the key and the fix."""


class ConfigError(ValueError):
    """Bad input, stated in one line that names the key and the fix."""


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for quoting an error inside a one-line message."""
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
