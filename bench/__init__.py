"""Benchmarks of ftlm (not tests): each module measures, prints a Markdown table and rewrites its
own section of BENCHMARKS.md. ``python -m bench`` (``make bench``) runs them all."""
