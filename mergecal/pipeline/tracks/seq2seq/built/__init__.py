"""The seq2seq track: a tiny T5 and its experts, full fine-tunes (regime ``standard``) and IA³ adapters (regime
``ia3``), scored by rank classification (``cells``), built by the papers' profile's stages (``stages``)."""

from .params import SECTION, Seq2SeqTrack  # noqa: F401  (its params.yaml section)

TRACK = "seq2seq"  # its name in params.yaml and the leaderboard (``mergecal.pipeline.track_registry``)
