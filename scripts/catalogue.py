"""docs/papers.md from mergecal/experiments/catalogue.yaml: every table and figure of the three papers, what each
shows and what mergecal does with it, with the counts per paper and status.

    python -m scripts.catalogue --write   # render docs/papers.md
    python -m scripts.catalogue --check   # exit 1 when docs/papers.md is not the rendering (tests/test_catalogue.py)
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from mergecal.experiments import read

DOC = Path("docs/papers.md")
PAPERS = {"svc": "When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging (arXiv:2602.05536)",
          "magic": "MAGIC: Achieving Superior Model Merging via Magnitude Calibration (arXiv:2512.19320)",
          "distac": "DisTaC: Conditioning Task Vectors via Distillation for Robust Model Merging (arXiv:2508.01148)"}
STATUSES = ("regenerated", "paper", "measured", "partial", "planned", "needs_pool", "out_of_scope")
#: each status's own key: where it is regenerated, what is missing, the issue, the preset or the reason
DETAIL = {"regenerated": "where", "paper": "section", "measured": "section", "partial": "missing", "planned": "issue",
          "needs_pool": ("preset", "reason"), "out_of_scope": "reason"}
MEANING = {
    "regenerated": "the default run (`make run`) computes it on the testbed",
    "paper": "the papers' profile (`make paper`) computes it: its section of reports/papers/<paper>.md",
    "measured": "a cost measured once (its `make` target) and committed; its section of reports/papers/<paper>.md "
                "reads it",
    "partial": "the library has what it takes; no stage runs or shows it yet",
    "planned": "not yet: the issue that plans it",
    "needs_pool": "needs the published checkpoints (a preset runs it where they are present) or a GPU",
    "out_of_scope": "not reproducible here, with the reason"}


HOW = """## The papers' profile: `make paper`

`make paper` (`dvc repro papers/dvc.yaml`) runs after the default run and reuses every cell it shares with it:
- **regimes** of the papers (`vision.paper_regimes` in params.yaml, `mergecal/regimes.py`): DisTaC's norm mismatch
  with each other task lengthened in turn (`norm_mismatch_<task>`), label smoothing 0.01 (`label_smoothing_0.01`),
  `mixup` and `focal`: each one stage `paper_regime@<seed>-<regime>`, cached on its own, that fine-tunes only what
  the default run has not (a norm-mismatch regime: its one lengthened task), writes its diagnostics and runs DisTaC
  with each step's test accuracy, entropy and norm (its trajectory) under
  `models/<backbone>/papers/seeds/<seed>/<regime>/`;
  stage `paper_trajectories` repeats the default run's DisTaC with the same observer (bit for bit its models).
- **the seq2seq track** (`seq2seq` in params.yaml, [seq2seq.md](seq2seq.md)): a tiny T5 pretrained by span
  corruption (stage `paper_seq2seq_base`) and, per fine-tuning seed, its experts fully fine-tuned (regime `standard`)
  and tuned with IA3 (`ia3`) with their references (`paper_seq2seq@<seed>`); its regimes run in this profile only,
  for the SVC and MAGIC papers' T5 / T0 tables (`svc.tab12`, `svc.tab13`, `magic.tab4`).
- **LoRA experts** (`llm.paper_regimes` in params.yaml, [llm-track.md](llm-track.md)): the LLM track's regime `lora`,
  a peft LoRA adapter of the tiny Llama per task (stage `paper_llm_lora@<seed>`), merged and calibrated as the
  papers' tables merge IA3 experts (`svc.lora`, `magic.lora`: no paper prints these rows).
- **experiments** (`experiments:` in `mergecal/experiments/svc.yaml` and `magic.yaml`): a track, its regimes, the
  merges, a base chain and its variants, listed (`variants: {row: "{merge}>svc(space='row')"}`) or swept
  (`sweep:` a parameter's `values` in `{value}`, each task's index in `{index}` with `over: tasks`, or the first N
  keys of the probed sensitivity ranking in `{sensitive}` with `over: sensitive_top`), at a fixed `scaling` (the
  papers' ablations: SVC at 1, MAGIC's task arithmetic and TIES at 0.3) or searched as the matrix does (and a
  base at the variants' scaling or, `base_scaling: searched`, the board's tuned merge); a merge the default matrix
  leaves out takes its settings from `merge_settings:` (layer-wise AdaMerging in `magic.lwa`), and a claim's
  `than_merge` pairs each merge with another merge's row. They run as cells of the
  benchmark: the tracks' own cells, ids and cache (a variant the matrix runs is that cell), through the same Prefect
  flow and MLflow store (`mergecal/pipeline/experiments.py`, stage `paper_cells`).
