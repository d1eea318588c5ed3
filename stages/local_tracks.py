"""DVC stage: each `local_llm` track's references (lm-eval scores of its base and experts on validation and
test, task-vector norms read key by key; the suite's data for suite tasks) and each `local_clip` track's
(zero-shot heads; zero-shot and fine-tuned accuracy per task on validation and test; task-vector norms). A
model or dataset that fails its checks is recorded with its one-line error and the stage goes on: the cells
that need it fail with that line."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks import lab_files

    start = time.perf_counter()
    references = lab_files.all_references(params, root, device=device(params))
    for line in lab_files.report_lines(params, references):
        print(line)
    print(f"scored in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
