"""DVC stage: each `local_llm` track's references (lm-eval scores of its base and experts on validation and
test, task-vector norms read key by key; the suite's data for suite tasks). A model that fails its checks is
recorded with its one-line error and the stage goes on: the cells that need it fail with that line."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline import local_llm

    start = time.perf_counter()
    for name, report in local_llm.all_references(params, root, device=device(params)).items():
        if "error" in report:
            print(f"{name}: ERROR {report['error']}")
            continue
        base = report["base"]["test"]
        for task, info in report["tasks"].items():
            if "error" in info:
                print(f"{name}/{task}: ERROR {info['error']}")
            else:
                print(f"{name}/{task}: expert {info['test_accuracy']:.3f}, base {base[task]:.3f}; "
                      f"|tau| {info['norm']:.2f} ({info['relative_norm']:.4f} of |theta_0|)")
    print(f"scored in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage))
