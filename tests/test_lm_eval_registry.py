"""lm-eval's registry tasks for a lab's own LLM family (``task_source: registry``), offline.

What is real: lm-eval's own registry, its ``arc_easy`` / ``arc_challenge`` / ``boolq`` / ``hellaswag`` YAMLs (and
hellaswag's ``!function`` document processing) and its task loading (``datasets.load_dataset("allenai/ai2_arc",
"ARC-Easy")`` under HF_DATASETS_OFFLINE=1), the Hugging Face datasets cache lookup, lm-eval's scoring
(``evaluate_lm``) of a micro Llama base written to disk (random weights, the real key layout). What is substituted:
the cached datasets. A temporary HF_DATASETS_CACHE is filled, without network, with four made-up ARC-shaped (and
HellaSwag-shaped) rows per split, written by datasets' own json builder into the directory layout a hub download of
``allenai/ai2_arc`` leaves (``allenai___ai2_arc/<config>/0.0.0/<hash>/ai2_arc-<split>.arrow``), so the scores are
not ARC's. ``aps/super_glue`` (boolq) is not cached: its error is the missing-dataset path. Indexing lm-eval's
registry takes about 30 s on a busy 2-core machine: once per process (scoring indexes only the variant YAMLs).
"""

import json
import shutil

import pytest
import torch

from mergecal.errors import CheckpointError, ParameterError, UnknownNameError
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.tracks.causal_lm.files import stages as local_llm
from mergecal.pipeline.config import parse_params

MICRO = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
EVALUATION = {"max_validation": 3, "batch_size": 8}
ARC = {"arc_easy": {"metric": "acc"}, "arc_challenge": {"metric": "acc_norm"}}


def _track(tasks=None, **extra):
    tasks = ARC if tasks is None else tasks
    return {"name": "lab-registry", "base": "ckpt/base", "experts": {t: f"ckpt/{t}" for t in tasks},
            "task_source": "registry", "tasks": tasks, "evaluation": EVALUATION, **extra}


@pytest.mark.parametrize("extra, message", [
    ({"task_dir": "t"}, r"local_llm.0.task_dir: not with task_source: registry"),
    ({"data": {"n_test": 4}}, r"local_llm.0.data: not with task_source: registry"),
    ({"tasks": {"arc_easy": {"metric": "acc"}, "arc_challenge": {"metric": "acc", "validation": "x"}}},
     r"local_llm.0.tasks.arc_challenge.validation: not with task_source: registry"),
    ({"tasks": {"arc_easy": {"metric": "acc"}}}, r"local_llm.0.tasks.arc_challenge: missing: give the metric"),
    ({"task_source": "registri"}, r"local_llm.0.task_source: Input should be 'suite', 'task_dir' or 'registry'"),
])
def test_registry_params_errors_are_one_clear_line(extra, message):
    track = _track()
    track.update(extra)
    with pytest.raises(ParameterError, match=message) as info:
        parse_params({"local_llm": [track]})
    assert "\n" not in str(info.value)


def _cache_hub_dataset(cache, repo, config, rows):
    """Write ``rows`` ({split: [row]}) where a hub download of ``repo``/``config`` is cached (module docstring)."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json, JsonConfig

    namespace, name = repo.split("/")
    files = {}
    for split, split_rows in rows.items():
        path = cache.parent / "raw" / f"{name}-{config}-{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(r) for r in split_rows))
        files[split] = [str(path)]

    class Hub(Json):  # a builder config named as the hub's, so the cache directory is named as a download's
        BUILDER_CONFIGS = [JsonConfig(name=config, data_files=DataFilesDict.from_patterns(files))]

    Hub(cache_dir=str(cache), dataset_name=name, config_name=config, hash="0" * 40).download_and_prepare()
    target = cache / f"{namespace}___{name}"
    target.mkdir(exist_ok=True)
    shutil.copytree(cache / name / config, target / config)  # the namespace directory of a hub download
    shutil.rmtree(cache / name)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A micro Llama base in <root>/ckpt/base and an HF datasets cache holding allenai/ai2_arc's two configs and
    Rowan/hellaswag (the answers differ by split, so a task scored on the wrong split scores differently)."""
    import datasets

    from mergecal.backbones.hf_causal_lm import save_causal_lm
    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("registry")
    tokenizer = train_tokenizer(["Question: which is larger? Answer: the first one"] * 30, MICRO["vocab_size"])
    save_causal_lm(create_tiny_llama(tokenizer, TinyLlamaShape(**MICRO), seed=1), tokenizer, root / "ckpt" / "base")
    cache = root / "hf_datasets"
    shift = {"train": 2, "validation": 1, "test": 0}
    for config in ("ARC-Easy", "ARC-Challenge"):
        rows = {split: [{"id": f"{split}{i}", "question": f"{config} {split} question {i}?",
                         "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
                         "answerKey": "ABC"[(i + shift[split]) % 3]} for i in range(4)] for split in shift}
        _cache_hub_dataset(cache, "allenai/ai2_arc", config, rows)
    _cache_hub_dataset(cache, "Rowan/hellaswag", "default", {split: [
        {"ind": i, "activity_label": "Cooking", "ctx_a": f"{split} context {i}", "ctx_b": "then", "ctx": "",
         "endings": ["one", "two", "three", "four"], "source_id": "x", "split": split, "split_type": "indomain",
         "label": str((i + shift[split]) % 4)} for i in range(4)] for split in shift})
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # what HF_DATASETS_CACHE sets when datasets is imported
    yield root, cache
    mp.undo()


