"""Speculative-decoding metrics, per request and summed (names as vLLM's spec-decode metrics).

tau (mean acceptance length) = tokens emitted per target forward pass over speculative steps
= 1 + accepted / drafts; acceptance rate = accepted draft tokens / drafted tokens. Steps that drafted
a lookup's chain (n-gram, suffix, a pairing's lookup) are also counted by the length of the context
match that found the chain (1, 2, ..., >= MAX_MATCH_KEY), the quantity adaptive k prices them by.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.spec.adaptive import MAX_MATCH_KEY


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # target passes that verified >= 1 drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [pos] accepted at draft position pos
    drafted_per_pos: list[int] = field(default_factory=list)
    target_passes: int = 0  # every target forward after prefill (plain steps included)
    draft_time: float = 0.0
    verify_time: float = 0.0
    emitted_tokens: int = 0
    # match length (capped at MAX_MATCH_KEY) -> [lookup drafts, drafted tokens, accepted tokens]
    by_match_length: dict[int, list[int]] = field(default_factory=dict)

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int, match_len: int = 0,
               depth: int | None = None) -> None:
        """One verify pass: num_drafted tokens (a tree's nodes), num_accepted of them on the emitted path.
        By position the pass drafted `depth` positions (a tree's deepest path; None: a chain's num_drafted):
        a tree of 9 nodes 3 deep counted positions 3-8, which no accepted path reaches."""
        self.target_passes += 1
        self.emitted_tokens += num_emitted
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if match_len > 0:
            row = self.by_match_length.setdefault(min(match_len, MAX_MATCH_KEY), [0, 0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + num_drafted, row[2] + num_accepted
        positions = num_drafted if depth is None else depth
        while len(self.drafted_per_pos) < positions:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for pos in range(positions):
            self.drafted_per_pos[pos] += 1
            self.accepted_per_pos[pos] += pos < num_accepted

    def merge(self, other: "SpecMetrics") -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_passes",
                     "draft_time", "verify_time", "emitted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos),
                             (self.drafted_per_pos, other.drafted_per_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        for n, (drafts, drafted, accepted) in other.by_match_length.items():
            row = self.by_match_length.setdefault(n, [0, 0, 0])
            row[0], row[1], row[2] = row[0] + drafts, row[1] + drafted, row[2] + accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau over speculative steps (accepted + 1 per draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_pass(self) -> float:
        """Emitted tokens per target pass over all decode steps, speculative or not."""
        return self.emitted_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "target_passes": self.target_passes,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_target_pass": round(self.tokens_per_pass, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "draft_time_s": round(self.draft_time, 4), "verify_time_s": round(self.verify_time, 4),
            **({"lookup_by_match_length": match_length_table(self.by_match_length)} if self.by_match_length else {}),
        }


def match_length_table(rows: dict) -> dict[str, dict]:
    """{match length: [drafts, drafted, accepted]} as {"n": {drafts, draft_tokens, acceptance_rate}}."""
    return {str(n): {"drafts": d, "draft_tokens": t, "acceptance_rate": round(a / t, 4) if t else 0.0}
            for n, (d, t, a) in sorted(rows.items(), key=lambda kv: int(kv[0]))}
