"""The tracks' stability diagnostic (mergecal/pipeline/stability.py, issue #30): the perturbation's size and seed,
a constructed track that flips on near-ties flagged unstable against a robust one, the stage's one-line errors."""

import json

import numpy as np
import pytest
import torch

from mergecal.errors import MergecalError
from mergecal.pipeline.stability import (RELATIVE_SIZE, chosen_scaling, move_summary, perturbed, read_results,
                                         track_stability)
from mergecal.pipeline import track_registry
from mergecal.reports.stability import read_document, section_markdown, stability_markdown, table_warning


def _state():
    g = torch.Generator().manual_seed(0)
    return {"big": 50.0 * torch.randn(200, 300, generator=g, dtype=torch.float64),
            "small": 1e-3 * torch.randn(40_000, generator=g, dtype=torch.float64),
            "f32": torch.randn(256, 256, generator=g),
            "steps": torch.arange(10)}


def test_the_perturbation_is_1e_6_of_each_tensors_rms_and_seeded():
    state = _state()
    once, again, other = perturbed(state, 0), perturbed(state, 0), perturbed(state, 1)
    for key in ("big", "small"):  # float64: the noise is measured exactly
        rms = state[key].pow(2).mean().sqrt()
        ratio = float((once[key] - state[key]).pow(2).mean().sqrt() / rms)
        assert ratio == pytest.approx(RELATIVE_SIZE, rel=0.02), key
        assert once[key].dtype == state[key].dtype
    assert once["f32"].dtype == torch.float32 and not torch.equal(once["f32"], state["f32"])
    assert torch.equal(once["steps"], state["steps"])  # integer buffers are not weights
    assert all(torch.equal(once[k], again[k]) for k in state)
    assert not torch.equal(once["big"], other["big"])
    # the noise of a tensor is its own (seed, name)'s: neither the order nor the other tensors change it
    assert torch.equal(perturbed({"small": state["small"]}, 0)["small"], once["small"])


def _linear_track(near_ties: int, n: int = 300, d: int = 32, tasks=("a", "b")):
    """A fake track: a linear classifier w scoring each task's examples x by sign(x . w) against a label. The
    first ``near_ties`` examples of each task lie within 1e-10 of the decision boundary (correct as is, a coin flip
    under 1e-6 weight noise); the others are far from it, with random labels (about half correct)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    data = {}
    for task in tasks:
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        x[:near_ties] -= torch.outer(x[:near_ties] @ w, w) / (w @ w)  # onto the boundary
        x[:near_ties] += 1e-10 * x[:near_ties].norm(dim=1, keepdim=True) * w / w.norm()  # just on the right side
        labels = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
        labels[:near_ties] = 1.0
        data[task] = (x, labels)

    def evaluate(seed):
        weights = {"w": w} if seed is None else perturbed({"w": w}, seed)
        return {t: ((torch.sign(x @ weights["w"]) == y).double()).tolist() for t, (x, y) in data.items()}

    return evaluate


def test_a_track_whose_outcomes_flip_on_near_ties_is_unstable_and_a_robust_one_is_stable():
    robust = track_stability(_linear_track(near_ties=0))
    assert robust["largest_avg_move"] == 0.0 and robust["changed_fraction"] == 0.0
    assert robust["half_width"] > 2.0 and robust["stable"] is True

    fragile = track_stability(_linear_track(near_ties=90))
    assert fragile["changed_fraction"] > 0.05  # about half of the 30 % near ties flip
    assert fragile["largest_avg_move"] > fragile["half_width"] > 2.0
    assert fragile["stable"] is False
    assert fragile["largest_task_move"]["points"] >= fragile["largest_avg_move"]
    assert len(fragile["avg_acc_per_seed"]) == 3


def test_move_summary_figures():
    baseline = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1]}
    summary = move_summary(baseline, [{"a": [1, 1, 1, 0], "b": [1, 1, 1, 1]}, {"a": [1, 1, 0, 0], "b": [0, 1, 1, 1]}])
    assert summary["avg_acc"] == pytest.approx(75.0)
    assert summary["largest_avg_move"] == pytest.approx(12.5)  # a: +25 points, averaged over 2 tasks
    assert summary["largest_task_move"] == {"task": "a", "points": 25.0}
    assert summary["changed_fraction"] == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="the baseline's examples"):
        move_summary(baseline, [{"a": [1], "b": [1, 1, 1, 1]}])


def test_the_chosen_scaling_is_the_benchmarks_task_arithmetic_row_of_the_standard_regime():
    results = {"rows": [{"track": "vision", "regime": "low_confidence", "label": "task_arithmetic",
                         "selected_scaling": 0.5},
                        {"track": "vision", "regime": "standard", "label": "task_arithmetic>svc",
                         "selected_scaling": 0.7},
                        {"track": "vision", "regime": "standard", "label": "task_arithmetic", "selected_scaling": 0.3},
                        {"track": "llm", "regime": "standard", "label": "task_arithmetic", "error": "boom"}]}
    assert chosen_scaling(results, "vision") == 0.3
    assert chosen_scaling(results, "llm") is None and chosen_scaling(results, "text") is None


def _document(stable: bool):
    entry = {"track": "llm", "backbone": "tiny-llama", "task_set": "llm3", "recipe": "task_arithmetic",
             "regime": "standard", "scaling": 0.5, "avg_acc": 40.0, "half_width": 3.1,
             "avg_acc_per_seed": [40.0, 21.0, 59.0], "largest_avg_move": 3.0 if stable else 19.0,
             "largest_task_move": {"task": "maximum", "points": 30.0}, "changed_fraction": 0.2, "n_examples": 900,
             "stable": stable}
    missing = {"track": "text", "backbone": "minilm", "task_set": "text4", "recipe": "task_arithmetic",
               "regime": "standard", "stable": None, "not_measured": "no row"}
    return {"relative_size": 1e-6, "seeds": [0, 1, 2], "tracks": [entry, missing]}


def test_an_unstable_track_warns_under_its_tables_and_the_section_says_why():
    document = _document(stable=False)
    warning = table_warning(document, "tiny-llama", "llm3")
    assert warning.startswith("Rows of this track move by up to 19.0 points under 1e-06 relative perturbations")
    assert table_warning(document, "minilm", "text4") == "" and table_warning(None, "tiny-llama", "llm3") == ""
    assert table_warning(_document(stable=True), "tiny-llama", "llm3") == ""
    section = section_markdown(document)
    assert "interval half-width of 3.1" in section and section.count(": UNSTABLE") == 1
    assert "text (minilm · text4): not measured (no row)" in section
    assert "| llm | task_arithmetic | 0.5 | 40.0 | 3.10 | 19.00 | 40.0, 21.0, 59.0 |" in stability_markdown(document)


@pytest.mark.parametrize("text, message", [
    (None, r"benchmark.json: not found; the benchmark stage writes it \(run it first\)"),
    ("{", r"benchmark.json: expected the benchmark's JSON summary \(JSONDecodeError\)"),
    ('{"rows": 3}', r"benchmark.json: expected a JSON object with a `rows` list"),
])
def test_the_stage_refuses_a_missing_or_malformed_benchmark_summary_in_one_line(tmp_path, text, message):
    path = tmp_path / "benchmark.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(MergecalError, match=message):
        read_results(path)


def test_the_report_reads_a_stability_document_or_refuses_it_in_one_line(tmp_path):
    path = tmp_path / "stability.json"
    assert read_document(path) is None  # not written yet: no section
    path.write_text(json.dumps(_document(stable=True)))
    assert read_document(path)["tracks"][0]["stable"] is True
    path.write_text('{"tracks": []}')
    with pytest.raises(MergecalError, match=r"stability.json: expected a JSON object with relative_size, seeds, "):
        read_document(path)


def test_linear_track_near_ties_are_correct_as_is():
    """The fake track's construction: its near ties are correct unperturbed, its far examples do not move."""
    examples = _linear_track(near_ties=90)(None)
    assert all(np.all(np.asarray(examples[t][:90]) == 1.0) for t in examples)


