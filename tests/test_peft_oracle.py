"""peft's own LoRA merges as an oracle for mergecal's merge methods (docs/peft-oracle.md).

peft 0.21.2, ``LoraModel.add_weighted_adapter`` (peft/tuners/lora/model.py) over the functions of
peft/utils/merge_utils.py, merges K LoRA adapters two ways:

* on the full deltas ``scaling_t * B_t @ A_t`` (``get_delta_weight``): ``cat`` stacks the factors, which is the exact
  weighted sum of the deltas; ``svd``, ``ties_svd``, ``dare_linear_svd``, ``dare_ties_svd`` and
  ``magnitude_prune_svd`` merge the deltas with merge_utils' function of that name and keep the top ``svd_rank``
  singular triplets (``svd_rank`` = min(out, in) keeps them all: the merge itself, up to round-off);
* on the factors, each of the A's and the B's merged on its own (``linear``, ``ties``, ``dare_linear``, ``dare_ties``,
  ``magnitude_prune``), adapter t's weight entering as sqrt(|w_t scaling_t|) on both factors (its sign on A only):
  a rank-r product of merged factors, NOT a merge of deltas.

Each test merges the same three adapters with peft and with mergecal (``merge_task_vectors``) and compares the merged
deltas (reconstructed, never the SVD factors, whose signs and rotations are arbitrary). Every adapter's delta is read
from peft itself: a copy of the model with that adapter merged (``merge_and_unload``) minus the base weights.

Tolerances (relative Frobenius error of a merged delta, worst key): float32 round-off, eps = 1.2e-7, on deltas of
entries up to ~0.5 over base weights under 0.1 (the extraction's subtraction costs ~1 ulp), a sum of K = 3 terms and,
for the *_svd types, an SVD and its product back (~sqrt(n) eps for n <= 64): measured <= 1.1e-6, checked at ``TOL`` =
1e-5. A rank-r truncation is as well conditioned as the gap between the r-th and (r+1)-th singular values: measured
<= 5.5e-6 here, checked at ``TOL_TRUNCATED`` = 1e-4. A trim or a sign election that went differently on one entry
would cost >= 1.7e-2 (the smallest kept entry, ~0.07, in a key of Frobenius norm ~4), so neither tolerance hides a
discrete mismatch.

DARE's masks: peft draws them from torch's global generator (``torch.bernoulli`` in ``random_pruning``, seeded only
by ``torch.manual_seed`` and call order), mergecal from a generator seeded per (seed, task, key)
(mergecal/methods/dare.py). The exact comparisons force peft to use mergecal's masks (``torch.bernoulli`` replaced
for the one call, in peft's draw order, which the test checks is fully consumed); ``test_dare_in_distribution``
compares the two unforced, in distribution.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from mergecal.linalg import svd  # noqa: E402
from mergecal.merge import merge_task_vectors  # noqa: E402
from mergecal.methods.dare import keep_mask, key_seed  # noqa: E402

ADAPTERS = ("a0", "a1", "a2")
RANK = 4
ALPHAS = (8, 4, 12)  # scalings alpha / r = 2, 1, 3: each adapter's own scaling must be folded in
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]  # 32 x 32, 32 x 32, 64 x 32, 32 x 64
FULL_RANK = 32  # min(out, in) of every target: svd_rank = 32 keeps the whole merged delta
WEIGHTS = (0.6, 1.2, 0.3)  # unequal weights
SIGNED_WEIGHTS = (0.6, -1.2, 0.3)  # a negative one: peft puts its sign on the A factor only
EQUAL = 0.8  # equal weights (mergecal's scaling) where peft's weights act after a sign election
TIES_DENSITY = 0.4  # peft's density = mergecal's top_k, per tensor
DARE_DENSITY = 0.3  # peft's density = 1 - mergecal's drop_rate
DARE_SEED = 11
SEEDS = 16  # unforced DARE draws per implementation in test_dare_in_distribution
TOL = 1e-5
TOL_TRUNCATED = 1e-4
TIES_PARAMS = dict(top_k=TIES_DENSITY, trim_scope="per_tensor", sign_vote="mass", disjoint="mean")
# peft's dare_ties: DARE's drop and rescale, then TIES' election and disjoint mean, no magnitude trim
DARE_PARAMS = dict(drop_rate=1.0 - DARE_DENSITY, seed=DARE_SEED, rescale="inverse_keep")
DARE_TIES_PARAMS = dict(DARE_PARAMS, base="ties", top_k=1.0, trim_scope="per_tensor", sign_vote="mass",
                        disjoint="mean")


@dataclass
class Loras:
    model: object  # PeftModel with adapters a0, a1, a2
    base: dict  # the base model's state dict, before peft wrapped it
    modules: list  # the LoRA-wrapped modules' names, in peft's merge order (named_modules)
    deltas: list  # per adapter: {"<module>.weight": scaling * B @ A}, read by merge_and_unload
    factors: list  # per adapter: {"<module>.lora_A.weight": A, "<module>.lora_B.weight": B}
    scalings: list  # per adapter: alpha / r


def weight_key(module: str) -> str:
    return f"{module}.weight"


def factor_keys(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def merged_delta(model, adapter: str, loras: Loras) -> dict[str, torch.Tensor]:
    """``adapter``'s delta at every target key: a copy of ``model`` with it merged, minus the base weights."""
    merged = copy.deepcopy(model).merge_and_unload(adapter_names=[adapter]).state_dict()
    return {weight_key(m): merged[weight_key(m)] - loras.base[weight_key(m)] for m in loras.modules}


