"""The version, in one place (``feedline.__version__`` re-exports it)."""

__version__ = "0.1.0"
