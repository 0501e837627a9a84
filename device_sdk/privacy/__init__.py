"""Differential privacy on the device: mechanisms, the accountant, the budget guard, DP-SGD, the planner.

All (epsilon, delta) figures come from dp_accounting under REPLACE_ONE; see docs/privacy.md.
"""
