"""Model architectures, each declared once in a spec (as MergeKit's architecture files): what the library
needs to know of an architecture's parameters and modules, read by ``mergecal.keys`` (key roles),
``mergecal.feature_hooks`` (the modules MAGIC's FSC hooks, how to run a batch) and so by the FSC step. A new
architecture is one ``ArchitectureSpec`` defined here (``ARCHITECTURE_SPECS`` collects them); nothing here
imports an optional backbone library (open_clip, transformers): a model class is named as ``"module:Class"`` and
looked up in ``sys.modules``, where it is only if its library is in use.

* ``key_roles``: ``{role: anchored pattern}`` over the architecture's parameter names, for the roles the merge and
  calibration authors' key rules single out by name (``embedding``: token, position and class embeddings, tied
  output embeddings; ``projection``: a tower's last map). A name matches a role if any architecture's pattern says so
  (architectures' names do not collide); every other parameter is ``other``.
* ``canonical_name``: the architecture's layout mapping for role matching: a key of another layout of the same
  architecture as its name here (HF CLIP -> open_clip, ``backbones.clip_layouts``; the full mapping, with q/k/v
  fused, is the checkpoint reader's); ``None``: names are taken as they are.
* ``fsc``: the hooked modules (``FscModules``), or ``None`` when feature-space chains do not run on the architecture.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .backbones.clip_layouts import open_clip_name

ROLES = ("embedding", "projection")  # matched in this order


@dataclass(frozen=True)
class FscModules:
    """The modules FSC hooks in an architecture's model (qualified names relative to its one instance of
    ``model_class``, found anywhere in the model: alone or inside a wrapper): ``before`` the blocks, each block's
    ``block`` modules (the blocks: the module list at ``blocks``), then ``after``. A ratio's granularity follows the
    module's type (``feature_hooks.default_granularity``: convolution per channel, norm layers one scalar, else per
    token)."""

    model_class: str  # "module:Class", looked up in sys.modules
    what: str  # the class in words, for errors
    before: tuple[str, ...]
    blocks: str
    block: tuple[str, ...]
    after: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()  # before/after modules a model may replace by nn.Identity (then not hooked)
    # the attribute (of the blocks' parent module) that says the blocks run batch-first ([N, L, D]); when it is
    # absent or false they run sequence-first ([L, N, D]). None: always batch-first. Outside the blocks: batch-first.
    batch_first: str | None = None
    multihead_attention: tuple[str, ...] = ()  # block modules hooked whole, which must be nn.MultiheadAttention
    run_method: str | None = None  # called with the batch when the model has it (a tower of a two-tower model)


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    description: str
    key_roles: dict[str, str] = field(default_factory=dict)
    canonical_name: Callable[[str], str] | None = None
    fsc: FscModules | None = None

    def role_patterns(self) -> dict[str, re.Pattern]:
        return {role: re.compile(pattern) for role, pattern in self.key_roles.items()}


OPEN_CLIP = ArchitectureSpec(
    name="open_clip_vit",
    description="open_clip CLIP (HF CLIP checkpoints read in its layout); FSC on the VisionTransformer (visual "
                "tower): conv1, ln_pre, per block ln_1/attn/ln_2/mlp.c_fc/mlp.gelu/mlp.c_proj, ln_post",
    key_roles={"embedding": r"(^|\.)(positional_embedding|class_embedding|token_embedding\.weight)$",
               "projection": r"(^|\.)(visual\.proj|text_projection)$"},
    canonical_name=open_clip_name,
    fsc=FscModules(model_class="open_clip.transformer:VisionTransformer", what="open_clip VisionTransformer",
                   before=("conv1", "ln_pre"), blocks="transformer.resblocks",
                   block=("ln_1", "attn", "ln_2", "mlp.c_fc", "mlp.gelu", "mlp.c_proj"), after=("ln_post",),
                   optional=("ln_pre",),  # no_ln_pre=True models have none
                   # open_clip >= 2.24 runs residual blocks batch-first (the default); older releases did not
                   batch_first="transformer.batch_first",
                   multihead_attention=("attn",),  # its out_proj is never called as a module
                   run_method="encode_image"),
)

HF_BERT = ArchitectureSpec(
    name="hf_bert",
    description="Hugging Face BertModel encoder (alone or inside BertFor...): FSC on embeddings.LayerNorm, per "
                "layer attention.self.query/key/value, attention.output.dense/LayerNorm, intermediate.dense, "
                "output.dense/LayerNorm",
    key_roles={"embedding": r"(^|\.)embeddings\.(word|position|token_type)_embeddings\.weight$",
               "projection": r"(^|\.)pooler\.dense\.weight$"},
    # not hooked: the nn.Embedding lookups, intermediate_act_fn (parameter-free: its ratio is always 1), the
    # pooler and any task head (the analogue of open_clip's visual.proj, a bare parameter FSC never sees)
    fsc=FscModules(model_class="transformers.models.bert.modeling_bert:BertModel", what="transformers BertModel",
                   before=("embeddings.LayerNorm",), blocks="encoder.layer",
                   block=("attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                          "output.dense", "output.LayerNorm")),
)

LLAMA = ArchitectureSpec(
    name="llama",
    description="Llama-style causal LM (Hugging Face layout); weight space only",
    # lm_head is the output embedding, stored as embed_tokens when tied
    key_roles={"embedding": r"(^|\.)(embed_tokens\.weight|lm_head\.weight)$"},
)

T5 = ArchitectureSpec(
    name="t5",
    description="T5-style encoder-decoder (Hugging Face layout: T5ForConditionalGeneration, T0); weight space only",
    # shared is the token embedding both stacks read (stored again as {encoder,decoder}.embed_tokens and, tied,
    # lm_head: Llama's pattern matches those names); relative_attention_bias is the position embedding (buckets x
    # heads), T5's counterpart of CLIP's positional_embedding
    key_roles={"embedding": r"(^|\.)(shared\.weight|relative_attention_bias\.weight)$"},
)

#: every spec defined above, by name, in the order written: a new architecture is one more ``ArchitectureSpec`` here
ARCHITECTURE_SPECS: dict[str, ArchitectureSpec] = {spec.name: spec for spec in list(globals().values())
                                                   if isinstance(spec, ArchitectureSpec)}
