"""eagle-panel's pipeline: everything that runs without a screen."""

__version__ = "0.1.0"
