"""DVC stage: the LLM suite (synthetic corpus and one task per expert, JSON lines)."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm

    manifest = llm.build_data(params, root)
    print("LLM suite: " + ", ".join(f"{name} {n}" for name, n in manifest["sizes"].items()))


if __name__ == "__main__":
    raise SystemExit(run(stage))
