"""The package version, one place: the daemon reports it, the package exports it."""

__version__ = "0.1.0"
