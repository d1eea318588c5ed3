"""DVC stage: each `local_clip` track's DisTaC-conditioned image encoders (the paper's preset; one model
distilled at a time on unlabeled train images of its task), read by the cells whose chain starts with
`distac`. A track that cannot be conditioned is recorded with its one-line error."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.files.calibration import all_tracks

    all_tracks(params, root, "distac", device=device(params))


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
