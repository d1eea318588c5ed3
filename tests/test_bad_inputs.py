"""Issue #13, hardening: outputs that would destroy inputs, failed or interrupted writes, raw errors, merges
that silently do nothing, and recipes from the command line. Each bad input gets one line naming what is
wrong; nothing the tool did not write is ever deleted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mergecal import merge_checkpoints, merge_models, save_checkpoint
from mergecal.checkpoint import MARKER, SafetensorsSource, ShardedCheckpointWriter, load_state_dict, save_state_dict
from mergecal.cli import main
from mergecal.errors import CheckpointError, OutputError, ParameterError
from mergecal.methods import get_merge_method
from mergecal.methods.ties import TiesCore, trim
from mergecal.recipe import Recipe
from mergecal.run_recipe import run_recipe
from mergecal.task_vectors import TaskVectorSet

ROOT = Path(__file__).resolve().parents[1]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("mergecal: error: ") == 1, err
    line = err[err.index("mergecal: error: "):].rstrip()  # a progress bar may come before it
    assert "\n" not in line and "Traceback" not in err, err
    return line


def leftovers(directory: Path) -> list[str]:
    """Hidden staging, trash and lock entries beside outputs (none may outlive a run)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def inputs_dir(tmp_path, pretrained, finetuned):
    """d/ holds the inputs and an unrelated file, as in the issue."""
    d = tmp_path / "d"
    save_state_dict(pretrained, d / "pre.safetensors")
    for i, ft in enumerate(finetuned[:2]):
        save_state_dict(ft, d / f"ft{i}.safetensors")
    (d / "NOTES.txt").write_text("mine\n")
    return d


def merge_args(d: Path, out: Path, *extra: str) -> list[str]:
    return ["merge", "--pretrained", str(d / "pre.safetensors"), "--finetuned", str(d / "ft0.safetensors"),
            str(d / "ft1.safetensors"), "--method", "ties", "--out", str(out), *extra]


# --- 1. an output never deletes what the tool did not write ---------------------------------------------


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_containing_the_inputs_is_refused_and_nothing_is_deleted(inputs_dir, capsys, overwrite):
    before = snapshot(inputs_dir)
    assert main(merge_args(inputs_dir, inputs_dir, *overwrite)) == 2
    err = one_line_error(capsys)
    assert f"{inputs_dir}: the output directory contains the input" in err
    assert snapshot(inputs_dir) == before and leftovers(inputs_dir.parent) == []
    assert main(merge_args(inputs_dir, inputs_dir.parent, *overwrite)) == 2  # an ancestor of the inputs
    assert "contains the input" in one_line_error(capsys) and snapshot(inputs_dir) == before


def test_out_equal_to_an_input_file_is_refused(inputs_dir, capsys):
    before = snapshot(inputs_dir)
    assert main(merge_args(inputs_dir, inputs_dir / "ft1.safetensors", "--overwrite")) == 2
    assert "must not be one of the input checkpoints" in one_line_error(capsys)
    assert snapshot(inputs_dir) == before


def test_sharded_index_input_with_out_its_parent_is_refused(tmp_path, pretrained, finetuned, capsys):
    pre = save_checkpoint(pretrained, tmp_path / "pre", max_shard_bytes=700)
    index = pre / "model.safetensors.index.json"
    ft = save_state_dict(finetuned[0], tmp_path / "ft.safetensors")
    before = snapshot(pre)
    rc = main(["merge", "--pretrained", str(index), "--finetuned", str(ft), "--method", "ties", "--out", str(pre),
               "--overwrite"])
    assert rc == 2 and "contains the input" in one_line_error(capsys) and snapshot(pre) == before


def test_shards_reached_through_an_index_elsewhere_are_inputs_too(tmp_path, pretrained, finetuned):
    shards = save_checkpoint(pretrained, tmp_path / "shards", max_shard_bytes=700)
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    index["weight_map"] = {k: f"../shards/{v}" for k, v in index["weight_map"].items()}
    (elsewhere / "model.safetensors.index.json").write_text(json.dumps(index))
    ft = save_state_dict(finetuned[0], tmp_path / "ft.safetensors")
    with pytest.raises(OutputError, match="contains the input"):
        merge_checkpoints(elsewhere, [ft], "ties", shards, overwrite=True)
    assert len(list(shards.glob("model-*.safetensors"))) > 1


