"""The causal-LM family: Llama-style Hugging Face models merged checkpoint to checkpoint and scored with lm-eval.

What every source shares: ``family`` (its cells and a cell's computation over the ``Models`` a source gives),
``scoring`` (lm-eval scoring, the references of a base and its experts), ``params`` (shared settings). A source
is where the checkpoints come from, one package each, never importing another: ``built`` (the ``llm`` track: a
tiny Llama the pipeline pretrains and fine-tunes; its stages, seeds and stability diagnostics) and ``files`` (the
``local_llm`` tracks: a lab's directories, checked, recorded and read in place)."""
