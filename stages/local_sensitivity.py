"""DVC stage: each `local_clip` track's magnitude-sensitivity ranking (MAGIC's probe on the weight-averaged
image encoder, on a seeded sample of the tasks' train splits), read by the cells whose chain has WSC or FSC
(`{merge}>wsc`, `{merge}>dsc`, ...). A track that cannot be probed is recorded with its one-line error."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.files.calibration import all_tracks

    all_tracks(params, root, "probe", device=device(params))


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