@pytest.fixture(scope="module")
def loras() -> Loras:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    base_model = LlamaForCausalLM(config)
    model = None
    for name, alpha in zip(ADAPTERS, ALPHAS):
        lora = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
        if model is None:
            base = {k: v.clone() for k, v in base_model.state_dict().items()}
            model = get_peft_model(base_model, lora, adapter_name=name)
        else:
            model.add_adapter(name, lora)
    modules = [n for n, m in model.base_model.model.named_modules() if isinstance(m, LoraLayer)]
    loras = Loras(model, base, modules, [], [], [])
    for name in ADAPTERS:
        loras.deltas.append(merged_delta(model, name, loras))
        factors = {}
        for module in modules:
            layer = model.base_model.model.get_submodule(module)
            a_key, b_key = factor_keys(module)
            factors[a_key] = layer.lora_A[name].weight.detach().clone()
            factors[b_key] = layer.lora_B[name].weight.detach().clone()
        loras.factors.append(factors)
        loras.scalings.append(layer.scaling[name])
    return loras


def peft_merge(loras: Loras, combination_type: str, weights, **kwargs) -> dict[str, torch.Tensor]:
    """peft's merged adapter's delta at every target key (merged on a copy of the model)."""
    model = copy.deepcopy(loras.model)
    model.add_weighted_adapter(list(ADAPTERS), list(weights), "merged", combination_type=combination_type, **kwargs)
    config = model.peft_config["merged"]
    assert config.lora_alpha == config.r  # the merged adapter's own scaling is 1: every alpha / r is folded in
    return merged_delta(model, "merged", loras)


def rel_error(actual: dict, expected: dict) -> float:
    """The worst key's relative Frobenius error."""
    assert actual.keys() == expected.keys()
    return max(float((actual[k] - expected[k]).norm() / expected[k].norm()) for k in expected)


def weighted(taus: list[dict], weights) -> list[dict]:
    """Per-model weights folded into the task vectors (mergecal's methods take one scaling for all)."""
    return [{k: w * v for k, v in tau.items()} for tau, w in zip(taus, weights)]


def truncated(merged: dict, rank: int) -> dict:
    """Each key's rank-``rank`` truncated SVD, multiplied back."""
    out = {}
    for key, matrix in merged.items():
        U, S, Vh = svd(matrix)
        out[key] = (U[:, :rank] * S[:rank]) @ Vh[:rank]
    return out


