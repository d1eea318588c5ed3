"""DVC stage (always run; cheap): size and sha256 of each file the `local_llm` tracks' loaders read of their
model directories and task files, and of the `local_clip` tracks' checkpoints and datasets (no other file of
those paths: a path holding none of them is refused), hashes cached by path, size and mtime (.mergecal/hashes),
so a multi-GB checkpoint is read only when it changed. Its output is the dependency through which DVC reruns
`local_tracks` on a changed byte."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.tracks import lab_files

    recorded = lab_files.record_inputs(params, root)
    for name, track in recorded.items():
        missing = [role for role, entry in track["files"].items() if "missing" in entry]
        errors = [f"{role}: {entry['error']}" for role, entry in track["files"].items() if "error" in entry]
        size = sum(entry.get("size", 0) for entry in track["files"].values())
        print(f"{name}: {len(track['files'])} files, {size / 2**30:.2f} GiB"
              + (f"; missing: {', '.join(missing)}" if missing else "")
              + (f"; unusable: {'; '.join(errors)}" if errors else ""))


if __name__ == "__main__":
    raise SystemExit(run(stage))
