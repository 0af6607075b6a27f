"""Integrations of the kvstore client with model code.

Each integration is a module named after the library it serves (``transformers``) and imports
that library itself, so importing this package needs none of them.
"""
