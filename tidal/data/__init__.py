"""Datasets for Tidal jobs: ``TokenShards`` (fixed-length windows over flat token files,
by global index) and ``write_tokens`` (writes such a file). See docs/input-pipelines.md."""

from __future__ import annotations

from tidal.data.tokens import TokenShards, write_tokens

__all__ = ["TokenShards", "write_tokens"]
