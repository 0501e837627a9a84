"""Differential privacy on the device: mechanisms, the accountant, the budget guard, DP-SGD, the planner,
and the privacy engine (`engine.PrivacyEngine`) that owns them and keeps their state on disk (`state`).

All (epsilon, delta) figures come from dp_accounting under REPLACE_ONE; see docs/privacy.md.
"""
