"""Byte units, for sizes written as ``256 * MiB``: one definition for the wire code and every role (``proto``
imports nothing of the other packages, so they can all import this)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
