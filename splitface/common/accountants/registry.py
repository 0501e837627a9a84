"""Accountants by name: `create_accountant("ledger", delta)` and the like, for callers (and saved
configurations) that name the accounting they want rather than import its class."""
from __future__ import annotations

from typing import Any

from splitface.common.accountants.base import Accountant
from splitface.common.accountants.clusters import ClusterAccountant
from splitface.common.accountants.ledger import PrivacyAccountant
from splitface.common.accountants.user_level import UserLevelAccountant

ACCOUNTANTS: dict[str, type[Accountant]] = {cls.name: cls for cls in (PrivacyAccountant, UserLevelAccountant,
                                                                      ClusterAccountant)}


def create_accountant(name: str, *args: Any, **kwargs: Any) -> Accountant:
    """A new accountant of kind `name` ("ledger": per image / identity, args (delta, ...); "user_level":
    Poisson-sampled federated rounds; "clusters": PrivacyFace's releases, args (DPLC config, clients))."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {tuple(ACCOUNTANTS)}, not {name!r}")
    return ACCOUNTANTS[name](*args, **kwargs)
