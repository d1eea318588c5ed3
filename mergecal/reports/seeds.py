"""Across seeds: each leaderboard row's value and each calibration's change, from one run per seed.

A row's test-example interval (``mergecal.intervals``) says how much another draw of test examples would
move it; another seed (other fine-tunes, other training noise) can move it more (docs/calibration-evidence.md,
"Across seeds"), so a claim about a calibration should hold on every seed.

Input: ``{seed: leaderboard.json document}`` (``write_reports``' JSON). For every row present in every seed's run:
its value per seed, the mean, the sample standard deviation and the range across seeds (points); for a calibrated
row, its change against its base merge per seed with that seed's verdict (gain / loss / none: its paired
test-example interval), the mean change with a 95 % t-interval across seeds (``scipy.stats.t``; it needs two
seeds and is wide with few), and the verdict across seeds (``VERDICTS``): ``gain`` or ``loss`` when every seed's
paired interval says so, ``contradicting`` when one seed's says gain and another's loss, ``unreplicated`` when
some seeds' say gain (or loss) and the others' include 0, ``none`` when no seed's excludes 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

METRIC = "avg_acc"
LEVEL = 0.95
ARROWS = {"gain": "▲", "loss": "▼", "none": "≈"}
VERDICTS = ("gain", "loss", "contradicting", "unreplicated", "none")

RowKey = tuple[str, str, str, str]  # backbone, task set, regime, row name


@dataclass(frozen=True)
class SeedRow:
    key: RowKey
    role: str
    values: dict[int, float]  # seed -> average accuracy, points
    changes: dict[int, float]  # seed -> change against the base merge, points (calibrated rows)
    verdicts: dict[int, str]  # seed -> gain / loss / none

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values.values())

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values.values()) if len(self.values) > 1 else None

    @property
    def spread(self) -> float:
        return max(self.values.values()) - min(self.values.values())

    @property
    def mean_change(self) -> float | None:
        return statistics.fmean(self.changes.values()) if self.changes else None

    @property
    def change_interval(self) -> tuple[float, float] | None:
        """The 95 % t-interval of the mean change across seeds (None with fewer than two seeds)."""
        return t_interval(list(self.changes.values()))

    @property
    def verdict(self) -> str:
        return across_seeds(list(self.verdicts.values()))


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """mean ± t_{(1+level)/2, n-1} * sd / sqrt(n); None for fewer than two values."""
    from scipy.stats import t

    if len(values) < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = float(t.ppf((1 + level) / 2, len(values) - 1)) * sd / math.sqrt(len(values))
    return mean - half, mean + half


def across_seeds(verdicts: list[str]) -> str:
    """The verdict across seeds of the per-seed verdicts (gain / loss / none each): see the module docstring."""
    found = set(verdicts)
    if found in ({"gain"}, {"loss"}):
        return verdicts[0]
    if {"gain", "loss"} <= found:
        return "contradicting"
    return "unreplicated" if found - {"none"} else "none"


def flat_rows(document: Mapping) -> dict[RowKey, dict]:
    """(backbone, task set, regime, row name) -> row of a leaderboard.json document, for the rows with a value."""
    return {(backbone, task_set, regime, name): row
            for backbone, sets in document["leaderboard"].items()
            for task_set, regimes in sets.items()
            for regime, rows in regimes.items()
            for name, row in rows.items()
            if (row.get("values") or {}).get(METRIC) is not None}


def seed_rows(documents: Mapping[int, Mapping]) -> list[SeedRow]:
    """One ``SeedRow`` per row present in every seed's leaderboard, in the first seed's order."""
    if not documents:
        raise ValueError("seed_rows: no leaderboard given")
    per_seed = {seed: flat_rows(doc) for seed, doc in documents.items()}
    first = next(iter(per_seed.values()))
    out = []
    for key, row in first.items():
        if not all(key in rows for rows in per_seed.values()):
            continue
        values = {seed: 100 * rows[key]["values"][METRIC] for seed, rows in per_seed.items()}
        changes, verdicts = {}, {}
        if row.get("role") == "calibrated" and not row.get("ill_posed"):
            for seed, rows in per_seed.items():
                if METRIC in rows[key].get("delta_points", {}):
                    changes[seed] = rows[key]["delta_points"][METRIC]
                    verdicts[seed] = rows[key]["significant"][METRIC]
            if len(changes) != len(per_seed):
                changes, verdicts = {}, {}
        out.append(SeedRow(key, row.get("role", ""), values, changes, verdicts))
    return out


def documents_by_seed(leaderboard: Mapping) -> dict[int, dict]:
    """``{seed: leaderboard document}`` (``seed_rows``' input) of one run's leaderboard.json ``leaderboard`` with
    several fine-tuning seeds (``{"seed_<s>": {backbone: ...}}``, ``mergecal.reports.leaderboard.tables_json``)."""
    return {int(key.removeprefix("seed_")): {"leaderboard": tables} for key, tables in leaderboard.items()}


def rows_json(rows: list[SeedRow]) -> list[dict]:
    """The across-seeds view as JSON (leaderboard.json's ``across_seeds``): points, rounded to 6 decimals."""
    def r(x):
        return None if x is None else round(x, 6) + 0.0

    out = []
    for row in rows:
        entry = {"backbone": row.key[0], "task_set": row.key[1], "regime": row.key[2], "row": row.key[3],
                 "role": row.role, "values": {str(s): r(v) for s, v in row.values.items()}, "mean": r(row.mean),
                 "sd": r(row.sd), "spread": r(row.spread)}
        if row.changes:
            interval = row.change_interval
            entry.update({"changes": {str(s): r(v) for s, v in row.changes.items()},
                          "verdicts": {str(s): v for s, v in row.verdicts.items()},
                          "mean_change": r(row.mean_change),
                          "change_ci95": None if interval is None else [r(interval[0]), r(interval[1])],
                          "verdict": row.verdict})
        out.append(entry)
    return out


def verdict_counts(rows: list[SeedRow]) -> dict[str, dict[str, int]]:
    """Per backbone: how many calibrated rows get each verdict across seeds (``VERDICTS``)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.changes:
            counts = out.setdefault(row.key[0], dict.fromkeys(VERDICTS, 0))
            counts[row.verdict] += 1
    return out


def _fmt_interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f"[{interval[0]:+.1f}, {interval[1]:+.1f}]"


def markdown(rows: list[SeedRow], seeds: list[int]) -> str:
    """Per backbone × task set × regime: every row's value per seed, mean ± sd, and a calibrated row's change per
    seed (▲ gain / ▼ loss / ≈ within its paired interval), mean change [95 % t-interval across seeds], verdict."""
    parts = [f"## Across seeds ({', '.join(map(str, seeds))})", "",
             "Average test accuracy (%) per seed; a calibrated row's change against its base merge per seed (▲ / ▼: "
             "its paired test-example interval excludes 0; ≈: it does not); the mean change with its 95 % "
             "t-interval across seeds; the verdict across seeds is a gain or a loss only when every seed says so.",
             ""]
    for backbone, counts in verdict_counts(rows).items():
        parts.append(f"- {backbone}: of {sum(counts.values())} calibrated rows, {counts['gain']} gain on every seed, "
                     f"{counts['loss']} lose on every seed, {counts['contradicting']} gain on one seed and lose on "
                     f"another, {counts['unreplicated']} change on some seeds only, {counts['none']} on none")
    groups: dict[tuple[str, str, str], list[SeedRow]] = {}
    for row in rows:
        groups.setdefault(row.key[:3], []).append(row)
    header = " | ".join(f"seed {s}" for s in seeds)
    for (backbone, task_set, regime), group in groups.items():
        parts += ["", f"### {backbone} · {task_set} · {regime}", "",
                  f"| row | {header} | mean ± sd | change per seed | mean change [95 % t] | across seeds |",
                  "|---|" + "---:|" * len(seeds) + "---:|---|---|---|"]
        for row in group:
            values = " | ".join(f"{row.values[s]:.1f}" for s in seeds)
            sd = "" if row.sd is None else f" ± {row.sd:.1f}"
            if row.changes:
                per_seed = ", ".join(f"{row.changes[s]:+.1f}{ARROWS[row.verdicts[s]]}" for s in seeds)
                change = f"{row.mean_change:+.1f} {_fmt_interval(row.change_interval)}"
                verdict = row.verdict
            else:
                per_seed = change = verdict = ""
            parts.append(f"| {row.key[3]} | {values} | {row.mean:.1f}{sd} | {per_seed} | {change} | {verdict} |")
    return "\n".join(parts) + "\n"
