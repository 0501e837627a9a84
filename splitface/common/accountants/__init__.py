"""Privacy accountants: one interface (base.Accountant), a registry (registry.create_accountant), and
the accountants behind it (ledger, user_level, clusters)."""
from splitface.common.accountants.base import Accountant, rdp_epsilon
from splitface.common.accountants.registry import ACCOUNTANTS, create_accountant

__all__ = ["ACCOUNTANTS", "Accountant", "create_accountant", "rdp_epsilon"]
