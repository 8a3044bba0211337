"""Fault tolerance: quorum, coordinator, manager, live recovery.

The coordinator's hot path runs compiled when ``_compiled/`` holds a build of these very sources
(``ftlm.native``; ``FTLM_NATIVE=0`` runs the interpreted modules)."""

from ftlm import native as _native

_native.select(__path__)
