"""Issue #13, hardening: outputs that would destroy inputs, failed or interrupted writes, raw errors, merges
that silently do nothing, and recipes from the command line. Each bad input gets one line naming what is
wrong; nothing the tool did not write is ever deleted."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from mergecal import MERGE_METHODS, merge_checkpoints, merge_models, save_checkpoint
from mergecal.calibrations.registry import all_calibrations
from mergecal.checkpoint import MARKER, SafetensorsSource, ShardedCheckpointWriter, load_state_dict, save_state_dict
from mergecal.cli import main
from mergecal.errors import CheckpointError, OutputError, ParameterError
from mergecal.methods import get_merge_method
from mergecal.methods.ties import TiesCore, trim
from mergecal.recipe import Recipe, step_phase
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
    """Hugging Face's cache layout: a snapshot folder of links to an index and shards that lie in one other
    folder (blobs/). It is read (the shards are beside the index the link points to), and the output may not
    be the folder that holds them."""
    shards = save_checkpoint(pretrained, tmp_path / "shards", max_shard_bytes=700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for file in shards.iterdir():
        (elsewhere / file.name).symlink_to(Path("..") / "shards" / file.name)
    assert SafetensorsSource(elsewhere).keys() == list(pretrained)
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


# A merge that sends itself the signal at one stage of its output's life (argv: stage, signal name): the signal
# arrives at that point every time, not when a timer happens to fire (#55).
STAGED_CLI = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see SLOW_CLI)
stage, sig = sys.argv[1], signal.Signals[sys.argv[2]]
from mergecal import checkpoint, outputs

def hook(owner, name, when="after", only=lambda *args: True):
    original = getattr(owner, name)
    def hooked(*args, **kwargs):
        if when == "before" and only(*args):
            signal.raise_signal(sig)
        result = original(*args, **kwargs)
        if when == "after" and only(*args):
            signal.raise_signal(sig)
        return result
    setattr(owner, name, hooked)

{"lock": lambda: hook(outputs, "_lock"),  # the lock taken, nothing else yet
 "leftovers": lambda: hook(outputs, "_remove_leftovers"),
 "staging": lambda: hook(os, "mkdir", only=lambda path, *rest: str(path).endswith(".staging")),
 "opened": lambda: hook(outputs.OutputDir, "__init__"),  # OutputDir() returned, the writer not yet entered
 "writing": lambda: hook(checkpoint.ShardedCheckpointWriter, "add"),
 "finishing": lambda: hook(checkpoint.ShardedCheckpointWriter, "finish"),
 "swapping": lambda: hook(outputs.OutputDir, "_swap", when="before"),
 "committed": lambda: hook(outputs.OutputDir, "commit"),
}[stage]()
from mergecal.cli import main
sys.exit(main(sys.argv[3:]))
"""
STAGES = ("lock", "leftovers", "staging", "opened", "writing", "finishing", "swapping", "committed")