def test_a_registry_task_is_scored_offline_on_its_splits_from_the_local_cache(lab):
    """arc_easy reports lm-eval's test split and chooses the scaling on validation (a variant YAML that
    includes lm-eval's own); each score is lm-eval's metric over the cached rows (3 validation rows: the limit)."""
    root, _ = lab
    config = parse_params({"local_llm": [_track()]}).local_llm[0]
    score = local_llm.scorer(config, root)
    assert score.names == {"arc_easy": {"validation": "arc_easy__mergecal_validation", "test": "arc_easy"},
                           "arc_challenge": {"validation": "arc_challenge__mergecal_validation",
                                             "test": "arc_challenge"}}
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm

    raw = evaluate_lm(root / "ckpt" / "base", ["arc_easy", "arc_easy__mergecal_validation"], score.task_dir,
                      limit=3, device="cpu")
    assert raw["arc_easy"]["n"] == 3 and raw["arc_easy__mergecal_validation"]["n"] == 3
    assert {"acc", "acc_norm"} <= set(raw["arc_easy"])
    for split in ("validation", "test"):
        scores = score.score(root / "ckpt" / "base", ["arc_easy", "arc_challenge"], split)
        assert set(scores) == {"arc_easy", "arc_challenge"}
        assert all(0 <= v <= 1 for v in scores.values())


