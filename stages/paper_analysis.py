"""DVC stage (papers/dvc.yaml, `make paper`): the papers' analysis figures (the `analyses:` of
mergecal/experiments/<paper>.yaml) computed from the vision track's models; writes results/papers/analysis.json."""

import json

from stages._common import run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.experiments import load_analyses
    from mergecal.pipeline.paper_analysis import analysis_document

    analyses = [a for found in load_analyses().values() for a in found]
    document = analysis_document(params, root, analyses)
    path = atomic_write_text(root / "results" / "papers" / "analysis.json",
                             json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n")
    print(f"{path}: {len(document)} analyses ({', '.join(document)})")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
