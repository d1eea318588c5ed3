"""DVC stage: each fine-tuned text model's own scores (normalized accuracy's denominator) and norms."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.text.built import stages as text

    report = text.references(params, root, seed=args.seed, device=device(params))
    print("fine-tuned test accuracy: " + ", ".join(f"{t} {r['test_accuracy']:.3f}" for t, r in report.items()))


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
