"""LLM tracks from local directories (``local_llm:`` in params.yaml): their cells (``cells``) and what their
stages check and record (``stages``)."""

from .params import SECTION, LocalLlmTrack  # noqa: F401  (its params.yaml section)

TRACK = "local_llm"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
