"""One lm-eval scoring call of the LLM track's model shape: `simple_evaluate` (what evaluate_lm used until
2026-11-25) against `evaluate_lm` (lm-eval's `evaluator.evaluate` on a model object, without simple_evaluate's
environment report), alternated in one process on the same random tiny Llama, the three validation tasks at the
default sizes. Prints both medians, their ratio, and whether the scores are equal.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/perf_lm_eval_call.py [--repeats 4]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.backbones.hf_causal_lm import save_causal_lm  # noqa: E402
from mergecal.data.llm import LlmSuiteConfig, build_llm_suite, load_records  # noqa: E402
from mergecal.evaluation import lm_eval_tasks  # noqa: E402
from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer  # noqa: E402

NAMES = ["maximum_validation", "knowledge_validation", "sentiment_validation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="calls of each (the first is a warm-up)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="perf_lm_eval_"))
    root = tmp / "data"
    build_llm_suite(root, LlmSuiteConfig(n_pretrain=400, n_train=100, n_validation=150, n_test=300))
    shape = TinyLlamaShape()  # the default track's shape (params.yaml llm.shape)
    tokenizer = train_tokenizer([r["text"] for r in load_records(root, "pretrain", "train")], shape.vocab_size)
    model_dir = save_causal_lm(create_tiny_llama(tokenizer, shape, seed=1), tokenizer, tmp / "model")
    task_dir = tmp / "tasks"
    lm_eval_tasks.write_task_yamls(root, task_dir, splits=("validation", "test"))

    def simple():
        import lm_eval
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(task_dir.resolve()), include_defaults=False)
        res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model_dir), "dtype": "float32"},
                                      tasks=NAMES, task_manager=manager, device="cpu", batch_size=32, limit=150,
                                      bootstrap_iters=0, log_samples=False)
        return {t: lm_eval_tasks._metrics(res["results"][t]) for t in NAMES}

    def ours():
        out = lm_eval_tasks.evaluate_lm(model_dir, NAMES, task_dir, limit=150, device="cpu", batch_size=32)
        return {t: {k: v for k, v in s.items() if k != "n"} for t, s in out.items()}

    times, results = {"simple_evaluate": [], "evaluate_lm": []}, {}
    for _ in range(args.repeats):
        for name, fn in (("simple_evaluate", simple), ("evaluate_lm", ours)):
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v[1:]) for k, v in times.items()}
    for name, seconds in medians.items():
        print(f"{name:16s} median {seconds:.2f} s  (all: {', '.join(f'{t:.2f}' for t in times[name])})")
    print(f"ratio simple_evaluate / evaluate_lm: {medians['simple_evaluate'] / medians['evaluate_lm']:.2f}")
    print(f"scores equal: {results['simple_evaluate'] == results['evaluate_lm']}  {results['evaluate_lm']}")


if __name__ == "__main__":
    main()
