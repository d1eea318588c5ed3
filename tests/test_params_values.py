"""#13 item 4: every wrong value in params.yaml fails at load with one line naming its dotted key and what is
allowed. Each mutation is applied to the repository's own params.yaml, as YAML text, so values arrive exactly as
a user's file delivers them (YAML reads `.nan`, `1e39`, `"120"` and `true` its own way)."""

from pathlib import Path

import pytest
import yaml

from mergecal.data.vision import SuiteConfig
from mergecal.config_types import ConfigValueError, check_config
from mergecal.errors import ParameterError
from mergecal.pipeline.config import load_params

REPO = Path(__file__).resolve().parents[1]


def _set(data: dict, dotted: str, value):
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[last] = value


# (dotted key, YAML value, the key the message must name, what the message must say)
MUTATIONS = [
    ("vision.finetune.steps", "many", "vision.finetune.steps", "valid integer"),
    ("vision.finetune.steps", '"120"', "vision.finetune.steps", "valid integer"),
    ("vision.finetune.steps", "12.5", "vision.finetune.steps", "valid integer"),
    ("vision.finetune.steps", "-5", "vision.finetune.steps", "greater than or equal to 1"),
    ("vision.finetune.steps", "0", "vision.finetune.steps", "greater than or equal to 1"),
    ("vision.finetune.steps", "true", "vision.finetune.steps", "valid integer"),
    ("vision.finetune.lr", "-0.001", "vision.finetune.lr", "greater than 0"),
    ("vision.finetune.lr", ".nan", "vision.finetune.lr", "finite number"),
    ("vision.finetune.lr", "true", "vision.finetune.lr", "not a boolean"),
    ("vision.pretrain.lr", ".inf", "vision.pretrain.lr", "finite number"),
    ("vision.pretrain.batch_size", "-128", "vision.pretrain.batch_size", "greater than or equal to 1"),
    ("vision.finetune.batch_size", "-1", "vision.finetune.batch_size", "greater than or equal to 1"),
    ("vision.finetune.label_smoothing", "1.5", "vision.finetune.label_smoothing", "less than 1"),
    ("vision.finetune.low_confidence_loss", "bogus", "vision.finetune.low_confidence_loss",
     "'label_smoothing', 'mixup' or 'focal'"),
    ("vision.data.n_train", "-4000", "vision.data.n_train", "greater than or equal to 1"),
    ("vision.data.n_test", "0", "vision.data.n_test", "greater than or equal to 1"),
    ("text.data.n_train", "-1", "text.data.n_train", "greater than or equal to 1"),
    ("text.finetune.lr", ".nan", "text.finetune.lr", "finite number"),
    ("text.finetune.freeze_embeddings", "yes_please", "text.finetune.freeze_embeddings", "valid boolean"),
    ("text.tasks", "[]", "text.tasks", "at least 2 tasks"),
    ("text.tasks", "[wordnet_nouns, wordnet_nouns]", "text.tasks", "'wordnet_nouns' is listed twice"),
    ("vision.tasks", "[objects, digits, objects]", "vision.tasks", "'objects' is listed twice"),
    ("vision.tasks", "[objects, shapes]", "vision.tasks", "unknown task 'shapes' in task set 'headroom8'"),
    ("vision.task_set", "vision9", "vision.task_set", "unknown task set 'vision9'"),
    ("vision.regimes", "[]", "vision.regimes", "at least 1 entries"),
    ("vision.regimes", "[standard, standard]", "vision.regimes", "'standard' is listed twice"),
    ("text.regimes", "[]", "text.regimes", "at least 1"),
    ("vision.arch", "resnet9000", "vision.arch", "unknown architecture 'resnet9000'; choose from: mergecal-vit-tiny"),
    ("vision.backbone", "../elsewhere", "vision.backbone", "should match pattern"),
    ("vision.norm_mismatch_lr_multiplier", "-15", "vision.norm_mismatch_lr_multiplier", "greater than 0"),
    ("device", "cudaXYZ", "device", "expected auto, cpu, cuda or cuda:N"),
    ("device", "tpu", "device", "expected auto, cpu, cuda or cuda:N"),
    ("threads", "0", "threads", "greater than or equal to 1"),
    ("threads", '"2"', "threads", "valid integer"),
    ("threads", "2.5", "threads", "valid integer"),
    ("threads", "true", "threads", "valid integer"),
    ("threads", "4096", "threads", "less than or equal to 1024"),
    ("seed", "-1", "seed", "greater than or equal to 0"),
    ("seed", "0.5", "seed", "valid integer"),
    ("tracking.store", "/etc", "tracking.store", "relative directory inside the repository"),
    ("tracking.store", "../outside", "tracking.store", "relative directory inside the repository"),
    ("benchmark.merges.task_arithmetic.scaling", ".nan", "benchmark.merges", "finite number"),
    ("benchmark.merges.task_arithmetic.scaling", "-3", "benchmark.merges.task_arithmetic.scaling",
     "expected a positive number"),
    ("benchmark.merges.task_arithmetic.scaling", "[.inf]", "benchmark.merges", "finite number"),
    ("benchmark.merges.task_arithmetic.scaling", "[true]", "benchmark.merges", "not a boolean"),
    ("benchmark.merges.task_arithmetic.scaling", "[0.3, -1]", "benchmark.merges.task_arithmetic.scaling",
     "expected a positive number"),
    ("benchmark.merges.task_arithmetic.scaling", "[]", "benchmark.merges.task_arithmetic.scaling",
     "non-empty list of distinct numbers"),
    ("benchmark.merges.task_arithmetic.scaling", "[0.3, 0.3]", "benchmark.merges.task_arithmetic.scaling",
     "distinct"),
    ("benchmark.merges.task_arithmetic.scaling", "1e39", "benchmark.merges", "float32's range"),
    ("benchmark.merges.ties", "[0.2]", "benchmark.merges.ties", "valid dictionary"),
    ("benchmark.evaluation.batch_size", "0", "benchmark.evaluation.batch_size", "greater than or equal to 1"),
    ("benchmark.evaluation.max_validation", "-50", "benchmark.evaluation.max_validation", "greater than or equal to 1"),
    ("probing.scale", "-1.1", "probing.scale", "greater than 0"),
    ("probing.top", "-3", "probing.top", "greater than or equal to 0"),
    ("probing.max_samples", '"256"', "probing.max_samples", "valid integer"),
    ("runner.max_workers", "0", "runner.max_workers", "greater than or equal to 1"),
    ("runner.retries", "-1", "runner.retries", "greater than or equal to 0"),
    ("runner.retry_delay_seconds", ".nan", "runner.retry_delay_seconds", "finite number"),
    ("vision.enabled", "maybe", "vision.enabled", "valid boolean"),
    ("llm.tasks", "[maximum, addition]", "llm.tasks", "unknown task 'addition'; the LLM suite's tasks are: maximum"),
    ("llm.tasks", "[maximum]", "llm.tasks", "at least 2 tasks"),
    ("llm.regimes", "[norm_mismatch]", "llm.regimes.0", "Input should be 'standard'"),
    ("llm.data.n_test", "0", "llm.data.n_test", "greater than or equal to 1"),
    ("llm.data.qa_fraction", "1.5", "llm.data.qa_fraction", "less than or equal to 1"),
    ("llm.pretrain.steps", '"300"', "llm.pretrain.steps", "valid integer"),
    ("llm.pretrain.lr", ".nan", "llm.pretrain.lr", "finite number"),
    ("llm.finetune.freeze_embeddings", "sometimes", "llm.finetune.freeze_embeddings", "valid boolean"),
    ("llm.finetune.stepz", "3", "llm.finetune.stepz", "unknown field; allowed: steps"),
    ("llm.finetune_per_task.maximum.lr", "-0.1", "llm.finetune_per_task.maximum.lr", "greater than 0"),
    ("llm.finetune_per_task.summing", "{steps: 3}", "llm.finetune_per_task.summing", "not one of the track's tasks"),
    ("llm.evaluation.max_validation", "0", "llm.evaluation.max_validation", "greater than or equal to 1"),
    ("llm.backbone", "../x", "llm.backbone", "should match pattern"),
]


