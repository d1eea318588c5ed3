"""DVC stage: each `local_llm` track's references (lm-eval scores of its base and experts on validation and
test, task-vector norms read key by key; the suite's data for suite tasks) and each `local_clip` track's
(zero-shot heads; zero-shot and fine-tuned accuracy per task on validation and test; task-vector norms). A
model or dataset that fails its checks is recorded with its one-line error and the stage goes on: the cells
that need it fail with that line."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.local_llm import stages as local_llm

    start = time.perf_counter()
    for name, report in local_llm.all_references(params, root, device=device(params)).items():
        if "error" in report:
            print(f"{name}: ERROR {report['error']}")
            continue
        for task, info in report["tasks"].items():
            if "error" in info:
                print(f"{name}/{task}: ERROR {info['error']}")
            elif report.get("kind") == "clip":
                print(f"{name}/{task}: fine-tuned {info['test_accuracy']:.3f}, zero-shot "
                      f"{info['zeroshot']['test']['accuracy']:.3f} (test, {info['n']['test']} images); "
                      f"|tau| {info['norm']:.2f} ({info['relative_norm']:.4f} of |theta_0|)")
            else:
                base = report["base"]["test"]
                print(f"{name}/{task}: expert {info['test_accuracy']:.3f}, base {base[task]:.3f}; "
                      f"|tau| {info['norm']:.2f} ({info['relative_norm']:.4f} of |theta_0|)")
    print(f"scored in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
