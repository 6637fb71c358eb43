"""What a bench check reports: each figure beside the target it is held to, and whether it kept it.

A check (bench/checks/) measures a bound that the project promises (a lease ends within 1 s of its end
under load, the database stays within 1.2x under churn, ...) and returns its :class:`Figure` s; ``python -m
bench checks`` prints them in one table and exits 1 when one missed its target. The figures are of this
machine at the time of the run: CI runs the checks alone on its machine, after the test suite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    check: str  # the check's name, and what it ran on: "lease-load (SQLite)"
    measure: str  # what the figure is: "pushed after the lease's end, max"
    value: float
    unit: str
    limit: float  # the target: the figure at most this (or at least, with ``at_least``)
    at_least: bool = False
    digits: int = 0
    detail: str = ""  # the figures around it: percentiles, the machine's load

    @property
    def kept(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def target(self) -> str:
        sign = ">=" if self.at_least else "<="
        return f"{sign} {self.limit:,.{self.digits}f}{self.unit_suffix}"

    @property
    def unit_suffix(self) -> str:
        return f" {self.unit}" if self.unit and self.unit != "x" else self.unit

    def line(self) -> str:
        verdict = "kept" if self.kept else "MISSED"
        figure = f"{self.value:,.{self.digits}f}{self.unit_suffix}"
        return f"{verdict:<6}  {self.check}: {self.measure}: {figure} (target {self.target})"
