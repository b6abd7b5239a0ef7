"""Per-request speculative decoding counters (docs/architecture.md §8) and the ratios derived
from them.

    spec_verify_ct         verify steps (forwards that checked at least one draft)
    spec_proposed_drafts   drafts proposed to those steps
    spec_accepted_drafts   drafts accepted
    spec_accept_histogram  h[i] = verify steps that accepted i drafts: sum h = verify_ct,
                           sum i * h[i] = accepted
    spec_accept_length     (accepted + verify_ct) / verify_ct: tokens committed per verify step

A request with no verify step (max_tokens 1, aborted early, nothing ever drafted) reports
verify_ct 0 and null ratios: never a division by zero, never a made-up 1.0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    verify_ct: int = 0
    proposed: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of `proposed` drafts, `accepted` of them accepted."""
        assert 0 <= accepted <= proposed and proposed > 0
        self.verify_ct += 1
        self.proposed += proposed
        self.accepted += accepted
        if len(self.histogram) <= accepted:
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another sequence's counters (the samples of a request with n > 1)."""
        self.verify_ct += other.verify_ct
        self.proposed += other.proposed
        self.accepted += other.accepted
        h = self.histogram
        h.extend([0] * (len(other.histogram) - len(h)))
        for i, c in enumerate(other.histogram):
            h[i] += c

    def to_dict(self) -> dict:
        n = self.verify_ct
        return {
            "spec_verify_ct": n,
            "spec_proposed_drafts": self.proposed,
            "spec_accepted_drafts": self.accepted,
            "spec_accept_length": (self.accepted + n) / n if n else None,
            "spec_accept_histogram": list(self.histogram),
        }

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        return cls(
            d["spec_verify_ct"], d["spec_proposed_drafts"], d["spec_accepted_drafts"],
            list(d["spec_accept_histogram"]),
        )


def merge_spec(specs: Iterable[dict | None]) -> dict | None:
    """The counters of several sequences or requests as one `to_dict()` (None when none has
    any: speculation off)."""
    given = [d for d in specs if d is not None]
    if not given:
        return None
    total = SpecStats()
    for d in given:
        total.merge(SpecStats.from_dict(d))
    return total.to_dict()
