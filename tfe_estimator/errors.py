"""Exceptions raised by tfe_estimator for conditions that are not bad arguments.

Example::

    try:
        estimator.train(input_fn, steps=10)
    except tfe_estimator.InsecureRandomnessError as e:
        print(e)
"""

__all__ = ["InsecureRandomnessError", "PlaintextOnServerError"]


class InsecureRandomnessError(RuntimeError):
    """tf-encrypted has no cryptographically secure random generator here."""


class PlaintextOnServerError(AssertionError):
    """A graph places a floating-point (plaintext) tensor on a TFE server device."""