def test_a_signal_at_every_stage_of_an_output_leaves_nothing_behind(inputs_dir, tmp_path):
    """SIGINT and SIGTERM at each stage of an output's life (lock, clean-up, staging made, writer opened, tensors
    written, shards finished, the swap, after the commit): one line, exit 128 + signal, no staging or lock left,
    and the output either absent or whole (a signal during the swap is delivered after it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cases = [(stage, sig) for stage in STAGES for sig in (signal.SIGINT, signal.SIGTERM)]
    failures = []
    for batch in range(0, len(cases), 4):  # four at a time: each process spends its time importing torch
        running = []
        for stage, sig in cases[batch:batch + 4]:
            work = tmp_path / f"{stage}-{sig.name}"
            work.mkdir()
            args = [sys.executable, "-c", STAGED_CLI, stage, sig.name, *merge_args(inputs_dir, work / "out")]
            running.append((stage, sig, work, subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)))
        for stage, sig, work, proc in running:
            _, err = proc.communicate(timeout=120)
            out = work / "out"
            whole = stage in ("swapping", "committed")
            last = err.strip().splitlines()[-1:]  # a progress bar may come before it
            if (proc.returncode != 128 + sig or last != [f"mergecal: error: interrupted by {sig.name}"]
                    or "Traceback" in err or leftovers(work) != [] or out.exists() != whole
                    or whole and not SafetensorsSource(out).keys()):
                failures.append(f"{stage} {sig.name}: rc {proc.returncode}, left {leftovers(work)}, "
                                f"output {'present' if out.exists() else 'absent'}, stderr {err.strip()[-300:]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_signals_at_random_moments_under_cpu_load_leave_nothing_behind(inputs_dir, tmp_path):
    """The kill repeated at random moments of a slow merge's write (from its staging directory's creation to past
    its commit) while two processes keep both cores busy: every run ends with no staging or lock left and the
    output absent or whole."""
    import random

    rng = random.Random(55)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    codes = []
    try:
        for run in range(8):
            work = tmp_path / f"run{run}"
            work.mkdir()
            sig = (signal.SIGINT, signal.SIGTERM)[run % 2]
            proc = start_slow_merge(merge_args(inputs_dir, work / "out"), work)
            time.sleep(rng.uniform(0.0, 6.0))  # the writes take 0.5 s a tensor, nine tensors
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=300)
            out = work / "out"
            assert proc.returncode in (0, 128 + sig, -sig), err  # -sig: after main() gave the signal back
            assert leftovers(work) == [], (run, sig.name, proc.returncode, err)
            assert not out.exists() or SafetensorsSource(out).keys(), (run, sig.name)
            codes.append(proc.returncode)
    finally:
        for process in load:
            process.kill()
            process.wait()
    assert 128 + signal.SIGINT in codes and 128 + signal.SIGTERM in codes, codes  # some were interrupted


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
    from mergecal.merge_causal_lm import merge_causal_lms

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
    assert main(args[:method] + ["--recipe", "tsv_m>dsc(fsc={task_feature: paper})"] + args[method + 2:]) == 2
    assert ("fsc: parameter 'task_feature': Input should be 'module_replay' or 'network' (got 'paper')"
            in one_line_error(capsys))
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


def schedule_cli(cron: str, api_url: str) -> tuple[str, float]:
    """``mergecal schedule`` in its own process, timed, with PREFECT_API_URL at ``api_url``: Prefect's logging
    and settings, set up on its import, must not outlive this test (in-process, its handlers kept pytest's closed
    capture stream and failed every later flow test with "I/O operation on closed file")."""
    env = {**os.environ, "PREFECT_API_URL": api_url}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mergecal.cli", "schedule", "--root", str(ROOT), "--cron", cron],
                          capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("mergecal: error: ") == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr[done.stderr.index("mergecal: error: "):].rstrip()
    assert "\n" not in line, done.stderr
    return line, elapsed


def test_schedule_with_a_bad_cron_is_one_line():
    """Regression: pydantic's ValidationError from Prefect's CronSchedule was a traceback."""
    line, _ = schedule_cli("not a cron", f"http://127.0.0.1:{_closed_port()}/api")
    assert line == ("mergecal: error: --cron 'not a cron': not a cron schedule; expected five "
                    'fields, minute hour day-of-month month day-of-week, e.g. "0 3 * * 1" '
                    "(Mondays at 03:00)")


def test_schedule_without_a_prefect_server_is_one_line_and_fast():
    """Regression: with no server at PREFECT_API_URL, serving raised httpx.ConnectError from deep inside Prefect."""
    url = f"http://127.0.0.1:{_closed_port()}/api"
    line, elapsed = schedule_cli("0 3 * * 1", url)
    # the process's whole life, Prefect's import included (about 8 s on the 2-core machine): one refused
    # connection, not a client retrying with back-off
    assert elapsed < 60
    assert line.startswith(f"mergecal: error: schedule: no Prefect server answers at PREFECT_API_URL={url} (")
    assert "`mergecal ui`" in line and "prefect server start --host 127.0.0.1" in line


# --- 10. hardening, second round: what an input may name, special files, permissions, stale files, sizes, ENOSPC ---


def sharded_with(tmp_path: Path, model: dict, entry: str) -> Path:
    """models/pre/: a sharded checkpoint of ``model`` whose index names ``entry`` for its first key."""
    pre = save_checkpoint(model, tmp_path / "models" / "pre", max_shard_bytes=700)
    index_path = pre / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = entry
    index_path.write_text(json.dumps(index))
    return index_path


def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, pretrained, finetuned, capsys):
    outside = save_state_dict(pretrained, tmp_path / "x.safetensors")  # a valid file: today it is merged
    ft = save_state_dict(finetuned[0], tmp_path / "ft.safetensors")
    for entry in ("../../x.safetensors", str(outside), "link.safetensors", "../../../../../../../../etc/passwd"):
        index = sharded_with(tmp_path, pretrained, entry)
        if entry == "link.safetensors":  # inside by its name, outside once the link is followed
            (index.parent / entry).symlink_to(outside)
        key = next(iter(json.loads(index.read_text())["weight_map"]))
        out = tmp_path / "out"
        assert main(["merge", "--pretrained", str(index.parent), "--finetuned", str(ft), "--method", "ties",
                     "--out", str(out)]) == 2, entry
        err = one_line_error(capsys)
        assert f"{index}: shard {entry!r} for key {key!r} is not a file inside the index's folder" in err
        assert not out.exists()


TINY_LLAMA = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32}


def test_a_model_directory_whose_index_names_a_shard_outside_it_is_refused(tmp_path):
    """The LLM loaders read index files themselves (pickled shards) or through transformers (safetensors)."""
    from mergecal.backbones.hf_causal_lm import causal_lm_state_dict, load_causal_lm

    torch.save({"a": torch.ones(2)}, tmp_path / "x.bin")
    save_state_dict({"a": torch.ones(2)}, tmp_path / "x.safetensors")
    for index_name, entry in [("pytorch_model.bin.index.json", "../../x.bin"),
                              ("model.safetensors.index.json", "../../x.safetensors")]:
        model = tmp_path / "models" / index_name.split(".")[0]
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))  # load_causal_lm builds it before the weights
        (model / index_name).write_text(json.dumps({"weight_map": {"a": entry}}))
        expected = f"shard {entry!r} for key 'a' is not a file inside the index's folder"
        with pytest.raises(CheckpointError, match=expected):
            causal_lm_state_dict(model, allow_unsafe_pickle=True)
        with pytest.raises(CheckpointError, match=expected):
            load_causal_lm(model, allow_unsafe_pickle=True)


@contextmanager
def writer_after(fifo: Path, seconds: float = 5.0):
    """A reader that opens ``fifo`` waits for a writer forever: after ``seconds`` writers come and go, so that code
    which opens it (a failing test) ends instead of hanging the suite. A process, not a thread: safetensors holds
    the GIL while it waits in open()."""
    writers = subprocess.Popen(["sh", "-c", 'sleep "$1"; while :; do exec 3>"$0"; exec 3>&-; done',
                                str(fifo), str(seconds)])
    try:
        yield
    finally:
        writers.kill()
        writers.wait()


def test_a_fifo_or_socket_is_refused_before_it_is_opened(tmp_path, pretrained, capsys):
    from mergecal.backbones.loading import load_weights_file

    ft = save_state_dict(pretrained, tmp_path / "ft.safetensors")
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    in_dir = tmp_path / "dir"
    in_dir.mkdir()
    os.mkfifo(in_dir / "model.safetensors")
    index = sharded_with(tmp_path, pretrained, "pipe.safetensors")
    os.mkfifo(index.parent / "pipe.safetensors")
    os.mkfifo(tmp_path / "pipe.pt")
    cases = [(fifo, fifo), (in_dir, in_dir / "model.safetensors"), (index, index.parent / "pipe.safetensors")]
    for given, named in cases:
        start = time.monotonic()
        with writer_after(named):
            rc = main(["merge", "--pretrained", str(given), "--finetuned", str(ft), "--method", "ties",
                       "--out", str(tmp_path / "out")])
        assert rc == 2 and time.monotonic() - start < 4.5, given  # refused, not released by the writers
        assert f"{named}: is a FIFO (named pipe); a checkpoint must be a regular file" in one_line_error(capsys)
    with writer_after(tmp_path / "pipe.pt"), pytest.raises(CheckpointError, match="pipe.pt: is a FIFO"):
        load_weights_file(tmp_path / "pipe.pt", allow_unsafe_pickle=True)
    sock_path = tmp_path / "sock.safetensors"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(CheckpointError, match=f"{sock_path}: is a socket"):
            SafetensorsSource(sock_path)
    assert not (tmp_path / "out").exists()


@contextmanager
def as_another_user():
    """The tests run as root, who may read any file: drop to 'nobody' (effective IDs, restored after) so that
    the kernel refuses a file of mode 000 as it does for a user; a non-root user is refused as it is."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_an_unreadable_input_says_permission_denied(pretrained, finetuned, capsys):
    d = Path(tempfile.mkdtemp())  # not under pytest's tmp_path, whose parents only their owner may enter
    hidden = d / "hidden"
    try:
        d.chmod(0o755)
        pre = save_state_dict(pretrained, d / "pre.safetensors")
        ft = save_state_dict(finetuned[0], d / "ft.safetensors")
        pre.chmod(0o000)
        hidden.mkdir(mode=0o700)
        save_state_dict(pretrained, hidden / "model.safetensors").chmod(0o000)
        hidden.chmod(0o000)
        with as_another_user():
            rc = main(["merge", "--pretrained", str(pre), "--finetuned", str(ft), "--method", "ties",
                       "--out", str(d / "out")])
            with pytest.raises(CheckpointError, match="permission denied") as in_hidden:
                SafetensorsSource(hidden / "model.safetensors")
        assert rc == 2
        err = one_line_error(capsys)
        assert f"{pre}: permission denied (the file is not readable by this user)" in err
        assert "No such file" not in err and "No such file" not in str(in_hidden.value)
        assert not (d / "out").exists()
    finally:
        if hidden.exists():
            hidden.chmod(0o700)
        shutil.rmtree(d)


