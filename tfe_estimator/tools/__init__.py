"""Tools built on the core: the command line (`cli`), demos and the benchmark (`bench`).

Nothing in the core imports from here.

Example::

    python -m tfe_estimator.tools.cli demo
"""
__all__ = []