def magnitude_pruned_sum(taus: list[dict]) -> dict:
    """Each task vector trimmed to its top ``TIES_DENSITY`` per tensor (mergecal's TIES of that one task vector:
    no sign conflict, the trimmed vector itself), then summed (task arithmetic at scaling 1)."""
    pruned = [merge_task_vectors([tau], "ties", scaling=1.0, **TIES_PARAMS) for tau in taus]
    return merge_task_vectors(pruned, "task_arithmetic", scaling=1.0)


def mergecal_keep_masks(loras: Loras, keys_in_order: list[list[str]]) -> list[torch.Tensor]:
    """mergecal's DARE keep masks (task t at key k: generator seeded by key_seed(seed, t, k)), in peft's draw order:
    each inner list is a group of keys whose K tasks peft draws one after another (task-major within the group)."""
    shapes = {**{k: v.shape for k, v in loras.deltas[0].items()}, **{k: v.shape for k, v in loras.factors[0].items()}}
    masks = []
    for group in keys_in_order:
        for key in group:
            for t in range(len(ADAPTERS)):
                generator = torch.Generator().manual_seed(key_seed(DARE_SEED, t, key))
                masks.append(keep_mask(torch.empty(shapes[key]), DARE_PARAMS["drop_rate"], generator))
    return masks


def peft_merge_with_masks(loras: Loras, combination_type: str, weights, masks: list[torch.Tensor], **kwargs) -> dict:
    """``peft_merge`` with peft's Bernoulli draws (``random_pruning``) replaced by ``masks``, in order."""
    queue = list(masks)

    def bernoulli(p, *args, **kw):
        assert queue, "peft drew more DARE masks than expected"
        keep = queue.pop(0)
        assert keep.shape == p.shape and bool((p == DARE_DENSITY).all())
        return keep.to(p.dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "bernoulli", bernoulli)
        out = peft_merge(loras, combination_type, weights, **kwargs)
    assert not queue, f"peft drew {len(masks) - len(queue)} DARE masks, {len(masks)} expected"
    return out


# ----------------------------------------------------------------------------- the oracle's inputs


def test_extracted_deltas_are_scaling_times_b_a(loras):
    """The deltas read by merge_and_unload are alpha / r * B @ A with each adapter's own alpha (non-zero: the
    adapters were built with init_lora_weights=False)."""
    assert loras.scalings == [alpha / RANK for alpha in ALPHAS]
    for delta, factors, scaling in zip(loras.deltas, loras.factors, loras.scalings):
        expected = {}
        for module in loras.modules:
            a_key, b_key = factor_keys(module)
            expected[weight_key(module)] = scaling * factors[b_key] @ factors[a_key]
        assert min(float(v.norm()) for v in expected.values()) > 1.0
        assert rel_error(delta, expected) < TOL


# ----------------------------------------------------------------------------- merges of the full deltas


@pytest.mark.parametrize("weights", [WEIGHTS, (EQUAL,) * 3], ids=["unequal", "equal"])
def test_cat_is_task_arithmetic_of_the_deltas(loras, weights):
    """cat: A_t * w_t * scaling_t stacked over B_t, the exact weighted sum of the deltas = mergecal's task arithmetic
    at scaling 1 of the weighted deltas (or, for equal weights w, at scaling w of the deltas themselves)."""
    ours = (merge_task_vectors(loras.deltas, "task_arithmetic", scaling=EQUAL) if len(set(weights)) == 1
            else merge_task_vectors(weighted(loras.deltas, weights), "task_arithmetic", scaling=1.0))
    assert rel_error(peft_merge(loras, "cat", weights), ours) < TOL


def mergecal_delta_space(loras: Loras, combination_type: str) -> tuple[tuple, dict]:
    """(peft's weights, mergecal's merge of the deltas) for a *_svd combination type, before the truncation."""
    if combination_type == "svd":
        return WEIGHTS, merge_task_vectors(weighted(loras.deltas, WEIGHTS), "task_arithmetic", scaling=1.0)
    if combination_type == "magnitude_prune_svd":
        return WEIGHTS, magnitude_pruned_sum(weighted(loras.deltas, WEIGHTS))
    if combination_type == "dare_linear_svd":
        return WEIGHTS, merge_task_vectors(weighted(loras.deltas, WEIGHTS), "dare", scaling=1.0, **DARE_PARAMS)
    # peft elects TIES' sign on the unweighted task vectors and weights them after: equal weights = mergecal's scaling
    if combination_type == "ties_svd":
        return (EQUAL,) * 3, merge_task_vectors(loras.deltas, "ties", scaling=EQUAL, **TIES_PARAMS)
    assert combination_type == "dare_ties_svd"
    return (EQUAL,) * 3, merge_task_vectors(loras.deltas, "dare", scaling=EQUAL, **DARE_TIES_PARAMS)


