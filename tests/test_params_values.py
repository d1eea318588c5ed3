"""#13 item 4: every wrong value in params.yaml fails at load with one line naming its dotted key and what is
allowed. Each mutation is applied to the repository's own params.yaml, as YAML text, so values arrive exactly as
a user's file delivers them (YAML reads `.nan`, `1e39`, `"120"` and `true` its own way)."""

from pathlib import Path

import pytest
import yaml

from mergecal.data.vision import SuiteConfig
from mergecal.config_types import ConfigValueError, check_config
from mergecal.errors import ParameterError
from mergecal.pipeline import track_registry
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
    ("vision.norm_mismatch_lr_multiplier.digits", "-5", "vision.norm_mismatch_lr_multiplier", "greater than 0"),
    ("vision.norm_mismatch_lr_multiplier.shapes", "5", "vision.norm_mismatch_lr_multiplier",
     "'shapes' is not one of the track's tasks"),
    ("vision.norm_mismatch_lr_multiplier", "{symbols: 10}", "vision.norm_mismatch_lr_multiplier",
     "no multiple for 'objects', which a norm-mismatch regime lengthens"),
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
    # FSC's sample count is the FSC step's n_samples_per_task (in its recipe id); the old setting was never used
    ("benchmark.evaluation.fsc_samples_per_task", "8", "benchmark.evaluation.fsc_samples_per_task",
     "unknown key; allowed: batch_size, max_validation, distac_samples"),
    ("probing.metric", "loss", "probing.metric", "Input should be 'accuracy' or 'nll'"),
    ("probing.candidates", "weights", "probing.candidates", "Input should be 'layers' or 'all'"),
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
    # hardening, second round: a shape transformers' Llama cannot build fails at load, not inside the stage
    ("llm.shape.num_attention_heads", "3", "llm.shape.num_attention_heads", "3 heads do not divide hidden_size 128"),
    ("llm.shape.num_key_value_heads", "3", "llm.shape.num_key_value_heads",
     "3 key/value heads do not divide num_attention_heads 4"),
    ("llm.shape.hidden_size", "12", "llm.shape.num_attention_heads", "= 3 is odd; rotary embeddings need it even"),
    # ... and counts have an upper bound (mergecal.config_types.MAX_*); a float-looking count is no count
    ("llm.pretrain.steps", "9223372036854775808", "llm.pretrain.steps", "less than or equal to 10000000"),
    ("vision.finetune.steps", "10000001", "vision.finetune.steps", "less than or equal to 10000000"),
    ("llm.data.n_train", "1000000000000000000000000000000", "llm.data.n_train", "less than or equal to 100000000"),
    ("llm.data.n_train", "1e30", "llm.data.n_train", "valid integer"),
    ("runner.max_workers", "1000000000", "runner.max_workers", "less than or equal to 256"),
    ("runner.max_workers", "3.0", "runner.max_workers", "valid integer"),
    ("seed", "18446744073709551616", "seed", "less than or equal to 4294967295"),
    ("distac.steps", "3.0", "distac", "parameter 'steps': Input should be a valid integer (got 3.0)"),
    ("distac.steps", "100000000000", "distac", "parameter 'steps': Input should be less than or equal to 10000000"),
    ("distac.schedule", "linear", "distac", "parameter 'schedule': Input should be 'constant' or 'cosine'"),
    ("distac.warmup_fraction", "-0.1", "distac", "parameter 'warmup_fraction': Input should be greater than or equal"),
    ("benchmark.evaluation.distac_samples", "1000000000", "benchmark.evaluation.distac_samples",
     "less than or equal to 100000000"),
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


def test_magic_fixed_scaling_rows_hold_fscs_network_task_feature_where_fsc_runs():
    """#29: `fsc(task_feature=network)` beside `fsc` at MAGIC's lambda = 0.3 for TA and TIES: a vision cell per
    regime whose recipe id names the option; the text and LLM tracks skip it as they skip `fsc`, with its reason."""
    from mergecal.pipeline.cells import enumerate_cells
    from mergecal.pipeline.track_registry import skipped_cells

    params = load_params(REPO / "params.yaml")
    cells = [c for c in enumerate_cells(params) if c.calibration in ("fsc@λ=0.3", "fsc(task_feature=network)@λ=0.3")]
    network = [c for c in cells if c.calibration.startswith("fsc(task_feature=network)")]
    assert {(c.track, c.regime, c.merge) for c in network} == {
        ("vision", r, m) for r in params.vision.regimes for m in ("task_arithmetic", "ties")}
    assert all("fsc(" in c.recipe and "task_feature='network'" in c.recipe and c.grid == () for c in network)
    assert not any("task_feature" in c.recipe for c in cells if c not in network)  # the default's id is unchanged
    reasons = {}
    for cell, reason in skipped_cells(params):
        if cell.chain.startswith("{merge}(scaling=0.3)>fsc"):
            reasons.setdefault((cell.track, cell.merge), {})[cell.chain] = reason
    assert {key[0] for key in reasons} == {"text", "llm"}
    for by_chain in reasons.values():
        assert len(by_chain) == 2 and len(set(by_chain.values())) == 1