def test_scoring_a_registry_track_indexes_its_variant_yamls_alone(lab, monkeypatch):
    """Regression: scoring built a second TaskManager over lm-eval's whole registry (include_defaults=True, tens
    of seconds per process) beside the one that looks the tasks up."""
    import inspect

    import lm_eval.tasks

    root, _ = lab
    score = local_llm.scorer(parse_params({"local_llm": [_track()]}).local_llm[0], root)
    built, real = [], lm_eval.tasks.TaskManager

    class Recording(real):
        def __init__(self, *args, **kwargs):
            bound = inspect.signature(real).bind(*args, **kwargs)
            bound.apply_defaults()
            built.append((bound.arguments["include_defaults"], bound.arguments["include_path"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    for split in ("validation", "test"):
        score.score(root / "ckpt" / "base", ["arc_easy", "arc_challenge"], split)
    assert built == [(False, str(score.task_dir.resolve()))] * 2


def _loaded(task_dir, tasks):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False).load(list(tasks))["tasks"]


def _config(task):
    """A loaded task's configuration, less the file it was read from."""
    config = task.config.to_dict()
    config["metadata"].pop("config_source")
    return config


def test_the_reported_split_variant_scores_as_the_registry_task_itself(lab, tmp_path):
    """The variant of the reported split is lm-eval's task: the same configuration, documents (the test split)
    and scores as lm-eval's own YAML files (linked into a directory so that evaluate_lm indexes them alone); the
    chosen split's variant differs from it by its test_split alone."""
    from mergecal.evaluation import lm_eval_registry
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm

    root, _ = lab
    score = local_llm.scorer(parse_params({"local_llm": [_track()]}).local_llm[0], root)
    tasks = ["arc_easy", "arc_challenge"]
    for task in tasks:
        (tmp_path / f"{task}.yaml").symlink_to(lm_eval_registry.task_yaml(task))
    ours, theirs = _loaded(score.task_dir, tasks), _loaded(tmp_path, tasks)
    variants = _loaded(score.task_dir, [score.names[t]["validation"] for t in tasks])
    for task in tasks:
        assert _config(ours[task]) == _config(theirs[task])
        assert list(ours[task].eval_docs["id"]) == list(theirs[task].eval_docs["id"]) == [f"test{i}" for i in range(4)]
        variant = _config(variants[score.names[task]["validation"]])
        assert variant == _config(theirs[task]) | {"task": score.names[task]["validation"], "test_split": "validation"}
    base = root / "ckpt" / "base"
    assert evaluate_lm(base, tasks, score.task_dir, device="cpu") == evaluate_lm(base, tasks, tmp_path, device="cpu")


def test_function_entries_of_an_included_registry_yaml_resolve_without_the_registry(lab, tmp_path):
    """hellaswag's ``process_docs: !function utils.process_docs`` is resolved beside lm-eval's YAML, not the
    variant's, when only the variants are indexed: both splits are read through it (its capitalized ``ctx_b``)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from mergecal.evaluation import lm_eval_registry
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm

    root, _ = lab
    names = lm_eval_registry.write_variant_yamls(["hellaswag"], tmp_path)
    assert names == {"hellaswag": {"validation": "hellaswag__mergecal_train", "test": "hellaswag"}}
    loaded = _loaded(tmp_path, names["hellaswag"].values())
    process_docs = load_yaml(lm_eval_registry.task_yaml("hellaswag"))["process_docs"]
    for split, name in (("validation", "hellaswag"), ("train", "hellaswag__mergecal_train")):
        assert loaded[name].config.process_docs is process_docs
        assert [d["query"] for d in loaded[name].eval_docs] == [f"Cooking: {split} context {i} Then" for i in range(4)]
    raw = evaluate_lm(root / "ckpt" / "base", list(names["hellaswag"].values()), tmp_path, device="cpu")
    assert raw["hellaswag"]["n"] == raw["hellaswag__mergecal_train"]["n"] == 4


def test_registry_task_digests_follow_lm_evals_version_and_the_task_definition(lab, monkeypatch):
    import importlib.metadata

    from mergecal.evaluation import lm_eval_registry

    root, _ = lab
    config = parse_params({"local_llm": [_track()]}).local_llm[0]
    digests = local_llm.task_config_digests(config, root)
    assert set(digests) == {"arc_easy", "arc_challenge"} and digests["arc_easy"] != digests["arc_challenge"]
    assert local_llm.task_config_digests(config, root) == digests  # stable
    params = parse_params({"local_llm": [_track()]})  # the local_inputs stage records them: local_tracks reruns
    assert lab_files.record_inputs(params, root)["lab-registry"]["registry"] == digests
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "lm_eval" else real(name))
    assert lm_eval_registry.config_digest("arc_easy") != digests["arc_easy"]
    monkeypatch.undo()
    defined = lm_eval_registry.task_config("arc_easy")
    monkeypatch.setattr(lm_eval_registry, "task_config", lambda task, key=None: {**defined, "doc_to_text": "Q:"})
    assert lm_eval_registry.config_digest("arc_easy") != digests["arc_easy"]


def test_an_unknown_registry_task_names_its_key_and_close_names(lab):
    root, _ = lab
    config = parse_params({"local_llm": [_track({"arc_easy": {"metric": "acc"}, "arc_easyy": {"metric": "acc"}})]})
    with pytest.raises(UnknownNameError, match=r"local_llm track 'lab-registry': tasks.arc_easyy: no task "
                                               r"'arc_easyy' in lm-eval's registry; did you mean arc_easy") as info:
        local_llm.scorer(config.local_llm[0], root)
    assert "\n" not in str(info.value)


def test_a_dataset_missing_from_the_local_cache_fails_the_track_with_one_line(lab):
    """boolq's dataset (aps/super_glue) is not in the cache: nothing is downloaded, the track's references hold
    one line naming the task, the dataset and the cache, and no model is scored."""
    root, cache = lab
    params = parse_params({"local_llm": [_track({"arc_easy": {"metric": "acc"}, "boolq": {"metric": "acc"}})]})
    message = (r"lm-eval task 'boolq': dataset 'aps/super_glue' \(config 'boolq'\) is not in the local Hugging Face "
               r"datasets cache \(.*hf_datasets\); it must be there .* nothing is downloaded")
    with pytest.raises(CheckpointError, match=message) as info:
        local_llm.scorer(params.local_llm[0], root)
    assert "\n" not in str(info.value)
    report = local_llm.references(params.local_llm[0], root)
    assert "aps/super_glue" in report["error"] and "\n" not in report["error"] and "base" not in report
    assert not list(cache.glob("aps___super_glue*"))


def test_a_metric_under_two_filters_is_named_with_its_filter_and_its_documents_per_filter():
    """GSM8K's registry task reports exact_match under two filters (lm-eval 0.4's result keys and one sample per
    document and filter): the bare name would be whichever lm-eval lists last, so only ``metric,filter`` names it;
    a metric under one filter (the suite's ``strip``) keeps its bare name too."""
    from mergecal.evaluation.lm_eval_tasks import _metrics, _per_document

    raw = {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
           "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.2}
    assert _metrics(raw) == {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
                             "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.2}
    assert _metrics({"exact_match,strip": 0.5, "acc,none": 0.75}) == {"exact_match,strip": 0.5, "exact_match": 0.5,
                                                                       "acc": 0.75}
    samples = [{"doc_id": d, "filter": f, "metrics": ["exact_match"], "exact_match": float(v)}
               for f, values in (("flexible-extract", [1, 1]), ("strict-match", [0, 1])) for d, v in
               reversed(list(enumerate(values)))]
    assert _per_document(samples) == {"exact_match,flexible-extract": [1.0, 1.0],
                                      "exact_match,strict-match": [0.0, 1.0]}
    assert _per_document([{"doc_id": 0, "filter": "none", "metrics": ["acc"], "acc": 1.0}]) == {"acc": [1.0]}