SVD_TYPES = ["svd", "ties_svd", "magnitude_prune_svd", "dare_linear_svd", "dare_ties_svd"]


@pytest.mark.parametrize("rank", [FULL_RANK, RANK], ids=["full_rank", "rank_r"])
@pytest.mark.parametrize("combination_type", SVD_TYPES)
def test_svd_types_are_mergecal_merges_truncated(loras, combination_type, rank):
    """*_svd: mergecal's merge of the deltas (svd: task_arithmetic; ties_svd: ties per_tensor, mass vote, disjoint
    mean; magnitude_prune_svd: per-tensor top-k then the sum; dare_linear_svd: dare over task_arithmetic;
    dare_ties_svd: dare over ties without a trim), then its rank-``svd_rank`` truncated SVD."""
    weights, ours = mergecal_delta_space(loras, combination_type)
    if combination_type.startswith("dare"):
        masks = mergecal_keep_masks(loras, [[weight_key(m)] for m in loras.modules])
        theirs = peft_merge_with_masks(loras, combination_type, weights, masks, density=DARE_DENSITY, svd_rank=rank)
    else:
        theirs = peft_merge(loras, combination_type, weights, density=TIES_DENSITY, svd_rank=rank)
    if rank == FULL_RANK:
        assert rel_error(theirs, ours) < TOL
    else:
        assert rel_error(theirs, truncated(ours, rank)) < TOL_TRUNCATED
        assert rel_error(theirs, ours) > 0.05  # the truncation did cut something


def topk_trimmed(taus: list[dict], density: float) -> list[dict]:
    """Each tensor's top ``density`` fraction by magnitude (torch.topk, as peft's magnitude_based_pruning)."""
    out = []
    for tau in taus:
        kept = {}
        for key, value in tau.items():
            flat = value.reshape(-1)
            mask = torch.zeros_like(flat, dtype=torch.bool)
            mask[flat.abs().topk(int(density * flat.numel())).indices] = True
            kept[key] = (flat * mask).reshape(value.shape)
        out.append(kept)
    return out


def test_ties_frequency_vote_differs_from_count_only_at_tied_votes(loras):
    """majority_sign_method="frequency" is mergecal's sign_vote="count", except where the count is 0 with entries
    left (+1, -1 and a trimmed 0, say): peft elects +1 there (``torch.where(sign_magnitude >= 0, 1, -1)``), mergecal
    the majority elected sign of the tensor (the original TIES code's rule)."""
    weights = (EQUAL,) * 3
    theirs = peft_merge(loras, "ties_svd", weights, density=TIES_DENSITY, svd_rank=FULL_RANK,
                        majority_sign_method="frequency")
    ours = merge_task_vectors(loras.deltas, "ties", scaling=EQUAL, **dict(TIES_PARAMS, sign_vote="count"))
    trimmed = topk_trimmed(loras.deltas, TIES_DENSITY)
    n_tied = n_against = 0  # tied coordinates, and those of them where the two rules elect opposite signs
    for key in ours:
        stack = torch.stack([t[key] for t in trimmed])
        tied = (stack.sign().sum(0) == 0) & (stack != 0).any(0)
        n_tied += int(tied.sum())
        assert torch.allclose(theirs[key][~tied], ours[key][~tied], rtol=0, atol=TOL * float(ours[key].abs().max()))
        assert bool((theirs[key][tied] > 0).all())  # peft: the positive entries' mean
        votes = stack.sign().sum(0).sign()
        assert float(votes.sum()) != 0  # else mergecal would keep nothing at the tied coordinates
        majority = 1.0 if float(votes.sum()) > 0 else -1.0
        n_against += int(tied.sum()) if majority < 0 else 0
        assert bool((ours[key][tied] * majority > 0).all())
    assert n_tied > 100 and n_against > 100