def test_stale_staging_and_lock_files_go_at_the_start_of_any_merge_to_the_output(inputs_dir, tmp_path, capsys):
    done = subprocess.Popen(["true"])
    done.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        dead = tmp_path / f".out.{done.pid}-0123abcd.staging"  # as a merge killed by SIGKILL leaves it
        dead.mkdir()
        (dead / "shard-00000.safetensors").write_bytes(b"partial")
        (tmp_path / ".out.lock").touch()  # and the lock file it held
        alive = tmp_path / f".out.{running.pid}-fedcba98.staging"
        alive.mkdir()
        # a merge that then fails on its parameters cleans up all the same
        assert main(merge_args(inputs_dir, tmp_path / "out", "--set", "top_k=7")) == 2
        assert "top_k" in one_line_error(capsys)
        assert leftovers(tmp_path) == [alive.name]  # a running process's entry is kept
        assert main(merge_args(inputs_dir, tmp_path / "out")) == 0
        assert leftovers(tmp_path) == [alive.name] and SafetensorsSource(tmp_path / "out").keys()
    finally:
        running.kill()
        running.wait()


@pytest.mark.parametrize("size", ["infGB", "nan", "-1GB", "0", "0.5b", "1e400"])
def test_max_shard_size_must_be_a_positive_finite_size(inputs_dir, tmp_path, capsys, size):
    assert main(merge_args(inputs_dir, tmp_path / "out", f"--max-shard-size={size}")) == 2
    assert f"--max-shard-size {size!r}: expected a positive, finite size such as 2GB" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def no_space_left(tensors, filename, metadata=None):
    """safetensors' save_file on a full disk: part of the file written, then its serialisation error."""
    Path(filename).write_bytes(b"\0" * 64)
    raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path '
                          f'"{filename}"')


