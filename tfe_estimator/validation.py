"""The argument checks used across the package: one definition of "an int" and "a number".

Python's `bool` is a subclass of `int`, so ``isinstance(True, int)`` holds; every
count, port, index and duration here refuses booleans. Callers keep their own error
messages (they name the argument, its source and the fix); these helpers only
decide. TensorFlow-free, so the command-line tools can use them.

Example::

    from tfe_estimator.validation import check_int, is_number

    check_int(workers, f"workers={workers!r} must be an integer >= 0.", minimum=0)
    if not is_number(timeout):
        raise TypeError(f"timeout must be a number, got {timeout!r}.")
"""
from typing import Any, Optional, Type

__all__ = ["is_int", "is_number", "check_int"]


def is_int(value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None) -> bool:
    """Whether `value` is an `int` (not a `bool`) within ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def is_number(value: Any) -> bool:
    """Whether `value` is an `int` or `float` (not a `bool`)."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_int(value: Any, message: str, minimum: Optional[int] = None, maximum: Optional[int] = None,
              error: Type[Exception] = ValueError) -> int:
    """Returns `value` if `is_int(value, minimum, maximum)`, else raises `error(message)`."""
    if not is_int(value, minimum, maximum):
        raise error(message)
    return value
