"""Helpers for ftlm's own tests and for users testing code built on ftlm (not used at run time)."""
