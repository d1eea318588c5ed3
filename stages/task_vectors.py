"""DVC stage: task vectors per regime, with norms, entropies and the fine-tuned reference accuracies."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    for regime, tasks in vision.task_vectors(params, root, seed=args.seed, device=device(params)).items():
        acc = sum(t["test_accuracy"] for t in tasks.values()) / len(tasks)
        print(f"{regime}: fine-tuned test accuracy {acc:.3f}; norms "
              + ", ".join(f"{name} {t['norm']:.2f}" for name, t in tasks.items()))


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