def test_ties_weights_act_after_the_sign_election(loras):
    """peft elects TIES' sign on the unweighted trimmed deltas and weights them in the disjoint mean; mergecal, given
    the weighted deltas (it has no per-model weights), elects on the weighted ones. The merges agree exactly except
    at the coordinates where the two elections differ."""
    theirs = peft_merge(loras, "ties_svd", WEIGHTS, density=TIES_DENSITY, svd_rank=FULL_RANK)
    ours = merge_task_vectors(weighted(loras.deltas, WEIGHTS), "ties", scaling=1.0, **TIES_PARAMS)
    trimmed = topk_trimmed(loras.deltas, TIES_DENSITY)
    n_split = n_differ = 0
    for key in ours:
        stack = torch.stack([t[key] for t in trimmed])
        w = torch.tensor(WEIGHTS).view(-1, 1, 1)
        split = stack.sum(0).sign() != (w * stack).sum(0).sign()
        n_split += int(split.sum())
        assert torch.allclose(theirs[key][~split], ours[key][~split], rtol=0, atol=TOL * float(ours[key].abs().max()))
        n_differ += int((theirs[key][split] - ours[key][split]).abs().gt(1e-3).sum())
    assert n_split > 10 and n_differ == n_split


# ----------------------------------------------------------------------------- merges of the factors


def factor_weights(weights, scalings) -> tuple[list[float], list[float]]:
    """peft's weights on A and on B: sqrt(|w_t scaling_t|) each, the sign of w_t scaling_t on A."""
    on_a = [math.copysign(math.sqrt(abs(w * s)), w * s) for w, s in zip(weights, scalings)]
    on_b = [math.sqrt(abs(w * s)) for w, s in zip(weights, scalings)]
    return on_a, on_b


def split_factors(loras: Loras, on_a, on_b) -> list[dict]:
    """The factors as task vectors, A_t weighted by on_a[t] and B_t by on_b[t]."""
    out = []
    for factors, wa, wb in zip(loras.factors, on_a, on_b):
        out.append({k: (wa if ".lora_A." in k else wb) * v for k, v in factors.items()})
    return out


def product(loras: Loras, merged_factors: dict) -> dict:
    """The merged adapter's delta B @ A at every target key (its scaling is 1)."""
    out = {}
    for module in loras.modules:
        a_key, b_key = factor_keys(module)
        out[weight_key(module)] = merged_factors[b_key] @ merged_factors[a_key]
    return out


def mergecal_factor_wise(loras: Loras, combination_type: str) -> tuple[tuple, dict]:
    """(peft's weights, mergecal's methods applied to the A's and to the B's, multiplied back)."""
    if combination_type in ("ties", "dare_ties"):
        # the election is on unweighted factors: weights w_t = c / scaling_t make every factor weight sqrt(c)
        c = 1.5
        weights = tuple(c / s for s in loras.scalings)
        if combination_type == "ties":
            merged = merge_task_vectors(loras.factors, "ties", scaling=math.sqrt(c), **TIES_PARAMS)
        else:
            merged = merge_task_vectors(loras.factors, "dare", scaling=math.sqrt(c), **DARE_TIES_PARAMS)
        return weights, product(loras, merged)
    weights = SIGNED_WEIGHTS
    taus = split_factors(loras, *factor_weights(weights, loras.scalings))
    if combination_type == "linear":
        merged = merge_task_vectors(taus, "task_arithmetic", scaling=1.0)
    elif combination_type == "magnitude_prune":
        merged = magnitude_pruned_sum(taus)
    else:
        assert combination_type == "dare_linear"
        merged = merge_task_vectors(taus, "dare", scaling=1.0, **DARE_PARAMS)
    return weights, product(loras, merged)


