"""The package version, read by setup.py and exported as `tfe_estimator.__version__`."""
__version__ = "0.1.0"
