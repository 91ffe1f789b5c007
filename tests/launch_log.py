"""What a failed launch test prints: the launch's first traceback, then the log's tail.

A launch's log interleaves its tasks' lines, each prefixed with the task (``[chief:0] ...``). Its tail often shows
only a consequence of the first failure (an owner that died in its first session restarts as a fresh training and
the servers' replay window refuses it), so an assertion message starts with the first traceback.

Example::

    status, log = _launch(workdir, ...)
    assert status == 0, report(log)
"""

__all__ = ["TAIL_CHARS", "first_error", "report"]

#: How much of the log's end an assertion message shows.
TAIL_CHARS = 5000


def first_error(log: str) -> str:
    """The launch's first traceback (its task's lines from ``Traceback`` to the exception's line, at most 4000
    characters), then ``"...\\n"``; ``""`` if the log holds none. A later traceback may only be its consequence."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.endswith("Traceback (most recent call last):"):
            task = line[:line.index("Traceback")]
            block = [other for other in lines[i:] if other.startswith(task)]
            end = next((j for j, other in enumerate(block[1:], 1) if not other[len(task):].startswith(" ")), 0)
            return "\n".join(block[:end + 1])[-4000:] + "\n...\n"
    return ""


def report(log: str, tail: int = TAIL_CHARS) -> str:
    """An assertion message for a launch's `log`: its first traceback (`first_error`), then its last `tail`
    characters."""
    return first_error(log) + log[-tail:]
