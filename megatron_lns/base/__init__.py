"""Helpers every layer may use: user errors, disk and path checks, exit statuses."""