def test_inputs_reached_through_symlinks_are_protected(inputs_dir, tmp_path, capsys):
    links = tmp_path / "links"
    links.mkdir()
    for name in ("pre.safetensors", "ft0.safetensors", "ft1.safetensors"):
        (links / name).symlink_to(inputs_dir / name)
    before = snapshot(inputs_dir)
    assert main(merge_args(links, inputs_dir, "--overwrite")) == 2  # the links point into the output
    assert "contains the input" in one_line_error(capsys) and snapshot(inputs_dir) == before
    alias = tmp_path / "alias"
    alias.symlink_to(inputs_dir)
    assert main(merge_args(alias, inputs_dir, "--overwrite")) == 2  # the output reached through a link
    assert "contains the input" in one_line_error(capsys) and snapshot(inputs_dir) == before


def test_an_unrelated_directory_is_kept_unless_overwrite(inputs_dir, tmp_path, capsys):
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "keep.txt").write_text("keep")
    assert main(merge_args(inputs_dir, other)) == 2
    err = one_line_error(capsys)
    assert f"{other}: exists and holds files mergecal did not write (no {MARKER})" in err and "--overwrite" in err
    assert (other / "sub" / "keep.txt").read_text() == "keep" and leftovers(tmp_path) == []
    assert main(merge_args(inputs_dir, other, "--overwrite")) == 0
    assert sorted(p.name for p in other.iterdir()) == [MARKER, "model.safetensors"] and leftovers(tmp_path) == []


def test_an_existing_file_at_out_is_kept_unless_overwrite(inputs_dir, tmp_path, capsys):
    target = tmp_path / "result"
    target.write_text("a file")
    assert main(merge_args(inputs_dir, target)) == 2
    assert "exists and is a file" in one_line_error(capsys) and target.read_text() == "a file"
    assert main(merge_args(inputs_dir, target, "--overwrite")) == 0 and (target / "model.safetensors").exists()


