"""Vanilla: dense full attention, the baseline every method is compared with."""

from __future__ import annotations

from sparsevllm.sparse.base import SparseMethod


class Vanilla(SparseMethod):
    name = "vanilla"