- **comparisons** (`comparisons:` in `distac.yaml`): the same merges and chains across settings, a setting one
  regime or the mean of several (the norm mismatch over its eight configurations, each configuration shown too), each
  paired with the reference setting (the paper's Original) on the same test examples; claims `gain`, `loss` or `par`
  (not below the reference: the paired interval reaches 0) within a setting or against another. `rescale>{merge}`
  is DisTaC's kappa alone (`mergecal/calibrations/rescale.py`, the paper's Fig. 8).
- **analyses** (`analyses:`): figures computed from the vision track's models rather than from cells: the SVC
  paper's spectra and cross terms (`mergecal/analysis/svc_spectrum.py`), MAGIC's feature magnitudes, layer swaps,
  per-task sensitivity and FSC coefficients (`mergecal/analysis/magic_features.py`), DisTaC's norms, entropies,
  trajectories, kappa sweep, reliability diagrams and per-layer norms (`mergecal/analysis/distac_figures.py`,
  `mergecal/pipeline/distac_analysis.py`; stage `paper_analysis`).
- **significance** (`significance:` in `magic.yaml`, `svc.yaml` and `distac.yaml`): MAGIC's all-subsets test of
  a calibration claim: every subset of at least two of the vision track's experts (under a norm mismatch, those
  holding the lengthened task) merged with and without the calibration at a fixed scaling, as the track's own cells
  (`cells.run_cell`, not logged), the paired t-test over the subsets and the share each way
  (`mergecal/analysis/significance.py`, `mergecal/pipeline/paper_significance.py`; stage `paper_significance`).
- **measurements** (`measurements:`): a method's own cost, measured once by its `make` target (`make perf-svc`) into
  a committed file the report reads; `make paper` never times anything.
- **reports** (stage `paper_reports`): `reports/papers/<paper>.{md,html,json}` and their plots, committed like the
  board. Per item: what the paper shows, the testbed's table (each value with its 95 % bootstrap interval, each
  variant's change against its base with the paired interval) and plot, the paper's printed numbers where it prints
  them, and under each of the paper's `claims` a sentence computed from the intervals: agrees in direction,
  disagrees, mixed or inconclusive, with the counts. An analysis is an exact function of one set of fine-tunes: its
  claims are counted without an interval, and say so.

Adding an item: an entry in the paper's YAML (its `id` the catalogue's), then `status: paper` and `section:` here.
Cost: docs/performance.md."""


def detail(item: dict) -> str:
    status = item["status"]
    if status in ("paper", "measured"):
        return f"[reports/papers/{item['paper']}.md]({'../reports/papers/'}{item['paper']}.md) § `{item['section']}`"
    if status == "planned":
        return f"issue #{item['issue']}"
    if status == "needs_pool":
        if "preset" not in item:
            return str(item["reason"])
        named = item["preset"] if isinstance(item["preset"], list) else [item["preset"]]
        return "preset " + ", ".join(f"`{name}`" for name in named)
    key = DETAIL[status]
    return str(item[key])


def render(items: list[dict]) -> str:
    counts = Counter((i["paper"], i["status"]) for i in items)
    lines = ["# The papers' tables and figures", "",
             "Every table and figure of the three papers mergecal implements, what each shows and what mergecal does "
             "with it: generated from `mergecal/experiments/catalogue.yaml` by `python -m scripts.catalogue --write` "
             "(`tests/test_catalogue.py` fails when this page or a report section drifts).", "",
             *HOW.splitlines(), "", "| status | meaning |", "|---|---|"]
    lines += [f"| {s} | {MEANING[s]} |" for s in STATUSES] + [
             "", "| paper | items | " + " | ".join(STATUSES) + " |", "|---|---|" + "---|" * len(STATUSES)]
    for paper in PAPERS:
        row = [str(counts[(paper, s)]) for s in STATUSES]
        lines.append(f"| {paper} | {sum(counts[(paper, s)] for s in STATUSES)} | " + " | ".join(row) + " |")
    lines.append(f"| all | {len(items)} | " + " | ".join(str(sum(counts[(p, s)] for p in PAPERS))
                                                   for s in STATUSES) + " |")
    for paper, title in PAPERS.items():
        lines += ["", f"## {title}", "", "| item | shows | the paper's claim | status | where / what is missing |",
                  "|---|---|---|---|---|"]
        for item in (i for i in items if i["paper"] == paper):
            cells = [item["item"], item["shows"], item["claim"], item["status"], detail(item)]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.catalogue", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    text = render(read("catalogue")["items"])
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC}: not the rendering of mergecal/experiments/catalogue.yaml; run python -m scripts.catalogue "
                  "--write")
            return 1
        return 0
    DOC.write_text(text)
    print(f"{DOC}: {len(read('catalogue')['items'])} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
