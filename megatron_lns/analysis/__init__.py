"""Curse-of-depth diagnostics."""
