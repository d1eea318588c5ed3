"""PEFT adapters as experts: a LoRA or IA³ adapter directory merged like a fine-tuned checkpoint.

A lab's fine-tunes are often PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) beside
one base model. Here each one is read as peft 0.21 reads it, without importing peft (an optional dependency):

* a **LoRA** expert is a ``TensorSource`` over the base (``LoraExpert``): a target key is the base plus the adapter's
  delta, computed when the key is asked for (one key's delta at a time, never the whole model's), in the order and
  dtype of peft's ``get_delta_weight`` and ``merge``, so that its task vector equals peft's
  ``merge_and_unload()`` weight minus the base bit for bit; every other key is the base's tensor;
* an **IA³** expert is merged in vector form, as the TIES and MAGIC papers merge IA³ models: the expert's model is its
  vectors, its pretrained model ones of the same shapes (``IA3Vectors``, ``IA3Identity``), so its task vector is the
  vector minus the identity; the merge is written back as an IA³ adapter, or as the full model (``IA3Expert``: the
  base scaled by the vectors, rows or columns, as peft's ``merge_and_unload`` scales them).

The merge of LoRA experts is written as a full model (``mergecal.merge.merge_checkpoints``) or, with ``as_lora=RANK``,
re-factorised key by key by truncated SVD into a LoRA adapter that ``PeftModel.from_pretrained(base, out)`` loads; a
merge of full checkpoints of a Hugging Face base can be written as one too (``merge_full_as_lora``).

peft's conventions followed (peft 0.21.2, transformers 5): saved keys are the PeftModel's parameter names without the
adapter name (``base_model.model.<module>.lora_A.weight``; ``get_peft_model_state_dict``); the base key of a module is
``<module>.weight`` with ``base_model.model.`` and any ``.base_layer`` segment removed (what ``merge_and_unload``
leaves); an adapter weight is held in the base layer's dtype, upcast to float32 from 16- and 8-bit floats (peft's
default ``autocast_adapter_dtype=True``); the merge is peft's default, not ``safe_merge``. Nothing here unpickles:
``adapter_model.bin`` is refused.

The package, in the order its modules import each other: ``read`` (adapter configs and saved tensors: ``Adapter``,
``read_adapter``, what is refused), ``experts`` (the ``TensorSource``s over the base: ``LoraExpert``, ``IA3Vectors``,
``IA3Expert``, the layouts that settle a layer's orientation), ``write`` (``write_adapter``, ``write_full_model``) and
``merge`` (the merge routes, ``merge_experts`` and the ``--as-lora`` re-factorisation).
"""

from .experts import (IA3Expert, IA3Identity, IA3Vectors, LoraExpert, LoraTaskVectors, SharedBase, adapter_dtype,
                      hf_layers, linear_layouts)
from .merge import MergeOutput, expert_kinds, factorize, merge_experts, merge_full_as_lora, merge_ia3, merge_lora
from .read import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, Adapter, IA3Module, LoraModule, adapter_from_tensors, expert_kind,
                   is_adapter_dir, read_adapter)
from .write import write_adapter, write_full_model

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Adapter", "IA3Expert", "IA3Identity", "IA3Module", "IA3Vectors",
           "LoraExpert", "LoraModule", "LoraTaskVectors", "MergeOutput", "SharedBase", "adapter_dtype",
           "adapter_from_tensors", "expert_kind", "expert_kinds", "factorize", "hf_layers", "is_adapter_dir",
           "linear_layouts", "merge_experts", "merge_full_as_lora", "merge_ia3", "merge_lora", "read_adapter",
           "write_adapter", "write_full_model"]