def copy_until_full(src, dst, offset, count):
    """The shard writer's copy on a full disk: part of the shard written, then the kernel's ENOSPC."""
    os.write(dst, b"\0" * 64)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_one_line_and_leaves_nothing(inputs_dir, tmp_path, capsys, monkeypatch, pretrained):
    from mergecal import checkpoint

    monkeypatch.setattr(checkpoint, "save_file", no_space_left)
    monkeypatch.setattr(checkpoint, "_copy_range", copy_until_full)
    out = tmp_path / "out"
    assert main(merge_args(inputs_dir, out, "--max-shard-size", "600")) == 2
    assert one_line_error(capsys) == f"mergecal: error: {out}: cannot write the output (No space left on device)"
    assert not out.exists() and leftovers(tmp_path) == []
    with pytest.raises(OutputError, match=r"single.safetensors: cannot write the output \(No space left on device\)"):
        save_state_dict(pretrained, tmp_path / "single.safetensors")
    assert not (tmp_path / "single.safetensors").exists() and leftovers(tmp_path) == []


def test_iso_cts_with_no_common_direction_merges_from_the_cli(inputs_dir, tmp_path, capsys):
    args = merge_args(inputs_dir, tmp_path / "out", "--set", "common_space_fraction=0")
    args[args.index("--method") + 1] = "iso_cts"
    assert main(args) == 0  # K = 2 and an even rank: no common direction (k_c = 0) on such keys
    assert SafetensorsSource(tmp_path / "out").keys()


