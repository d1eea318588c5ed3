"""The text-encoder family: a BERT-family encoder with one classification head per task, the encoders merged and
every task scored with its own head. One source: ``built`` (the ``text`` track: the packaged pretrained MiniLM,
fine-tuned by the pipeline on its text suite)."""