def test_the_testbeds_distac_deviates_from_the_paper_in_steps_and_lr_only_each_with_its_reason():
    """#29: params.yaml's `distac` keeps the paper's protocol (the library default: 500 steps, batch 128, lr 1e-5,
    beta 0.5, constant lr) but for 10x the lr over 10x fewer steps, each deviating line saying why."""
    from mergecal.calibrations.distac import DistacParams
    from mergecal.pipeline.tracks.clip.built.stages import distac_params

    params, paper = load_params(REPO / "params.yaml"), DistacParams()
    for regime in ("standard", "norm_mismatch", "low_confidence"):
        step = distac_params(params, regime).distillation_params()
        differing = {k for k, v in paper.model_dump().items()
                     if k not in ("kappa", "t_teacher", "t_student") and getattr(step, k) != v}  # the presets' own
        assert differing == {"steps", "lr"}, regime
        assert step.steps * step.lr == pytest.approx(paper.steps * paper.lr)
    section = (REPO / "params.yaml").read_text().split("\ndistac:", 1)[1].split("\n\n", 1)[0]
    for key in sorted(differing):
        line = next(line for line in section.splitlines() if line.lstrip().startswith(f"{key}:"))
        assert "#" in line and "paper" in line.split("#", 1)[1], line


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
    # the seq2seq track's regimes run in the papers' profile only: one in the matrix here
    merges = {"benchmark": {"merges": {"ties": {}}}, "seq2seq": {"regimes": ["standard"], "paper_regimes": ["ia3"]}}
    tracks = set(track_registry.BUILT)
    assert {c.track for c in enumerate_cells(parse_params(merges))} == tracks
    assert "seq2seq" not in {c.track for c in enumerate_cells(parse_params({}))}
    for track in tracks:
        disabled = parse_params({**merges, track: {**merges.get(track, {}), "enabled": False}})
        assert {c.track for c in enumerate_cells(disabled)} == tracks - {track}


def test_counts_up_to_a_labs_realistic_settings_load(tmp_path):
    """The maxima leave room: 10^7 optimizer steps, 10^8 samples, 256 workers, a 32-bit seed."""
    from mergecal.config_types import MAX_COUNT, MAX_STEPS, MAX_WORKERS

    assert (MAX_STEPS, MAX_COUNT, MAX_WORKERS) == (10**7, 10**8, 256)
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in [("llm.pretrain.steps", MAX_STEPS), ("llm.data.n_train", MAX_COUNT),
                          ("runner.max_workers", MAX_WORKERS), ("seed", 2**32 - 1), ("distac.steps", MAX_STEPS)]:
        _set(data, dotted, value)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    params = load_params(tmp_path / "params.yaml")
    assert params.llm.pretrain["steps"] == MAX_STEPS and params.runner.max_workers == MAX_WORKERS


def test_the_default_llm_shape_and_a_grouped_query_one_load():
    from mergecal.pipeline.config import parse_params
    from mergecal.train.lm import TinyLlamaShape

    shape = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}  # heads of 16 dimensions
    assert TinyLlamaShape(**parse_params({"llm": {"shape": shape}}).llm.shape) == TinyLlamaShape(**shape)
    with pytest.raises(ValueError, match="3 heads do not divide hidden_size 128"):
        TinyLlamaShape(num_attention_heads=3)  # the library refuses it too, before transformers does


@pytest.mark.parametrize("content, says", [
    (b"seed: 0\n# caf\xe9 (Latin-1)\n", "not UTF-8 text (byte 0xe9 on line 2); save it as UTF-8"),
    (b"", "empty; expected the pipeline's settings"),
    (b"# only a comment\n", "empty; expected the pipeline's settings"),
])
def test_a_params_file_that_is_not_utf8_or_is_empty_is_one_line(tmp_path, capsys, content, says):
    """Regression (hardening, second round, item 2): UnicodeDecodeError escaped load_params (every stage, `mergecal
    report --params`), and an empty file ran the pipeline with every default."""
    from mergecal.cli import main

    path = tmp_path / "mine.yaml"
    path.write_bytes(content)
    with pytest.raises(ParameterError) as info:
        load_params(path)
    assert str(info.value).startswith(f"{path}: {says}") and "\n" not in str(info.value)
    assert main(["report", "--root", str(tmp_path), "--params", "mine.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mergecal: error: {path}: {says}") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "reports").exists()
