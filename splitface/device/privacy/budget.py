"""Refuse a release before it is sent if it would take any image (or identity) past the budget."""
from __future__ import annotations

import copy
from typing import Sequence

from dp_accounting.dp_event import DpEvent

from splitface.common.accountants.ledger import LEVELS, PrivacyAccountant


class BudgetExceeded(Exception):
    """A release was refused; nothing was recorded for it (and it must not be sent)."""

    def __init__(self, release: str, level: str, ids: list[int], spent: float, would_be: float,
                 budget: float) -> None:
        self.release, self.level, self.ids = release, level, ids
        self.spent, self.would_be, self.budget = spent, would_be, budget
        shown = ", ".join(str(i) for i in ids[:10]) + (f", ... ({len(ids)} in all)" if len(ids) > 10 else "")
        super().__init__(
            f"release {release!r} refused: {level} {shown} has spent epsilon {spent:.4g} and would reach "
            f"{would_be:.4g}, over the budget {budget:.4g}"
        )


class BudgetGuard:
    """Admits a release only if every image (level "image") or identity (level "identity") it touches
    stays within ``epsilon``; admitted releases are recorded in the accountant.

    Checking before recording, rather than stopping once a figure is exceeded, is what makes the
    budget a guarantee: the refused release is never sent.
    """

    def __init__(self, accountant: PrivacyAccountant, epsilon: float, level: str = "image") -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
        if not epsilon > 0:
            raise ValueError(f"budget epsilon must be > 0, got {epsilon}")
        self.accountant, self.epsilon, self.level = accountant, float(epsilon), level

    def admit(self, release: str, image_ids: Sequence[int], identities: Sequence[int], event: DpEvent,
              *, joint: bool = False) -> None:
        """Record the release, or raise BudgetExceeded (recording nothing). A replayed key is free."""
        after = self.accountant.epsilon_after(image_ids, identities, event, self.level, release=release,
                                              joint=joint)
        over = {k: v for k, v in after.items() if v[2] and v[1] > self.epsilon}
        if over:
            worst = max(over, key=lambda k: over[k][1])
            raise BudgetExceeded(release, self.level, sorted(over), over[worst][0], over[worst][1], self.epsilon)
        self.accountant.record(release, image_ids, identities, event, joint=joint)

    def admit_all(self, admissions: Sequence[tuple[str, DpEvent, bool]], image_ids: Sequence[int],
                  identities: Sequence[int]) -> None:
        """Admit several releases of the same images together, `(release, event, joint)` each: all of them are
        recorded, or none (BudgetExceeded) if their composition takes anyone past the budget."""
        if len(admissions) == 1:
            release, event, joint = admissions[0]
            self.admit(release, image_ids, identities, event, joint=joint)
            return
        trial = BudgetGuard(copy.deepcopy(self.accountant), self.epsilon, self.level)  # each counts for the next
        for release, event, joint in admissions:
            trial.admit(release, image_ids, identities, event, joint=joint)
        for release, event, joint in admissions:
            self.accountant.record(release, image_ids, identities, event, joint=joint)
