"""Trajectory accounting of a supervised run: every trajectory launched ends in exactly one fate.

    launched = trained + skipped(by reason) + stale + discarded(by reason) + unconsumed
               + failed(by reason) + cancelled

trained, skipped and stale come from the run's ledger (what the saved model has consumed). The driver
knows the rest: `discarded` (returned, then thrown away on purpose, e.g. sampled after the checkpoint a
restarted trainer went back to), `unconsumed` (returned and stored, but not consumed by a training step
when the run ended: still buffered in the trainer, or finished as the last step was taken),
`failed` (died with their rollout actor, so no id ever reached the driver; counted by the group) and
`cancelled` (in flight when the run ended). Returned trajectories are checked by id: none may have two
fates (e.g. trained twice), none may have none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from loomrl.run_folder import Fates, LedgerEntry


@dataclass(slots=True, kw_only=True)
class Accounting:
    launched: int = 0
    returned: set[str] = field(default_factory=set)  # ids that came back from a rollout actor
    discarded: dict[str, str] = field(default_factory=dict)  # id -> reason
    failed: Counter[str] = field(default_factory=Counter)  # reason -> trajectories
    cancelled: int = 0

    def discard(self, ids: list[str], reason: str) -> None:
        for tid in ids:
            self.discarded[tid] = reason

    def settle(self, ledger: Sequence[LedgerEntry]) -> Fates:
        """The final tally against the ledger; `violations` lists what breaks exactly-once."""
        fates: dict[str, list[str]] = {}
        for entry in ledger:
            for tid in entry.trained:
                fates.setdefault(tid, []).append("trained")
            for reason, ids in entry.skipped.items():
                for tid in ids:
                    fates.setdefault(tid, []).append(f"skipped:{reason}")
            for tid in entry.stale:
                fates.setdefault(tid, []).append("stale")
        for tid, reason in self.discarded.items():
            fates.setdefault(tid, []).append(f"discarded:{reason}")
        # Ledger ids this segment never saw belong to an earlier segment of a resumed run: not counted.
        violations = [f"{tid}: {' + '.join(f)}" for tid, f in fates.items() if tid in self.returned and len(f) > 1]
        counts: Counter[str] = Counter(f[0] for tid, f in fates.items() if tid in self.returned)
        unconsumed = len(self.returned) - sum(counts.values())
        by = {fate: {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith(f"{fate}:")}
              for fate in ("skipped", "discarded")}
        total = (counts["trained"] + sum(by["skipped"].values()) + counts["stale"] + sum(by["discarded"].values())
                 + unconsumed + sum(self.failed.values()) + self.cancelled)
        if total != self.launched:
            violations.append(f"launched {self.launched} != sum of fates {total}")
        return Fates(launched=self.launched, trained=counts["trained"], skipped=by["skipped"], stale=counts["stale"],
                     discarded=by["discarded"], unconsumed=unconsumed, failed=dict(self.failed),
                     cancelled=self.cancelled, violations=violations)


def ledger_line(acc: Fates) -> str:
    """One readable line: launched = trained + skipped + stale + discarded + unconsumed + failed + cancelled."""

    def part(name: str, value: int | dict[str, int]) -> str:
        if isinstance(value, dict):
            inner = ", ".join(f"{k} {v}" for k, v in sorted(value.items()))
            return f"{name} {sum(value.values())}" + (f" ({inner})" if inner else "")
        return f"{name} {value}"

    parts = [part("trained", acc.trained), part("skipped", acc.skipped), part("stale", acc.stale),
             part("discarded", acc.discarded), part("unconsumed", acc.unconsumed), part("failed", acc.failed),
             part("cancelled", acc.cancelled)]
    ok = "ok" if not acc.violations else f"{len(acc.violations)} VIOLATIONS"
    return f"ledger: launched {acc.launched} = " + " + ".join(parts) + f" [{ok}]"
