"""The papers' experiments: sweeps and ablations as cells of the benchmark matrix.

An experiment (``mergecal/experiments/<paper>.yaml``) names a track, its regimes, the merges, a base chain and
its variants: chains listed by name, or a sweep of one parameter (``{value}`` in a chain, one variant per value;
``{index}`` over the track's tasks, one variant per task). At a fixed ``scaling`` the chains run as a fixed-scaling
protocol of the matrix (the papers' ablations fix lambda: SVC at 1, MAGIC at 0.3); without one, as chains of the
matrix (the merge's grid searched, a calibration at the scaling its merge chose). Either way the cells are the
track's own (``Track.cells`` of the params the experiment narrows), so a variant that the default matrix runs is
that matrix cell, id and cache included, and every variant is paired with its base on the same test examples.
``claims`` are the paper's statements a report checks against the paired intervals (``mergecal.reports.papers``).
A comparison (``comparisons:``, DisTaC's tables and figures) runs the same merges and chains in several settings,
a setting one regime or the mean of several, each paired with a reference setting; its cells are an experiment's
(``Comparison.as_experiment``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from ..calibrations.probing import SensitivityRanking
from ..errors import MergecalError
from ..experiments import PAPERS, read
from .cells import REFERENCES, Cell, uses_sensitivity
from .chains import fixed_chain
from .config import Benchmark, FixedScaling, Params, _check_chain
from .params_base import Strict, _distinct
from .track_registry import get_track
from .tracks.clip.built.stages import paths_for

BASE = "base"  # the key of an experiment's base chain among its variants
MERGE_ALONE = "{merge}"


class Sweep(Strict):
    """One parameter swept: ``chain`` holds ``{value}`` (each of ``values``), ``{index}`` (``over: tasks``: each
    task of the track, by its index, the variant named after the task) or ``{sensitive}`` (``over: sensitive_top``:
    each value N is the first N keys of the probed magnitude-sensitivity ranking of the cell's regime and seed, MAGIC's
    alpha; N equal to ``probing.top`` runs as ``probed``, the chain that takes the probe's own top keys: the
    matrix's cell)."""

    parameter: str  # as the paper names it, shown on the plot's axis
    chain: str
    values: list[Any] = Field(default_factory=list)
    over: Literal["values", "tasks", "sensitive_top"] = "values"
    probed: str | None = None

    @model_validator(mode="after")
    def _placeholder(self) -> "Sweep":
        wanted = {"tasks": "{index}", "values": "{value}", "sensitive_top": "{sensitive}"}[self.over]
        if wanted not in self.chain:
            raise ValueError(f"sweep.chain {self.chain!r} has no {wanted}")
        if self.over != "tasks" and not self.values:
            raise ValueError("sweep.values: at least one value")
        if self.over == "sensitive_top" and (self.probed is None
                                             or any(not isinstance(v, int) or v < 0 for v in self.values)):
            raise ValueError("a sweep over sensitive_top names its `probed` chain and counts of keys (integers >= 0)")
        return self


class Claim(Strict):
    """A statement of the paper a report checks against the paired 95 % intervals, per merge (and regime, seed):
    ``gain`` / ``loss``: ``variant`` above / below ``than`` (default the base; ``than_merge``'s where given);
    ``diagonal``: per task, its accuracy when the calibration targets it (the variants of an ``over: tasks`` sweep)
    above its mean accuracy under the other targets (``than: others``), above the best other target's
    (``best_other``: the highest point estimate) or above the base (``than: base``); ``increase``: the last variant
    above the first."""

    kind: Literal["gain", "loss", "diagonal", "increase"]
    text: str  # the paper's claim, in one line
    variant: str | None = None
    than: str = BASE
    merges: list[str] = Field(default_factory=list)  # empty: every merge of the experiment
    # ``than`` of this merge instead of each merge's own: a merge of the experiment against another (MAGIC's
    # calibrated merges against Layer-wise AdaMerging)
    than_merge: str | None = None

    @model_validator(mode="after")
    def _variant(self) -> "Claim":
        if self.kind in ("gain", "loss") and self.variant is None:
            raise ValueError(f"a {self.kind} claim names its variant")
        if (self.than in ("others", "best_other")) != (self.kind == "diagonal" and self.than != BASE):
            raise ValueError("than: others / best_other are for a diagonal claim, which compares with `others`, "
                             "`best_other` or `base`")
        if self.than_merge is not None and self.kind not in ("gain", "loss"):
            raise ValueError("than_merge: for a gain or loss claim")
        return self


class Experiment(Strict):
    id: str  # <paper>.<item>, as the catalogue names it (svc.fig5)
    item: str  # as the paper numbers it ("Fig. 5")
    shows: str  # what the paper shows, in one line
    track: str = "vision"
    regimes: list[str] = Field(default_factory=lambda: ["standard"])
    # fixed lambda (no search) of every merge, or {merge: lambda} of some (the others searched); None: the matrix's
    # search (a calibration at the scaling its merge chose)
    scaling: float | dict[str, float] | None = None
    # same: the base at the variants' scaling; searched: the base is the matrix's searched merge, its own settings
    # (the SVC paper's "original" rows beside its SVC at lambda = 1)
    base_scaling: Literal["same", "searched"] = "same"
    merges: list[str] = Field(min_length=1)
    # the settings of a merge the default matrix does not run (not in params.yaml's benchmark.merges: AdaMerging,
    # which learns on data in each cell), as benchmark.merges writes them; benchmark.merges' own come first
    merge_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    base: str = "{merge}"
    variants: dict[str, str] = Field(default_factory=dict)  # name -> chain
    sweep: Sweep | None = None
    plot: Literal["line", "heatmap", "none"] = "none"
    axis: str = ""  # the line plot's axis for listed variants (a sweep names its parameter)
    claims: list[Claim] = Field(default_factory=list)
    # the paper's printed averages (percent): {merge: {variant or "base": value}}, where it prints numbers
    printed: dict[str, dict[str, float]] = Field(default_factory=dict)
    printed_where: str = ""  # the table or figure the printed numbers come from, and on which checkpoints

    @field_validator("merges", "regimes")
    @classmethod
    def _distinct(cls, values: list[str]) -> list[str]:
        return _distinct(values, "entries")

    @model_validator(mode="after")
    def _chains(self) -> "Experiment":
        if self.variants and self.sweep is not None:
            raise ValueError("give variants or a sweep, not both")
        if self.plot == "heatmap" and (self.sweep is None or self.sweep.over != "tasks"):
            raise ValueError("plot: heatmap is for a sweep over tasks")
        fixed = self.scaling if isinstance(self.scaling, dict) else {}
        if any(m not in self.merges for m in fixed) or any(v <= 0 for v in fixed.values()) or (
                isinstance(self.scaling, float) and self.scaling <= 0):
            raise ValueError("scaling: a positive lambda, or {merge of the experiment: positive lambda}")
        if self.base_scaling == "searched" and self.base != MERGE_ALONE:
            raise ValueError("base_scaling: searched takes the matrix's merge alone as the base ({merge})")
        names = [BASE, *self.variants] if self.sweep is None else [BASE] + (
            [] if self.sweep.over == "tasks" else [str(v) for v in self.sweep.values])
        if len(set(names)) != len(names) or any(n in REFERENCES or n == MERGE_ALONE for n in names[1:]):
            raise ValueError(f"variant names must be distinct and none of base, {', '.join(REFERENCES)}, {{merge}}")
        if self.sweep is not None and self.sweep.over == "tasks" and self.sweep.values:
            raise ValueError("sweep.values: not with over: tasks (one variant per task)")
        known = set(names) if self.sweep is None or self.sweep.over != "tasks" else None
        for claim in self.claims:
            if claim.kind == "diagonal" and (self.sweep is None or self.sweep.over != "tasks"):
                raise ValueError("claims: a diagonal claim is for a sweep over tasks")
            wanted = [n for n in (claim.variant, claim.than) if n is not None and n not in ("others", "best_other")]
            if known is not None and any(n not in known for n in wanted):
                raise ValueError(f"claims: {next(n for n in wanted if n not in known)!r} is no variant "
                                 f"(variants: {', '.join(names)})")
            named = [*claim.merges, *([claim.than_merge] if claim.than_merge else [])]
            if any(m not in self.merges for m in named):
                raise ValueError(f"claims: merge {next(m for m in named if m not in self.merges)!r} is not "
                                 "one of the experiment's merges")
        for merge, values in self.merge_settings.items():
            if merge not in self.merges:
                raise ValueError(f"merge_settings.{merge}: not one of the experiment's merges")
            try:
                Benchmark(merges={merge: values})
            except ValidationError as err:
                raise ValueError(f"merge_settings.{merge}: {_first_error(err)}") from None
        for merge, printed in self.printed.items():
            if merge not in self.merges or (known is not None and any(n not in known for n in printed)):
                raise ValueError(f"printed.{merge}: a merge of the experiment, its keys base and variant names")
        return self

    def scaling_of(self, merge: str) -> float | None:
        """The merge's fixed lambda (None: searched)."""
        return self.scaling.get(merge) if isinstance(self.scaling, dict) else self.scaling


class AnalysisClaim(Strict):
    """A statement of the paper a report checks on an analysis's numbers (``mergecal.reports.papers``): ``top_gap``
    (sigma above sigma* in the top subspace), ``top_concentrated`` (the gap larger in the top three subspaces than
    in the rest, on average), ``both_signs`` (some subspaces above, some below), ``positive_cross``
    (cross terms between tasks mostly positive in the top subspaces), ``smaller_magnitude`` (merged task features
    smaller than the specialised ones), ``follows_weight`` (a feature magnitude ratio on the same side of 1 as its
    weight ratio), ``opposite_to_weight`` (the weight magnitude grows while the feature's shrinks),
    ``own_layer_gains`` (swapping in the inference task's own layer raises its task feature), ``own_layer_gains_most``
    (more than another task's layer does, on average), ``similar_layers`` (two
    tasks' layer sensitivities rank alike), ``between_tasks`` (xi varies less within a task than between tasks)."""

    kind: Literal["top_gap", "top_concentrated", "both_signs", "positive_cross", "smaller_magnitude", "follows_weight",
                  "opposite_to_weight", "own_layer_gains", "own_layer_gains_most", "similar_layers",
                  "between_tasks", "larger_norm", "higher_entropy", "above_start", "entropy_falls",
                  "below_zero_shot", "shrink_better", "over_confident", "under_confident", "best_calibrated",
                  "every_layer_larger"]
    text: str
    setting: str | None = None  # the one setting a claim is about (distac_trajectory's, distac_reliability's regime)


class Analysis(Strict):
    """A figure computed from the testbed's models rather than from cells (``mergecal.pipeline.paper_analysis``:
    ``kind`` names its function), for ``merges`` in ``regime`` of the vision track's first fine-tuning seed."""

    id: str
    item: str
    shows: str
    kind: Literal["svc_inflation", "svc_spectrum", "svc_cross_terms", "magic_projection", "magic_magnitude",
                  "magic_swap", "magic_sensitivity", "magic_xi", "distac_norms", "distac_entropy",
                  "distac_trajectory", "distac_kappa", "distac_reliability", "distac_layer_norms"]
    # magic_magnitude: its operations (trim, sum, disjoint); distac_reliability: its regimes; distac_layer_norms:
    # the parameters shown (weight, bias); the other distac analyses: none ([none])
    merges: list[str] = Field(min_length=1)
    regime: str = "standard"
    claims: list[AnalysisClaim] = Field(default_factory=list)

    @model_validator(mode="after")
    def _claim_kinds(self) -> "Analysis":
        allowed = CLAIMS_OF[self.kind]
        wrong = [c.kind for c in self.claims if c.kind not in allowed]
        if wrong:
            raise ValueError(f"claims: {wrong[0]!r} is no claim on a {self.kind} analysis ({', '.join(allowed)})")
        unset = [c.kind for c in self.claims if c.kind in SETTING_CLAIMS and c.setting is None]
        if unset:
            raise ValueError(f"claims: a {unset[0]} claim names its `setting`")
        return self


#: the claims each kind of analysis can check
CLAIMS_OF = {"svc_inflation": ("top_concentrated",), "svc_spectrum": ("top_gap", "both_signs"),
             "svc_cross_terms": ("positive_cross",), "magic_projection": ("smaller_magnitude",),
             "magic_magnitude": ("follows_weight", "opposite_to_weight"),
             "magic_swap": ("own_layer_gains", "own_layer_gains_most"), "magic_sensitivity": ("similar_layers",),
             "magic_xi": ("between_tasks",), "distac_norms": ("larger_norm",), "distac_entropy": ("higher_entropy",),
             "distac_trajectory": ("above_start", "entropy_falls"),
             "distac_kappa": ("below_zero_shot", "shrink_better"),
             "distac_reliability": ("over_confident", "under_confident", "best_calibrated"),
             "distac_layer_norms": ("every_layer_larger",)}


#: the claims about one setting of their analysis (``AnalysisClaim.setting``)
SETTING_CLAIMS = ("above_start", "entropy_falls", "over_confident", "under_confident", "best_calibrated")


class Measured(Strict):
    """One shape of a measurement: its label, the `mergecal perf` JSON measured on it (committed: a measurement is
    never repeated by `make paper`) and the row of that file to show."""

    shape: str
    file: str
    row: str


class Measurement(Strict):
    """A table of a method's own cost, read from committed `mergecal perf` files (``make perf-svc`` writes them),
    beside the paper's printed figures (another device: shown, never compared)."""

    id: str
    item: str
    shows: str
    measured: list[Measured] = Field(min_length=1)
    printed: dict[str, dict[str, float]] = Field(default_factory=dict)  # shape -> {seconds, mib}
    printed_where: str = ""
    command: str


class ComparisonClaim(Strict):
    """A statement of the paper checked across settings: ``gain`` / ``loss`` / ``par``: ``chain`` in each of
    ``settings`` (default every setting but the reference) above / below / not below (the paired interval reaches 0
    or above) ``than`` (a chain) in ``than_setting`` (default the same setting), per merge and seed."""

    kind: Literal["gain", "loss", "par"]
    text: str
    chain: str
    than: str
    settings: list[str] = Field(default_factory=list)
    than_setting: str | None = None
    merges: list[str] = Field(default_factory=list)


class Comparison(Strict):
    """The same merges and chains across settings, a setting being one regime or the mean of several (DisTaC's
    norm mismatch, each task lengthened in turn): DisTaC's tables and figures. Each chain in each setting is
    paired with the ``reference`` setting's (the paper's Original) on the same test examples."""

    id: str
    item: str
    shows: str
    track: str = "vision"
    merges: list[str] = Field(min_length=1)
    settings: dict[str, list[str]] = Field(min_length=2)  # name -> regimes (several: their mean, each shown too)
    reference: str
    chains: dict[str, str] = Field(min_length=1)  # name -> chain; the first is the merge alone ("{merge}")
    plot: Literal["bars", "line", "members", "none"] = "none"
    values: dict[str, float] = Field(default_factory=dict)  # a line plot's x of each setting
    axis: str = ""
    claims: list[ComparisonClaim] = Field(default_factory=list)
    # the paper's printed numbers (percent): {merge: {"<setting>/<chain>": value}}
    printed: dict[str, dict[str, float]] = Field(default_factory=dict)
    printed_where: str = ""

    @model_validator(mode="after")
    def _names(self) -> "Comparison":
        if self.reference not in self.settings:
            raise ValueError(f"reference {self.reference!r} is not one of the settings")
        if next(iter(self.chains.values())) != MERGE_ALONE:
            raise ValueError("chains: the first is the merge alone, '{merge}'")
        regimes = [r for rs in self.settings.values() for r in rs]
        if not all(self.settings.values()) or len(set(regimes)) != len(regimes):
            raise ValueError("settings: each lists regimes, none twice")
        if self.plot == "line" and set(self.values) != set(self.settings):
            raise ValueError("plot: line takes a value (its x) for every setting")
        for claim in self.claims:
            settings = [*claim.settings, *([claim.than_setting] if claim.than_setting else [])]
            bad = [n for n in settings if n not in self.settings] + [
                c for c in (claim.chain, claim.than) if c not in self.chains] + [
                m for m in claim.merges if m not in self.merges]
            if bad:
                raise ValueError(f"claims: {bad[0]!r} is no setting, chain or merge of the comparison")
        for merge, printed in self.printed.items():
            keys = [k.split("/", 1) for k in printed]
            if merge not in self.merges or any(len(k) != 2 or k[0] not in self.settings or k[1] not in self.chains
                                               for k in keys):
                raise ValueError(f"printed.{merge}: a merge of the comparison, its keys <setting>/<chain>")
        return self

    @property
    def regimes(self) -> list[str]:
        return [r for rs in self.settings.values() for r in rs]

    def as_experiment(self) -> Experiment:
        """The comparison's cells as an experiment: every regime, the merge alone as the base, the other chains as
        variants (named as the comparison names them)."""
        names = list(self.chains)
        return Experiment(id=self.id, item=self.item, shows=self.shows, track=self.track, regimes=self.regimes,
                          merges=self.merges, variants={n: self.chains[n] for n in names[1:]})


@dataclass(frozen=True)
class Variant:
    name: str  # the variant's name (a swept value as written, a task, or a listed name); "base" for the base
    chain: str  # the chain as the matrix writes it, before a fixed scaling is applied
    value: Any = None  # the swept value (a task's index for ``over: tasks``)


def variants(experiment: Experiment, tasks: tuple[str, ...], ranking: list[str] | None = None,
             probed_top: int | None = None) -> list[Variant]:
    """The base, then the experiment's variants in order. A sweep over ``sensitive_top`` takes the probed
    ``ranking`` of the cells' regime and seed (most sensitive first) and ``probing.top`` (``probed_top``); without
    them its chains hold an empty list (their shape, for validation and display)."""
    out = [Variant(BASE, experiment.base)]
    sweep = experiment.sweep
    if sweep is None:
        return out + [Variant(name, chain) for name, chain in experiment.variants.items()]
    if sweep.over == "tasks":
        return out + [Variant(task, sweep.chain.replace("{index}", str(i)), i) for i, task in enumerate(tasks)]
    if sweep.over == "sensitive_top":
        return out + [Variant(str(n), sweep.probed if n == probed_top else
                              sweep.chain.replace("{sensitive}", repr(list((ranking or [])[:n]) if ranking else [])), n)
                      for n in sweep.values]
    return out + [Variant(str(v), sweep.chain.replace("{value}", repr(v) if isinstance(v, str) else str(v)), v)
                  for v in sweep.values]


def _entries(papers: tuple[str, ...], key: str, model, check=None) -> dict[str, list]:
    """Every paper's ``key:`` entries validated as ``model`` (and by ``check``); a bad entry is one line naming the
    file, the entry and what is wrong; ids are distinct and start with the paper's name."""
    out = {}
    for paper in papers:
        where_file = f"mergecal/experiments/{paper}.yaml"
        document = read(paper)
        entries = document.get(key, []) if isinstance(document, dict) else None
        if not isinstance(entries, list):
            raise MergecalError(f"{where_file}: expected a mapping whose `{key}:` is a list")
        found = []
        for i, entry in enumerate(entries):
            where = entry.get("id", f"{key}[{i}]") if isinstance(entry, dict) else f"{key}[{i}]"
            try:
                item = model.model_validate(entry)
                if check is not None:
                    check(item)
            except (ValidationError, ValueError) as err:
                raise MergecalError(f"{where_file}: {where}: {_first_error(err)}") from None
            if not item.id.startswith(f"{paper}."):
                raise MergecalError(f"{where_file}: {item.id}: ids start with '{paper}.'")
            found.append(item)
        repeated = sorted({e.id for e in found if [f.id for f in found].count(e.id) > 1})
        if repeated:
            raise MergecalError(f"{where_file}: {repeated[0]}: listed twice under `{key}:`")
        out[paper] = found
    return out


def _check_variants(experiment: Experiment) -> None:
    for variant in variants(experiment, ("t",)):
        _check_chain(variant.chain)


def load_experiments(papers: tuple[str, ...] = PAPERS) -> dict[str, list[Experiment]]:
    """Every paper's experiments (``experiments:``), validated, their chains too."""
    return _entries(papers, "experiments", Experiment, _check_variants)


def load_analyses(papers: tuple[str, ...] = PAPERS) -> dict[str, list[Analysis]]:
    """Every paper's analyses (``analyses:``), validated."""
    return _entries(papers, "analyses", Analysis)


def load_comparisons(papers: tuple[str, ...] = PAPERS) -> dict[str, list[Comparison]]:
    """Every paper's comparisons across settings (``comparisons:``), validated, their chains too."""
    return _entries(papers, "comparisons", Comparison, lambda c: _check_variants(c.as_experiment()))


def load_measurements(papers: tuple[str, ...] = PAPERS) -> dict[str, list[Measurement]]:
    """Every paper's measurements (``measurements:``), validated."""
    return _entries(papers, "measurements", Measurement)


def _first_error(err: Exception) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(err).splitlines()[0]


def probed_ranking(params: Params, root, regime: str, seed: int) -> list[str]:
    """The vision track's probed keys of ``regime`` and fine-tuning ``seed``, most magnitude-sensitive first."""
    return [key for key, _ in SensitivityRanking.load(paths_for(params, root, seed).sensitivity(regime)).scores]


def narrowed_params(params: Params, experiment: Experiment, chains: list[str] | None = None) -> Params:
    """The params whose matrix is the experiment, for merges of one scaling (``protocol_groups``): its merges (each
    with the matrix's own settings, else the experiment's ``merge_settings``), its base and its variants' ``chains``
    (at its fixed scaling, or searched; the base searched under ``base_scaling: searched``), its regimes. Cell ids
    hash none of what changes here, so a cell the default matrix also runs keeps its id."""
    where = f"experiment {experiment.id}"
    section = getattr(params, experiment.track, None)
    if section is None or not getattr(section, "enabled", False):
        raise MergecalError(f"{where}: its track {experiment.track!r} is not enabled in params.yaml")
    settings = {**experiment.merge_settings, **params.benchmark.merges}
    missing = [m for m in experiment.merges if m not in settings]
    if missing:
        raise MergecalError(f"{where}: merge {missing[0]!r} is not in params.yaml's benchmark.merges nor in the "
                            "experiment's merge_settings")
    regimes = [*getattr(section, "regimes", ["standard"]), *getattr(section, "paper_regimes", [])]
    absent = [r for r in experiment.regimes if r not in regimes]
    if absent:
        raise MergecalError(f"{where}: regime {absent[0]!r} is not among {experiment.track}.regimes or "
                            f"paper_regimes {regimes}")
    tasks = tuple(section.tasks)
    found = variants(experiment, tasks)
    chains = chains or list(dict.fromkeys(v.chain for v in found[1:]))
    profile = [r for r in experiment.regimes if r in getattr(section, "paper_regimes", [])]
    probed = [c for c in [experiment.base, *chains] if uses_sensitivity(c.replace(MERGE_ALONE, "task_arithmetic"))]
    if profile and probed and experiment.track == "vision":  # the probe is the vision track's (other tracks: none)
        raise MergecalError(f"{where}: chain {probed[0]!r} reads the probe, which the papers' regime {profile[0]!r} "
                            "does not run")
    update: dict[str, Any] = {"merges": {m: settings[m] for m in experiment.merges}}
    scaling = experiment.scaling_of(experiment.merges[0])
    if scaling is None:  # calibrated chains take the scaling their merge alone chose: it runs too
        update.update(chains=list(dict.fromkeys([MERGE_ALONE, experiment.base, *chains])), fixed_scaling=[])
    elif experiment.base_scaling == "searched":
        update.update(chains=[MERGE_ALONE], fixed_scaling=[FixedScaling(scaling=scaling, chains=chains,
                                                                        merges=experiment.merges)])
    else:
        update.update(chains=[], fixed_scaling=[FixedScaling(scaling=scaling, merges=experiment.merges,
                                                             chains=list(dict.fromkeys([experiment.base, *chains])))])
    narrowed = {"benchmark": params.benchmark.model_copy(update=update)}
    if hasattr(section, "regimes"):
        narrowed[experiment.track] = section.model_copy(update={"regimes": list(experiment.regimes)})
    return params.model_copy(update=narrowed)


@dataclass(frozen=True)
class ExperimentCell:
    experiment: str
    variant: str  # a variant's name, "base", or a reference ("zeroshot", "finetuned")
    cell: Cell


def experiment_cells(params: Params, experiment: Experiment, root=None) -> list[ExperimentCell]:
    """The experiment's cells (its track's, per regime and fine-tuning seed): the references, then per merge the
    base and each variant. A sweep over ``sensitive_top`` reads the probe's ranking of each regime and seed under
    ``root`` (the checkout whose models the cells merge)."""
    if experiment.sweep is not None and experiment.sweep.over == "sensitive_top":
        if experiment.track != "vision":
            raise MergecalError(f"experiment {experiment.id}: a sweep over sensitive_top reads the vision probe")
        if root is None:
            raise MergecalError(f"experiment {experiment.id}: its sweep reads the probe's ranking: give the checkout")
        out = []
        for regime in experiment.regimes:
            for seed in params.seeds:
                one = experiment.model_copy(update={"regimes": [regime]})
                found = variants(one, (), probed_ranking(params, root, regime, seed), params.probing.top)
                out += _cells(params.model_copy(update={"seeds": [seed]}), one, found)
        return out
    return _cells(params, experiment, variants(experiment, tuple(getattr(params, experiment.track).tasks)))


def protocol_groups(experiment: Experiment) -> list[Experiment]:
    """The experiment split by scaling: one copy per fixed lambda (and one for the searched merges), in merge
    order."""
    groups: dict[float | None, list[str]] = {}
    for merge in experiment.merges:
        groups.setdefault(experiment.scaling_of(merge), []).append(merge)
    return [experiment.model_copy(update={"merges": merges, "scaling": scaling}) for scaling, merges in groups.items()]


def _cells(params: Params, experiment: Experiment, found: list[Variant]) -> list[ExperimentCell]:
    """The cells of ``found`` (the base, then the variants) for each protocol group; the references once."""
    out, seen = [], set()
    for group in protocol_groups(experiment):
        for entry in _group_cells(params, group, found):
            if entry.cell not in seen:
                seen.add(entry.cell)
                out.append(entry)
    return out


def _group_cells(params: Params, experiment: Experiment, found: list[Variant]) -> list[ExperimentCell]:
    narrowed = narrowed_params(params, experiment, list(dict.fromkeys(v.chain for v in found[1:])))
    scaling = experiment.scaling_of(experiment.merges[0])
    searched_base = scaling is None or experiment.base_scaling == "searched"
    written = {found[0].chain if searched_base else fixed_chain(found[0].chain, scaling): BASE}
    written.update({(v.chain if scaling is None else fixed_chain(v.chain, scaling)): v.name for v in found[1:]})
    written.setdefault(MERGE_ALONE, MERGE_ALONE)  # the scaling source of a searched experiment's calibrated base
    out = []
    for cell in get_track(experiment.track).cells(narrowed):
        name = cell.merge if cell.merge in REFERENCES else written.get(cell.chain)
        if name is None:
            raise MergecalError(f"experiment {experiment.id}: the track made a cell it did not ask for ({cell.label})")
        out.append(ExperimentCell(experiment.id, name, cell))
    return out


def paper_cells(params: Params, root=None, papers: tuple[str, ...] = PAPERS) -> tuple[list[Cell], list[ExperimentCell]]:
    """Every experiment's cells once (a cell two experiments share, or that the matrix runs, is one cell), and
    each experiment's cells (``root``: the checkout, for the sweeps that read its probe's rankings)."""
    every = [*(e for found in load_experiments(papers).values() for e in found),
             *(c.as_experiment() for found in load_comparisons(papers).values() for c in found)]
    listed = [c for e in every for c in experiment_cells(params, e, root)]
    cells = list(dict.fromkeys(c.cell for c in listed))
    return cells, listed
