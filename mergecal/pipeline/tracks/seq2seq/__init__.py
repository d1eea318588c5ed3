"""The sequence-to-sequence family: T5-shaped encoder-decoder models merged checkpoint to checkpoint (full
fine-tunes) or adapter to adapter (IA³, in vector form) and scored T0-style by rank classification
(``mergecal.evaluation.seq2seq``). One source: ``built`` (the ``seq2seq`` track: a tiny T5 the papers' profile
pretrains and fine-tunes)."""