FACTOR_TYPES = ["linear", "ties", "magnitude_prune", "dare_linear", "dare_ties"]


def peft_factor_wise(loras: Loras, combination_type: str, weights) -> dict:
    if combination_type.startswith("dare"):  # peft draws the K A's of a module, then its K B's
        masks = mergecal_keep_masks(loras, [list(factor_keys(m)) for m in loras.modules])
        return peft_merge_with_masks(loras, combination_type, weights, masks, density=DARE_DENSITY)
    return peft_merge(loras, combination_type, weights, density=TIES_DENSITY)


@pytest.mark.parametrize("combination_type", FACTOR_TYPES)
def test_factor_wise_types_are_mergecal_merges_of_the_factors(loras, combination_type):
    """linear / ties / magnitude_prune / dare_linear / dare_ties: mergecal's task_arithmetic / ties (per_tensor) /
    per-tensor top-k sum / dare / dare over ties, applied to the stacked A's and, separately, to the B's with
    peft's factor weights, then B @ A: peft's merged delta, exactly (the negative weight included)."""
    weights, ours = mergecal_factor_wise(loras, combination_type)
    assert rel_error(peft_factor_wise(loras, combination_type, weights), ours) < TOL


@pytest.mark.parametrize("combination_type", FACTOR_TYPES)
def test_factor_wise_types_are_not_merges_of_the_deltas(loras, combination_type):
    """The convention, not a bug: a factor-wise merge is a rank-r product with cross terms B_s A_t (s != t), far
    from the same merge of the deltas (which mergecal computes and the *_svd types reproduce), whose rank is up to
    K r. Even linear with weights w is sum_st sqrt(w_s s_s w_t s_t) B_s A_t, not sum_t w_t s_t B_t A_t."""
    weights, _ = mergecal_factor_wise(loras, combination_type)
    theirs = peft_factor_wise(loras, combination_type, weights)
    delta_space = {
        "linear": lambda: merge_task_vectors(weighted(loras.deltas, weights), "task_arithmetic", scaling=1.0),
        "magnitude_prune": lambda: magnitude_pruned_sum(weighted(loras.deltas, weights)),
        "dare_linear": lambda: merge_task_vectors(weighted(loras.deltas, weights), "dare", scaling=1.0,
                                                  **DARE_PARAMS),
        "ties": lambda: merge_task_vectors(weighted(loras.deltas, weights), "ties", scaling=1.0, **TIES_PARAMS),
        "dare_ties": lambda: merge_task_vectors(weighted(loras.deltas, weights), "dare", scaling=1.0,
                                                **DARE_TIES_PARAMS),
    }[combination_type]()
    assert rel_error(theirs, delta_space) > 0.3
    for key in theirs:
        assert int(torch.linalg.matrix_rank(theirs[key])) <= RANK < int(torch.linalg.matrix_rank(delta_space[key]))


# ----------------------------------------------------------------------------- DARE's random masks, unforced


