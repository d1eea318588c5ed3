"""How a report words a claim checked on paired intervals, shared by every paper's report (``papers``,
``paper_comparisons``): a unit's verdict from its interval, the claim's word from the counts, the sentence under it,
and the formats of a value and a change."""

from __future__ import annotations

from collections.abc import Mapping

from ..intervals import Interval

#: the reference rows under an experiment's table, in this order: the multi-task model is the papers' ceiling row
#: ("Traditional MTL", "Multi-task"), one model fine-tuned on all tasks at once (the vision track's standard regime)
REFERENCE_ROWS = {"finetuned": "the fine-tuned models, each on its own task",
                  "multitask": "one model fine-tuned on all tasks at once, the papers' multi-task ceiling",
                  "zeroshot": "the pretrained model"}

VERDICTS = ("agrees", "disagrees", "inconclusive")
MARK = {"agrees": "▲", "disagrees": "▼", "inconclusive": "≈"}


def interval_points(interval: Interval | None) -> list[float] | None:
    return None if interval is None else [round(100 * interval[0], 2), round(100 * interval[1], 2)]


def verdict(interval: list | None, expected: str) -> str | None:
    """``agrees`` / ``disagrees`` / ``inconclusive`` for an interval of a change the paper says is a ``gain``
    (above 0) or a ``loss``; None without an interval."""
    if interval is None:
        return None
    low, high = interval
    sign = 1 if low > 0 else -1 if high < 0 else 0
    if sign == 0:
        return "inconclusive"
    return "agrees" if (sign > 0) == (expected == "gain") else "disagrees"


def overall(counts: Mapping[str, int]) -> str:
    """The claim's word from its verdicts: agrees in direction (some agree, none disagree, no more undecided than
    agree; else "agrees where decided, mostly inside the noise"), disagrees (the reverse), mostly agrees / mostly
    disagrees (one side at least three times the other), mixed, or inconclusive (no unit decided)."""
    agree, disagree, undecided = counts.get("agrees", 0), counts.get("disagrees", 0), counts.get("inconclusive", 0)
    if agree and not disagree:
        return "agrees in direction" if agree >= undecided else "agrees where decided, mostly inside the noise"
    if disagree and not agree:
        return "disagrees" if disagree >= undecided else "disagrees where decided, mostly inside the noise"
    if agree >= 3 * disagree > 0:
        return "mostly agrees"
    if disagree >= 3 * agree > 0:
        return "mostly disagrees"
    if agree and disagree:
        return "is mixed"
    return "is inconclusive"


def sentence(text: str, counts: Mapping[str, int], unit: str, unmeasured: int = 0,
             rule: str = "paired 95 % interval excludes 0 on the paper's side") -> str:
    """The claim and what the testbed shows, computed from the verdict counts (``unmeasured``: units without a
    cell or its per-example scores, outside the counts; ``rule``: when a unit agrees)."""
    total = sum(counts.get(v, 0) for v in VERDICTS)
    missing = f" ({unmeasured} not measured)" if unmeasured else ""
    if not total:
        return f"“{text}”: no cell of the testbed measured it{missing}."
    return (f"“{text}”: the testbed {overall(counts)} — {counts.get('agrees', 0)} of {total} {unit} agree "
            f"({rule}), {counts.get('disagrees', 0)} disagree, "
            f"{counts.get('inconclusive', 0)} inside the noise{missing}.")


def fmt_interval(v: float | None, interval: list | None = None) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" + (f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "")


def fmt_change(interval: list | None, mid: float | None) -> str:
    if interval is None or mid is None:
        return ""
    mark = "▲" if interval[0] > 0 else "▼" if interval[1] < 0 else "≈"
    return f"{mid:+.1f} [{interval[0]:+.1f}, {interval[1]:+.1f}] {mark}"
