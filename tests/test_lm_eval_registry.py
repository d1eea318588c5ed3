"""lm-eval's registry tasks for a lab's own LLM family (``task_source: registry``), offline.

What is real: lm-eval's own registry, its ``arc_easy`` / ``arc_challenge`` / ``boolq`` YAMLs and its task loading
(``datasets.load_dataset("allenai/ai2_arc", "ARC-Easy")`` under HF_DATASETS_OFFLINE=1), the Hugging Face datasets
cache lookup, lm-eval's scoring (``evaluate_lm``) of a micro Llama base written to disk (random weights, the real
key layout). What is substituted: the cached dataset. A temporary HF_DATASETS_CACHE is filled, without network,
with four made-up ARC-shaped rows per split, written by datasets' own json builder into the directory layout a
hub download of ``allenai/ai2_arc`` leaves (``allenai___ai2_arc/<config>/0.0.0/<hash>/ai2_arc-<split>.arrow``),
so the scores are not ARC's. ``aps/super_glue`` (boolq) is not cached: its error is the missing-dataset path.
Indexing lm-eval's registry takes about 30 s on a busy 2-core machine (once per process, twice per module here).
"""

import json
import shutil

import pytest
import torch

from mergecal.errors import CheckpointError, ParameterError, UnknownNameError
from mergecal.pipeline import local_llm
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
    """A micro Llama base in <root>/ckpt/base and an HF datasets cache holding allenai/ai2_arc's two configs."""
    import datasets

    from mergecal.backbones.hf_causal_lm import save_causal_lm
    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("registry")
    tokenizer = train_tokenizer(["Question: which is larger? Answer: the first one"] * 30, MICRO["vocab_size"])
    save_causal_lm(create_tiny_llama(tokenizer, TinyLlamaShape(**MICRO), seed=1), tokenizer, root / "ckpt" / "base")
    cache = root / "hf_datasets"
    for config in ("ARC-Easy", "ARC-Challenge"):
        rows = {split: [{"id": f"{split}{i}", "question": f"{config} {split} question {i}?",
                         "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
                         "answerKey": "ABC"[i % 3]} for i in range(4)] for split in ("train", "validation", "test")}
        _cache_hub_dataset(cache, "allenai/ai2_arc", config, rows)
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
                      limit=3, device="cpu", registry=True)
    assert raw["arc_easy"]["n"] == 3 and raw["arc_easy__mergecal_validation"]["n"] == 3
    assert {"acc", "acc_norm"} <= set(raw["arc_easy"])
    for split in ("validation", "test"):
        scores = score.score(root / "ckpt" / "base", ["arc_easy", "arc_challenge"], split)
        assert set(scores) == {"arc_easy", "arc_challenge"}
        assert all(0 <= v <= 1 for v in scores.values())


def test_registry_task_digests_follow_lm_evals_version_and_the_task_definition(lab, monkeypatch):
    import importlib.metadata

    from mergecal.evaluation import lm_eval_registry

    root, _ = lab
    config = parse_params({"local_llm": [_track()]}).local_llm[0]
    digests = local_llm.task_config_digests(config, root)
    assert set(digests) == {"arc_easy", "arc_challenge"} and digests["arc_easy"] != digests["arc_challenge"]
    assert local_llm.task_config_digests(config, root) == digests  # stable
    params = parse_params({"local_llm": [_track()]})  # the local_inputs stage records them: local_tracks reruns
    assert local_llm.record_inputs(params, root)["lab-registry"]["registry"] == digests
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
