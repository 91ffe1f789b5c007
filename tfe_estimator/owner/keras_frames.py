"""The one walk over Python's stack that the Keras adapter uses to tell which Keras call is running.

Keras tells a strategy nothing about the call it serves (``fit``, ``evaluate``, building a model from shapes);
the adapter reads it from the frames of Keras' own functions, by file and function name, and fails closed when
they are not there (`keras_build`, `keras_evaluation`, `keras_fit`, `custom_loop`, `keras_progress`).

Example::

    fit, trainer = running_fit()
    callbacks = fit.f_locals.get("callbacks") if fit is not None else None
"""
import sys
from typing import Iterator, Optional, Tuple

__all__ = ["KERAS_TRAINING", "KERAS3_TRAINER", "frames", "frames_in", "running_fit"]

#: Keras 3's TensorFlow trainer (its ``fit`` / ``evaluate`` / ``predict``).
KERAS3_TRAINER = "keras/src/backend/tensorflow/trainer.py"
#: Where Keras' fit / evaluate / predict live: Keras 2's engine, Keras 3's TensorFlow trainer.
KERAS_TRAINING = ("keras/src/engine/training.py", "keras/engine/training.py", KERAS3_TRAINER)


def frames(start=None) -> Iterator:
    """Every frame from `start` (default: the caller's) outward to the stack's root."""
    frame = start if start is not None else sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        yield frame
        frame = frame.f_back


def frames_in(*files: str, start=None) -> Iterator[Tuple[object, str]]:
    """``(frame, file)`` for each frame from `start` (default: the caller's) outward whose code is in one of
    `files` (path endings), innermost first."""
    for frame in frames(start if start is not None else sys._getframe(1)):  # pylint: disable=protected-access
        path = frame.f_code.co_filename.replace("\\", "/")
        name = next((f for f in files if path.endswith(f)), None)
        if name is not None:
            yield frame, name


def running_fit() -> Tuple[Optional[object], Optional[str]]:
    """``(frame, file)`` of the innermost Keras ``Model.fit`` running on this thread (Keras 2's engine or Keras 3's
    trainer, `KERAS_TRAINING`), or ``(None, None)``."""
    return next(((frame, name) for frame, name in frames_in(*KERAS_TRAINING, start=sys._getframe(1))  # pylint: disable=protected-access
                 if frame.f_code.co_name == "fit"), (None, None))