@pytest.mark.parametrize("dotted, value, key, says", MUTATIONS, ids=[f"{m[0]}={m[1]}" for m in MUTATIONS])
def test_a_wrong_value_fails_at_load_naming_its_key(tmp_path, dotted, value, key, says):
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    _set(data, dotted, yaml.safe_load(value))
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ParameterError) as info:
        load_params(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}"), message
    assert says in message, message


def test_yaml_exponent_without_a_dot_is_still_a_number(tmp_path):
    """YAML 1.1 reads `1e-5` as the string '1e-5': a real-valued setting takes it as the number it means."""
    text = (REPO / "params.yaml").read_text().replace("lr: 0.001, warmup_steps: 25", "lr: 3e-4, warmup_steps: 25")
    assert "lr: 3e-4" in text  # the vision fine-tunes' lr
    (tmp_path / "params.yaml").write_text(text)
    assert yaml.safe_load("lr: 3e-4") == {"lr": "3e-4"}
    assert load_params(tmp_path / "params.yaml").vision.finetune["lr"] == pytest.approx(3e-4)


def test_library_configs_carry_the_types_the_validator_uses():
    assert check_config(SuiteConfig, {"n_train": 10}).n_train == 10
    with pytest.raises(ConfigValueError, match="greater than or equal to 1") as info:
        check_config(SuiteConfig, {"n_train": 0})
    assert info.value.key == "n_train"
    with pytest.raises(ConfigValueError, match="unknown field; allowed: n_train") as info:
        check_config(SuiteConfig, {"n_trian": 10})
    assert info.value.key == "n_trian"


def test_the_repository_and_smoke_params_load():
    load_params(REPO / "params.yaml")
    load_params(REPO / "mergecal" / "pipeline" / "smoke_params.yaml")


def test_schema_defaults_are_the_librarys_and_enabled_means_what_it_says():
    """Regression (#18 defect 7): defaults were written at three levels and disagreed; a track's `enabled`
    was read for text only."""
    from mergecal.data.text import DEFAULT_TASKS
    from mergecal.pipeline.cells import enumerate_cells
    from mergecal.pipeline.config import parse_params
    from mergecal.train.pretrain_clip import PretrainConfig

    defaults = parse_params({})
    assert defaults.vision.arch == PretrainConfig().arch and tuple(defaults.text.tasks) == DEFAULT_TASKS
    assert defaults.vision.enabled and defaults.text.enabled and defaults.llm.enabled  # the stages build all three
    from mergecal.data.llm import TASKS as LLM_TASKS
    from mergecal.train.lm import LmTrainConfig

    assert defaults.llm.tasks == list(LLM_TASKS)
    assert LmTrainConfig(**defaults.llm.finetune_config("maximum", 0)) == LmTrainConfig()
    merges = {"benchmark": {"merges": {"ties": {}}}}
    tracks = {"vision", "text", "llm"}
    assert {c.track for c in enumerate_cells(parse_params(merges))} == tracks
    for track in tracks:
        disabled = parse_params({**merges, track: {"enabled": False}})
        assert {c.track for c in enumerate_cells(disabled)} == tracks - {track}