def test_a_rerun_replaces_its_own_output_and_an_empty_directory_is_used(inputs_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(merge_args(inputs_dir, out)) == 0
    assert (out / MARKER).exists()
    assert main(merge_args(inputs_dir, out, "--set", "top_k=0.5")) == 0  # no --overwrite needed
    assert "top_k=0.5" in SafetensorsSource(out).metadata()["mergecal_method"]
    assert leftovers(tmp_path) == []


def test_every_directory_writer_refuses_an_unrelated_directory(tmp_path, pretrained):
    from mergecal.backbones.hf_causal_lm import save_causal_lm_weights

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    with pytest.raises(OutputError, match="did not write"):
        save_checkpoint(pretrained, other)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_state_dict({"a": torch.ones(2)}, base / "model.safetensors")
    with pytest.raises(OutputError, match="did not write"):
        save_causal_lm_weights({"a": torch.ones(2)}, other, like=base)
    with pytest.raises(OutputError, match="must not be one of the input checkpoints"):
        save_causal_lm_weights({"a": torch.ones(2)}, base, like=base, overwrite=True)
    assert (other / "keep.txt").read_text() == "keep" and (base / "config.json").exists()
    assert leftovers(tmp_path) == []


# --- 3. failed and interrupted writes leave nothing behind ------------------------------------------------


def test_out_dot_is_refused_in_one_line(inputs_dir, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(merge_args(inputs_dir, Path("."), "--overwrite")) == 2
    assert "is the current directory" in one_line_error(capsys) and list(empty.iterdir()) == []
    monkeypatch.chdir(inputs_dir)
    assert main(merge_args(inputs_dir, Path("."))) == 2
    assert "contains the input" in one_line_error(capsys)


def test_os_errors_are_one_line(inputs_dir, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory is needed")
    assert main(merge_args(inputs_dir, blocker / "out")) == 2
    err = one_line_error(capsys)
    assert f"{blocker / 'out'}: cannot write the output ({blocker} is a file, not a directory)" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_parent_is_one_line(inputs_dir, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert main(merge_args(inputs_dir, parent / "out")) == 2
        assert "Permission denied" in one_line_error(capsys) and list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_a_failed_commit_keeps_the_previous_output_and_removes_staging(inputs_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(merge_args(inputs_dir, out)) == 0
    before = snapshot(out)
    real_rename = os.rename

    def refuse_into_place(src, dst):  # an output the user cannot move (EBUSY for a mount point, EPERM)
        if Path(src) == out:
            raise PermissionError(1, "Operation not permitted", str(src), None, str(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_into_place)
    assert main(merge_args(inputs_dir, out, "--set", "top_k=0.5")) == 2
    err = one_line_error(capsys)
    assert f"{out}: cannot replace the output (Operation not permitted)" in err
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_output_directory_and_files_follow_the_umask(inputs_dir, tmp_path):
    old = os.umask(0o027)
    try:
        assert main(merge_args(inputs_dir, tmp_path / "out")) == 0
        save_state_dict({"a": torch.ones(1)}, tmp_path / "single.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "single.safetensors").stat().st_mode & 0o777 == 0o640


def test_a_second_writer_to_the_same_output_fails_clearly(tmp_path, pretrained):
    out = tmp_path / "out"
    with ShardedCheckpointWriter(out) as first:
        first.add("a", torch.ones(2))
        with pytest.raises(OutputError, match=f"{out}: another process is writing this output"):
            save_checkpoint(pretrained, out)
    assert load_state_dict(out).keys() == {"a"} and leftovers(tmp_path) == []
    save_checkpoint(pretrained, out)  # the lock is free again
    assert leftovers(tmp_path) == []


def test_an_output_swapped_out_by_a_killed_commit_is_put_back(tmp_path, pretrained):
    out = tmp_path / "out"
    save_checkpoint(pretrained, out)
    before = snapshot(out)
    out.rename(tmp_path / ".out.99999-0123abcd.old")  # killed between the two renames of a commit

    def failing():
        yield "a", torch.ones(2)
        raise RuntimeError("the next write fails too")

    with pytest.raises(RuntimeError):
        save_checkpoint(failing(), out)
    assert snapshot(out) == before and leftovers(tmp_path) == []


SLOW_CLI = """
import signal, sys, time
# as from a terminal: a process started in the background by a shell without job control inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from mergecal import checkpoint
add = checkpoint.ShardedCheckpointWriter.add
def slow_add(self, key, tensor):
    time.sleep(0.5)
    add(self, key, tensor)
checkpoint.ShardedCheckpointWriter.add = slow_add
from mergecal.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_slow_merge(args: list[str], watch: Path) -> subprocess.Popen:
    """Run the CLI with a slow writer; return once its staging directory exists."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *args], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".staging") for p in watch.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_removes_staging_and_is_one_line(inputs_dir, tmp_path, sig):
    out = tmp_path / "out"
    proc = start_slow_merge(merge_args(inputs_dir, out), tmp_path)
    proc.send_signal(sig)
    err = proc.stderr.read().strip()
    assert proc.wait(60) == 128 + sig, err
    assert err == f"mergecal: error: interrupted by {sig.name}"
    assert not out.exists() and leftovers(tmp_path) == []


def test_staging_left_by_a_killed_run_is_removed_by_the_next_run(inputs_dir, tmp_path, capsys):
    out = tmp_path / "out"
    proc = start_slow_merge(merge_args(inputs_dir, out), tmp_path)
    proc.kill()
    proc.wait(60)
    assert any(name.endswith(".staging") for name in leftovers(tmp_path))  # SIGKILL runs no cleanup
    assert main(merge_args(inputs_dir, out)) == 0
    assert leftovers(tmp_path) == [] and SafetensorsSource(out).keys()


# --- 5. one line instead of raw errors and misleading advice -----------------------------------------------


def test_unknown_device_is_one_line(inputs_dir, tmp_path, capsys):
    assert main(merge_args(inputs_dir, tmp_path / "out", "--device", "tpu")) == 2
    assert "device='tpu': expected auto, cpu, cuda or cuda:N" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_index_with_a_list_weight_map_is_one_line(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to shard files, got list"):
        SafetensorsSource(index)
    index.write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to shard files"):
        SafetensorsSource(index)


def test_ui_port_out_of_range_is_one_line(tmp_path, capsys):
    assert main(["ui", "--root", str(tmp_path), "--mlflow-port", "70000"]) == 2
    assert "--mlflow-port 70000: expected a port number from 1 to 65535" in one_line_error(capsys)


def test_random_and_truncated_pt_files_are_not_called_pickles(tmp_path):
    from mergecal.backbones.loading import load_weights_file

    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(range(256)) * 4)
    good = tmp_path / "good.pt"
    torch.save({"a": torch.ones(1000)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:600])
    for path in (noise, truncated):
        for unsafe in (False, True):
            with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint") as err:
                load_weights_file(path, allow_unsafe_pickle=unsafe)
            assert str(path) in str(err.value) and "allow_unsafe_pickle" not in str(err.value)
    module = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), module)
    with pytest.raises(CheckpointError, match="allow_unsafe_pickle=True"):
        load_weights_file(module)


def test_merge_causal_lms_does_not_recommend_an_opt_in_it_lacks(tmp_path):
    from mergecal.backbones.hf_causal_lm import merge_causal_lms

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save({"a": torch.ones(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="merge_causal_lms reads safetensors only") as err:
        merge_causal_lms(pickled, [pickled], "task_arithmetic", tmp_path / "out")
    assert "pass allow_unsafe_pickle" not in str(err.value) and "save_causal_lm" in str(err.value)


def test_hf_text_encoder_never_unpickles(tmp_path):
    from mergecal.backbones.hf_text import load_encoder, minilm_path

    pickled = tmp_path / "encoder"
    pickled.mkdir()
    (pickled / "config.json").write_text((minilm_path() / "config.json").read_text())
    torch.save(torch.nn.Linear(2, 2), pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no .safetensors weights"):
        load_encoder(pickled)


def test_cli_pickle_input_says_how_to_convert(inputs_dir, tmp_path, capsys, pretrained):
    torch.save(pretrained, tmp_path / "pre.pt")
    args = merge_args(inputs_dir, tmp_path / "out")
    args[args.index("--pretrained") + 1] = str(tmp_path / "pre.pt")
    assert main(args) == 2
    err = one_line_error(capsys)
    assert "pickled checkpoints are not read" in err and "torch.load" in err and "weights_only=True" in err
    assert "save_file" in err
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert "safetensors only" in " ".join(capsys.readouterr().out.split())


def test_a_single_path_as_finetuned_is_rejected(inputs_dir, tmp_path):
    for single in (str(inputs_dir / "ft0.safetensors"), inputs_dir / "ft0.safetensors"):
        with pytest.raises(ParameterError, match="finetuned: expected a list of models, got a single path"):
            merge_checkpoints(inputs_dir / "pre.safetensors", single, "ties", tmp_path / "out")
    with pytest.raises(ParameterError, match="finetuned: expected a list of models, got a single state dict"):
        merge_models({"a": torch.ones(2)}, {"a": torch.ones(2)}, "ties")
    assert not (tmp_path / "out").exists()


# --- 6. merges that silently do nothing; what each method does with K = 1 -------------------------------------


def test_consensus_min_agreement_above_k_is_rejected(inputs_dir, tmp_path, capsys, pretrained, finetuned):
    assert main(merge_args(inputs_dir, tmp_path / "out")[:-3] + ["consensus", "--set", "min_agreement=3",
                                                                 "--out", str(tmp_path / "out")]) == 2
    assert ("consensus: parameter 'min_agreement'=3 exceeds the number of models K=2"
            in one_line_error(capsys))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    with pytest.raises(ParameterError, match="'min_agreement'=2 exceeds the number of models K=1"):
        merge_models(pretrained, finetuned[:1], "consensus")


def k1_expected(method: str, tau: dict[str, torch.Tensor], **params) -> dict[str, torch.Tensor]:
    """What each method does with one task vector (stated in its docstring)."""
    m = get_merge_method(method, **params)
    s = m.params.scaling
    if method in ("task_arithmetic", "weight_averaging", "consensus", "tsv_m"):
        return {k: s * v for k, v in tau.items()}  # the task vector itself, scaled
    if method == "ties":  # the trimmed task vector: no sign conflict with one model
        tvs = TaskVectorSet.from_task_vectors([tau])
        core = TiesCore(m.params, "ties")
        core.fit(tvs, tvs.keys)
        return {k: s * trim([v], core._thresholds)[0] for k, v in tau.items()}
    if method == "dare":  # the dropped and rescaled task vector
        return {k: s * m.drop(k, [v])[0] for k, v in tau.items()}
    # iso_c and iso_cts: the flat spectrum of tau on matrices (their rule), tau elsewhere
    out = {}
    for k, v in tau.items():
        if m._rule.matches(k, v.shape, v.dtype):
            U, S, Vh = torch.linalg.svd(v, full_matrices=False)
            out[k] = s * (U * S.mean()) @ Vh
        else:
            out[k] = s * v
    return out


@pytest.mark.parametrize("method,params", [
    ("task_arithmetic", {}), ("weight_averaging", {}), ("ties", {}), ("dare", {}), ("consensus", {"min_agreement": 1}),
    ("tsv_m", {}), ("iso_c", {}), ("iso_cts", {}),
])
def test_each_method_with_one_model(pretrained, finetuned, method, params):
    tau = {k: finetuned[0][k] - v for k, v in pretrained.items() if v.is_floating_point()}
    merged = merge_models(pretrained, finetuned[:1], method, **params)
    expected = k1_expected(method, tau, **params)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key] - pretrained[key], value, rtol=1e-4, atol=1e-5, msg=key)
    if method == "ties":
        assert any(bool((expected[k] == 0).any()) and bool((tau[k] != 0).all()) for k in tau)  # trimming did work


# --- 9. data-free recipes from the command line ------------------------------------------------------------------


@pytest.mark.parametrize("text", ["tsv_m>svc", "ties(top_k=0.5)>wsc", "task_arithmetic->svc(alpha=1.0)->wsc"])
def test_cli_recipe_equals_the_api(inputs_dir, tmp_path, capsys, pretrained, finetuned, text):
    out = tmp_path / "out"
    assert main(["merge", "--pretrained", str(inputs_dir / "pre.safetensors"), "--finetuned",
                 str(inputs_dir / "ft0.safetensors"), str(inputs_dir / "ft1.safetensors"), "--recipe", text,
                 "--out", str(out), "--max-shard-size", "600"]) == 0
    expected = run_recipe(text, pretrained, finetuned[:2]).state_dict
    merged = load_state_dict(out)
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
    assert SafetensorsSource(out).metadata()["mergecal_recipe"] == Recipe.parse(text).id
    assert (out / MARKER).exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("text,named", [("tsv_m>dsc", "fsc"), ("distac>tsv_m>svc", "distac"), ("ties>fsc", "fsc")])
def test_cli_recipe_steps_that_need_data_are_one_line(inputs_dir, tmp_path, capsys, text, named):
    args = merge_args(inputs_dir, tmp_path / "out")
    args[args.index("--method"):args.index("--method") + 2] = ["--recipe", text]
    assert main(args) == 2
    err = one_line_error(capsys)
    assert f"step {named!r} needs models and data" in err and "mergecal.run_recipe" in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_cli_recipe_errors_match_the_api(inputs_dir, tmp_path, capsys):
    args = merge_args(inputs_dir, tmp_path / "out")
    method = args.index("--method")
    assert main(args[:method] + ["--method", "tsv_m>svc"] + args[method + 2:]) == 2
    assert "unknown merge method 'tsv_m>svc'" in (err := one_line_error(capsys)) and "--recipe" in err
    assert main(args[:method] + ["--recipe", "tsv_m>svc(nope=1)"] + args[method + 2:]) == 2
    assert "svc: unknown parameter 'nope'" in one_line_error(capsys)
    assert main(args[:method] + ["--recipe", "tsv_m>svc", "--set", "scaling=1"] + args[method + 2:]) == 2
    assert "--set: give a recipe's parameters inside it" in one_line_error(capsys)
    assert main(args[:method] + ["--recipe", "svc>tsv_m"] + args[method + 2:]) == 2
    assert "cannot follow" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


# --- hardening, second round: --set values, schedule ------------------------------------------------------


@pytest.mark.parametrize("value, says", [
    ("scaling=[1,", "not a YAML value (expected the node content, but found '<stream end>')"),
    ("top_k=!!python/object/apply:os.system ['touch {ran}']", "not a YAML value (could not determine a constructor "
                                                              "for the tag 'tag:yaml.org,2002:python/object/apply"),
])
def test_a_set_value_that_is_not_yaml_is_one_line(inputs_dir, tmp_path, capsys, value, says):
    """Regression: a YAML parse or constructor error in --set was a traceback; safe_load never runs the tag."""
    value = value.format(ran=tmp_path / "ran")
    assert main(merge_args(inputs_dir, tmp_path / "out", "--set", value)) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"mergecal: error: --set {value!r}: {says}"), err
    assert "expected a number, true/false, a name or a [list]" in err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again on return: nothing listens there


def test_schedule_with_a_bad_cron_is_one_line(capsys, monkeypatch):
    """Regression: pydantic's ValidationError from Prefect's CronSchedule was a traceback."""
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{_closed_port()}/api")
    assert main(["schedule", "--root", str(ROOT), "--cron", "not a cron"]) == 2
    assert one_line_error(capsys) == ("mergecal: error: --cron 'not a cron': not a cron schedule; expected five "
                                      'fields, minute hour day-of-month month day-of-week, e.g. "0 3 * * 1" '
                                      "(Mondays at 03:00)")


def test_schedule_without_a_prefect_server_is_one_line_and_fast(capsys, monkeypatch):
    """Regression: with no server at PREFECT_API_URL, serving raised httpx.ConnectError from deep inside Prefect."""
    url = f"http://127.0.0.1:{_closed_port()}/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    from mergecal.pipeline import schedule  # imported (Prefect's start-up) before the clock starts

    start = time.perf_counter()
    assert main(["schedule", "--root", str(ROOT), "--cron", "0 3 * * 1"]) == 2
    assert time.perf_counter() - start < 10  # one refused connection, no retries
    err = one_line_error(capsys)
    assert err.startswith(f"mergecal: error: schedule: no Prefect server answers at PREFECT_API_URL={url} (")
    assert err.endswith(schedule.START_SERVER) and "`mergecal ui`" in err and "prefect server start" in err
