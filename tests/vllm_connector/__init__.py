"""The vLLM connector's tests (a package, so that this folder's ``conftest.py`` and the one
above it, which these modules import helpers from, keep apart)."""
