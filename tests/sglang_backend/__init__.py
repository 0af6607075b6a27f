"""The SGLang HiCache backend's tests (a package, so that this folder's ``conftest.py`` and the
one above it, which these modules import helpers from, keep apart). They run in .venv-sglang
(``make test-sglang``); where SGLang is not installed, as in .venv, they are skipped."""