# --- 11. zero-size keys: passed through unchanged by every merge and every data-free calibration ---------------


def with_empty_key(model: dict) -> dict:
    return {**model, "visual.empty.weight": torch.zeros(0, 6, dtype=torch.float16)}


DATA_FREE = sorted(n for n, spec in all_calibrations().items() if not spec.needs_data)


@pytest.mark.parametrize("calibration", [None, *DATA_FREE])
@pytest.mark.parametrize("method", sorted(n for n, cls in MERGE_METHODS.items() if not cls.needs_data))
def test_a_zero_size_key_passes_through_every_merge_and_calibration(pretrained, finetuned, method, calibration):
    assert DATA_FREE == ["rescale", "svc", "wsc"]  # the registry's data-free steps (a new one joins by itself)
    models = [with_empty_key(m) for m in finetuned]
    if calibration is None:
        merged = merge_models(with_empty_key(pretrained), models, method)
        expected = merge_models(pretrained, finetuned, method)
    else:  # a pre-merge step (rescale) before the merge, the others after it
        recipe = f"{calibration}>{method}" if step_phase(calibration) == "pre" else f"{method}>{calibration}"
        merged = run_recipe(recipe, with_empty_key(pretrained), models).state_dict
        expected = run_recipe(recipe, pretrained, finetuned).state_dict
    empty = merged.pop("visual.empty.weight")
    assert empty.shape == (0, 6) and empty.dtype == torch.float16
    assert merged.keys() == expected.keys()
    for key, value in expected.items():  # and the other keys are merged as without it
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("text", ["tsv_m>svc", "task_arithmetic>wsc"])
def test_a_zero_size_key_through_the_cli(tmp_path, pretrained, finetuned, text):
    pre = save_state_dict(with_empty_key(pretrained), tmp_path / "pre.safetensors")
    fts = [save_state_dict(with_empty_key(m), tmp_path / f"ft{i}.safetensors") for i, m in enumerate(finetuned)]
    out = tmp_path / "out"
    assert main(["merge", "--pretrained", str(pre), "--finetuned", *map(str, fts), "--recipe", text,
                 "--out", str(out)]) == 0
    merged = load_state_dict(out)
    assert merged["visual.empty.weight"].shape == (0, 6) and merged["visual.empty.weight"].dtype == torch.float16
    expected = run_recipe(text, pretrained, finetuned).state_dict
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