def test_a_perturbed_model_directory_is_a_copy_with_only_its_weights_perturbed(tmp_path):
    """The LLM track's perturbation: the merged directory copied, each safetensors file perturbed (metadata kept),
    config and tokenizer files as they were, the source untouched."""
    from mergecal.checkpoint import load_state_dict, save_state_dict
    from mergecal.pipeline.tracks.causal_lm.built.diagnostics import perturbed_model_dir
    from safetensors import safe_open

    source = tmp_path / "merged"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    weights = {"a": torch.randn(8, 8), "b": torch.randn(4)}
    save_state_dict(weights, source / "model.safetensors", {"mergecal_method": "task_arithmetic"})
    out = perturbed_model_dir(source, tmp_path / "seed-1", 1)
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata()["mergecal_method"] == "task_arithmetic"
    copied, original = load_state_dict(out / "model.safetensors"), load_state_dict(source / "model.safetensors")
    assert all(torch.equal(original[k], weights[k]) for k in weights)
    assert all(torch.equal(copied[k], perturbed(weights, 1)[k]) and not torch.equal(copied[k], weights[k])
               for k in weights)


def test_the_stability_stage_input_keeps_what_both_diagnostics_read():
    """results/task_arithmetic_rows.json (written by the benchmark stage): the same scalings and rows as the whole
    summary for both diagnostics, and the same bytes whatever the other rows hold."""
    from mergecal.pipeline.refit_stability import regime_rows as refit_rows
    from mergecal.pipeline.stability_inputs import task_arithmetic_rows

    def row(label, merge, scaling, track="vision", regime="standard", **extra):
        return {"track": track, "regime": regime, "seed": 0, "label": label, "merge": merge,
                "selected_scaling": scaling, "avg_norm_acc": 0.5, **extra}

    results = {"rows": [row("ties", "ties", 0.3), row("task_arithmetic", "task_arithmetic", 0.2),
                        row("task_arithmetic>svc", "task_arithmetic", 0.5),
                        row("task_arithmetic(scaling=0.3)", "task_arithmetic", 0.3, regime="norm_mismatch"),
                        row("task_arithmetic", "task_arithmetic", 0.7, track="text")]}
    reduced = task_arithmetic_rows(results)
    assert len(reduced["rows"]) == 3 and all("avg_norm_acc" not in r for r in reduced["rows"])
    for track in track_registry.DIAGNOSTICS:
        assert chosen_scaling(reduced, track) == chosen_scaling(results, track)
        for regime in ("standard", "norm_mismatch"):
            assert refit_rows(reduced, track, regime, 0) == refit_rows(results, track, regime, 0)
    others_moved = {"rows": [{**r, "avg_norm_acc": 0.9} if r["merge"] == "ties" else r
                             for r in reversed(results["rows"])] + [row("tsv_m", "tsv_m", 1.0)]}
    assert json.dumps(task_arithmetic_rows(others_moved)) == json.dumps(reduced)
    ta_moved = {"rows": [{**r, "selected_scaling": 0.3} if r["label"] == "task_arithmetic" else r
                         for r in results["rows"]]}
    assert task_arithmetic_rows(ta_moved) != reduced