def test_dare_in_distribution(loras):
    """Unforced masks: peft (torch's global generator, torch.manual_seed(s)) and mergecal (seed=s) both keep each entry
    with probability ``density``, independently per task, and rescale by 1 / density, so z = (merge - sum_t w_t tau_t)
    / sqrt((1 - d) / d sum_t w_t^2 tau_t^2) has mean 0 and standard deviation 1 over entries and seeds (2e5 values
    each; measured within 0.004 of both). Its spread where the K weighted deltas share a sign (5e4 values) would be
    ~1.5 if the tasks shared their masks. The bounds are >= 8 standard errors. peft's draw is reproducible from the
    torch seed only; mergecal's ignores it."""
    taus = weighted(loras.deltas, WEIGHTS)
    expected = merge_task_vectors(taus, "task_arithmetic", scaling=1.0)
    std = {k: (sum(t[k] ** 2 for t in taus) * (1 - DARE_DENSITY) / DARE_DENSITY).sqrt() for k in expected}
    kept, drawn = [], []
    real_bernoulli = torch.bernoulli

    def recorded(p, *args, **kwargs):
        mask = real_bernoulli(p, *args, **kwargs)
        kept.append(float(mask.sum()))
        drawn.append(mask.numel())
        return mask

    # entries where the K weighted deltas share a sign: there masks shared by the tasks would show as a larger spread
    aligned = torch.cat([(sum(t[k].sign() for t in taus).abs() == len(taus)).reshape(-1) for k in expected])
    z = {"peft": [], "mergecal": []}
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "bernoulli", recorded)
            theirs = peft_merge(loras, "dare_linear_svd", WEIGHTS, density=DARE_DENSITY, svd_rank=FULL_RANK)
        ours = merge_task_vectors(taus, "dare", scaling=1.0, **dict(DARE_PARAMS, seed=seed))
        for name, merged in (("peft", theirs), ("mergecal", ours)):
            z[name].append(torch.cat([((merged[k] - expected[k]) / std[k]).reshape(-1) for k in expected]))
    assert abs(sum(kept) / sum(drawn) - DARE_DENSITY) < 0.01
    for name, values in z.items():
        values = torch.stack(values)
        assert abs(float(values.mean())) < 0.02, name
        assert abs(float(values.std()) - 1.0) < 0.03, name
        assert abs(float(values[:, aligned].std()) - 1.0) < 0.04, name

    def peft_at(torch_seed):
        torch.manual_seed(torch_seed)
        return peft_merge(loras, "dare_linear_svd", WEIGHTS, density=DARE_DENSITY, svd_rank=FULL_RANK)

    def ours_at(torch_seed):
        torch.manual_seed(torch_seed)
        return merge_task_vectors(taus, "dare", scaling=1.0, **DARE_PARAMS)

    assert rel_error(peft_at(5), peft_at(5)) < TOL and rel_error(peft_at(5), peft_at(6)) > 0.1
    assert rel_error(ours_at(5), ours_at(6)) == 0.0


# ----------------------------------------------------------------------------- peft's special cases


def test_one_adapter_is_always_linear_in_peft(loras):
    """peft merges a single adapter with "linear" whatever combination_type says (``_check_add_weighted_adapter``):
    ties of one adapter is w * its delta, untrimmed; mergecal's ties of one task vector trims it."""
    model = copy.deepcopy(loras.model)
    model.add_weighted_adapter(["a1"], [EQUAL], "merged", combination_type="ties", density=TIES_DENSITY)
    theirs = merged_delta(model, "merged", loras)
    assert rel_error(theirs, weighted(loras.deltas[1:2], [EQUAL])[0]) < TOL
    ours = merge_task_vectors(loras.deltas[1:2], "ties", scaling=EQUAL, **TIES_PARAMS)
    assert rel_error(theirs, ours) > 0.1


def test_peft_rslora_merge_is_overscaled(loras):
    """A peft 0.21.2 bug, pinned: the merged adapter's config is adapters[0]'s with r = lora_alpha = new_rank, so with
    use_rslora its scaling is new_rank / sqrt(new_rank) = sqrt(new_rank), not 1: "cat" of rslora adapters is
    sqrt(K r) times their weighted sum. An oracle must use plain LoRA scaling (as every test here does). If this
    fails after a peft upgrade, peft fixed it: drop this test and its row of docs/peft-oracle.md."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    base_model = LlamaForCausalLM(config)
    base = {k: v.clone() for k, v in base_model.state_dict().items()}
    lora = dict(r=RANK, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False, use_rslora=True)
    model = get_peft_model(base_model, LoraConfig(**lora), adapter_name="a0")
    model.add_adapter("a1", LoraConfig(**lora))
    layer = model.base_model.model.get_submodule("model.layers.0.self_attn.q_proj")
    expected = layer.get_delta_weight("a0") + layer.get_delta_weight("a1")
    model.add_weighted_adapter(["a0", "a1"], [1.0, 1.0], "merged", combination_type="cat")
    merged = model.merge_and_unload(adapter_names=["merged"]).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    theirs = merged[key] - base[key]
    ratio = float(theirs.norm() / expected.detach().norm())
    assert ratio == pytest.approx(math.sqrt(2 * RANK), rel=1e-5)
