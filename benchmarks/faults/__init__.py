"""Faults: what a step with an inf/NaN gradient does on every stage and precision (nonfinite.py)."""
