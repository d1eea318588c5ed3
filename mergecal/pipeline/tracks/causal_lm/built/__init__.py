"""The LLM track: a tiny Llama and its experts scored with lm-eval (``cells``), built by its DVC stages
(``stages``)."""

from .params import SECTION, LlmTrack  # noqa: F401  (its params.yaml section)

TRACK = "llm"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
