"""The ``mergecal`` command line."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from .errors import MergecalError, ParameterError


def parse_assignments(pairs: list[str]) -> dict[str, Any]:
    """``["top_k=0.2", "mask_lambda=[0.2, 0.3]"]`` -> typed values (YAML scalars and lists)."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ParameterError(f"--set {pair!r}: expected NAME=VALUE")
        try:
            params[name.strip()] = yaml.safe_load(value)  # safe: a YAML tag never constructs an object
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or "not valid YAML"
            raise ParameterError(f"--set {pair!r}: not a YAML value ({problem}); expected a number, true/false, a "
                                 "name or a [list], e.g. scaling=0.3 or mask_lambda=[0.2, 0.3]") from None
    return params


def parse_size(text: str) -> int:
    """``"2GB"`` -> bytes; a one-line error for anything but a finite size of at least one byte (inf, nan, 0, -1)."""
    units = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            number = lowered[: -len(unit)]
            break
    else:
        number, factor = lowered, 1
    try:
        size = float(number) * factor
    except ValueError:
        size = None
    if size is None or not math.isfinite(size) or size < 1:
        raise ParameterError(f"--max-shard-size {text!r}: expected a positive, finite size such as 2GB or 500MB")
    return int(size)


def cmd_methods(args: argparse.Namespace) -> int:
    from .methods import MERGE_METHODS

    for name, cls in sorted(MERGE_METHODS.items()):
        defaults = ", ".join(f"{field}={info.default!r}" for field, info in cls.Params.model_fields.items())
        print(f"{name:18s} {cls.summary}\n{'':18s} keys: {cls.key_rule}; params: {defaults}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from .merge import merge_checkpoints, parse_dtype
    from .methods import MERGE_METHODS
    from .recipe import ARROW, Recipe

    params = parse_assignments(args.set)
    if args.recipe is not None:
        if params:
            raise ParameterError("--set: give a recipe's parameters inside it, e.g. --recipe \"ties(top_k=0.3)>svc\"")
        method = Recipe.parse(args.recipe)
    elif args.method not in MERGE_METHODS and any(sep in args.method for sep in (">", ARROW)):
        raise ParameterError(f"unknown merge method {args.method!r}; a chain of steps is given with --recipe")
    else:
        method = args.method
    from .adapters import expert_kinds, merge_experts

    if (expert_kinds(args.finetuned) == "full" and args.as_lora is None and not args.full_model
            and args.lora_deltas == "merged"):
        out = merge_checkpoints(args.pretrained, args.finetuned, method, args.out, out_dtype=parse_dtype(args.dtype),
                                device=args.device, max_shard_bytes=parse_size(args.max_shard_size), progress=True,
                                overwrite=args.overwrite, hf_directory=False if args.weights_only else None,
                                tokenizer_from=args.tokenizer_from, **params)
        print(f"merged checkpoint written to {out}")
        return 0
    # PEFT adapters as experts (mergecal.adapters): all LoRA or all IA³
    if args.as_lora is not None and args.as_lora < 1:
        raise ParameterError(f"--as-lora {args.as_lora}: expected a rank of at least 1")
    result = merge_experts(args.pretrained, args.finetuned, method, args.out, as_lora=args.as_lora,
                           full_model=args.full_model, lora_deltas=args.lora_deltas,
                           out_dtype=parse_dtype(args.dtype), device=args.device,
                           max_shard_bytes=parse_size(args.max_shard_size), progress=True, overwrite=args.overwrite,
                           hf_directory=False if args.weights_only else None, tokenizer_from=args.tokenizer_from,
                           **params)
    if result.form == "lora":
        keys = result.energy["keys"]
        low = min(keys, key=lambda k: keys[k]["energy"]) if keys else None
        lowest = f"; lowest {keys[low]['energy']:.4%} at {low}" if low is not None else ""
        print(f"LoRA adapter (rank {args.as_lora}) written to {result.path}; energy kept "
              f"{result.energy['overall']:.4%} overall{lowest} (per key: {result.path}/lora_energy.json)")
    elif result.form == "ia3":
        print(f"IA³ adapter written to {result.path}")
    else:
        print(f"merged checkpoint written to {result.path}")
    return 0


def cmd_perf(args: argparse.Namespace) -> int:
    from .perf.merging import main as perf_main

    return perf_main(args)


def _pipeline(args: argparse.Namespace):
    from .pipeline.config import load_params
    from .pipeline.tracking import resolve_uri

    root = Path(args.root).resolve()
    params = load_params(root / args.params)
    return root, params, resolve_uri(root, params.tracking)


LAB_FILTERS = ("since", "track", "user", "commit")
BOARD_CACHE = ".mergecal/board-cache"  # the lab board's copy of what it read (mergecal.reports.run_cache)


def cmd_report(args: argparse.Namespace) -> int:
    root, params, uri = _pipeline(args)
    given = [f"--{name}" for name in (*LAB_FILTERS, "experiment") if getattr(args, name) is not None]
    if args.no_cache and not args.lab:
        raise ParameterError("--no-cache: the lab board's cache; add --lab")
    if args.output is not None and not args.costs:
        raise ParameterError("--output: the stem of the cost table's files; add --costs")
    if args.costs:
        if args.lab or given or args.out:
            raise ParameterError(f"--costs: the cost table reads this checkout's invocations; drop "
                                 f"{'--lab' if args.lab else given[0] if given else '--out (use --output)'}")
        written = _write_costs(root, params, uri, args.invocation, args.output)
    elif args.lab:
        from .reports.lab import Filters, write_lab_reports

        if args.invocation:
            raise ParameterError("--invocation: a lab board reads every finished invocation; filter it with "
                                 "--since, --track, --user or --commit")
        filters = Filters(**{name: getattr(args, name) for name in LAB_FILTERS})
        # every experiment of the store unless named: the lab's board is every checkout's, whatever it logs to
        written = write_lab_reports(uri, args.experiment, args.out or root / "reports" / "lab", filters,
                                    threshold=args.threshold,
                                    cache_dir=None if args.no_cache else root / BOARD_CACHE)
    elif given:
        raise ParameterError(f"{given[0]}: a filter of the lab board; add --lab")
    else:
        from .pipeline.track_registry import lab_tracks
        from .published import for_tracks
        from .reports.write import write_reports

        written = write_reports(uri, params.tracking.experiment, args.out or root / "reports", args.invocation,
                                threshold=args.threshold, published=for_tracks(lab_tracks(params)))
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


def _write_costs(root: Path, params, uri: str, invocation: str | None, output: str | None) -> dict[str, Path]:
    """Each method's own cost (``mergecal.reports.costs``) from the checkout's store, headed by this machine."""
    import os

    from .pipeline.threads import worker_threads
    from .reports.costs import DEFAULT_STEM, NO_COSTS, cost_table, measured_cells, write_costs
    from .reports.runs import load_runs

    try:
        runs = load_runs(uri, params.tracking.experiment)
    except MergecalError as err:  # no experiment yet: nothing was run
        raise MergecalError(f"--costs: {err}; {NO_COSTS}") from None
    cells, chosen = measured_cells(runs, invocation)
    threads = worker_threads(params.threads, params.runner.max_workers)
    machine = (f"{os.cpu_count()} CPU(s) where this table was written; torch threads per cell {threads} (params "
               f"threads {params.threads} / runner.max_workers {params.runner.max_workers}), device {params.device}")
    rows = cost_table(cells, params.benchmark.evaluation.distac_samples)
    return write_costs(rows, Path(output) if output else root / DEFAULT_STEM, machine, chosen)


def cmd_ui(args: argparse.Namespace) -> int:
    from .ui import check_port_number, serve_ui

    check_port_number(args.mlflow_port, "--mlflow-port")
    check_port_number(args.prefect_port, "--prefect-port")
    _, _, uri = _pipeline(args)
    from .pipeline.tracking import is_server, redact

    if is_server(uri):  # a lab's tracking server is its own UI
        print(f"MLflow: {redact(uri)} (the tracking server this checkout logs to)", flush=True)
        if args.no_prefect:
            return 0
        return serve_ui(uri, prefect_port=args.prefect_port, mlflow=False)
    return serve_ui(uri, mlflow_port=args.mlflow_port, prefect_port=args.prefect_port, prefect=not args.no_prefect)


def cmd_schedule(args: argparse.Namespace) -> int:
    import os

    from .pipeline.workspace import checkout_root

    if args.status or args.clear_stale:  # about the deployment on the server: no checkout needed
        from .pipeline.schedule import START_SERVER, clear_stale, status

        flag = "--status" if args.status else "--clear-stale"
        given = [name for name in ("pool", "publish_dir", "no_git_pull", "no_dvc_pull", "no_dvc_push", "no_publish")
                 if getattr(args, name)]
        if given:
            raise MergecalError(f"schedule {flag}: --{given[0].replace('_', '-')} sets up a deployment; give it with "
                                "--cron or --interval")
        api_url = os.environ.get("PREFECT_API_URL")
        if not api_url:
            raise MergecalError(f"schedule {flag}: set PREFECT_API_URL to the lab's Prefect server ({START_SERVER})")
        print(status(api_url) if args.status else clear_stale(api_url))
        return 0
    root = checkout_root(args.root)  # before anything is served: the reruns need the checkout's pipeline
    from .pipeline.schedule import START_SERVER, check_cron, register, serve

    if args.cron is not None:
        check_cron(args.cron)
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise MergecalError(f"schedule: set PREFECT_API_URL to a running Prefect server ({START_SERVER})")
    parameters = {"git_pull": not args.no_git_pull, "dvc_pull": not args.no_dvc_pull, "dvc_push": not args.no_dvc_push,
                  "publish_tracking": not args.no_publish, "publish_dir": args.publish_dir}
    if args.pool:
        deployment_id = register(args.cron, root, api_url, args.pool, interval=args.interval, parameters=parameters)
        print(f"deployment mergecal-rerun/scheduled-benchmark ({deployment_id}) on work pool {args.pool!r}; on the "
              f"machine that runs it: prefect worker start --pool {args.pool}")
        return 0
    print(serve(args.cron, root, api_url, interval=args.interval, parameters=parameters))
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    import subprocess

    from .pipeline.workspace import create_workspace

    workspace = create_workspace(args.dir, root=args.root)
    print(f"smoke workspace: {workspace}; running dvc repro")
    return subprocess.run(["dvc", "repro"], cwd=workspace).returncode


def cmd_presets(args: argparse.Namespace) -> int:
    from .config_types import ConfigValueError
    from .presets import PRESETS, preset_path, summary

    if args.name:  # one preset: what it holds, then its file (comments included)
        try:
            found = summary(args.name)
        except ConfigValueError as err:
            raise ParameterError(f"presets: {err}") from None
        print(f"{found['name']}: {found['description']}")
        print(f"family {found['family']}, pool {found['pool'] or '(none named)'}, task set {found['task_set']}: "
              f"{', '.join(found['tasks'])}")
        print(f"compared with: {'; '.join(found['compared_with']) or 'nothing published'}\n")
        print(preset_path(args.name).read_text(), end="")
        return 0
    for name in PRESETS:
        found = summary(name)
        compared = ", ".join(found["compared_with"]) or "nothing published"
        print(f"{name}\n    {found['family']}, pool {found['pool']}, {found['task_set']} "
              f"({len(found['tasks'])} task{'s' if len(found['tasks']) != 1 else ''}); compared with {compared}")
    print(f"\n{len(PRESETS)} presets; `mergecal presets NAME` shows one; a track uses one as `preset: NAME` "
          "(docs/reproduce-a-paper.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mergecal", description="Merge fine-tuned models and calibrate the merge.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list merge methods with their hyperparameters and defaults")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser(
        "merge", help="merge safetensors checkpoints (single files, directories or sharded indexes)",
        description="Merge checkpoints key by key. The CLI reads safetensors only (a single file, a directory or a "
                    "sharded *.index.json): it never unpickles a file, since unpickling can run code. Convert a "
                    "pickled state dict once with python -c \"import torch; from safetensors.torch import save_file; "
                    "save_file(torch.load('m.pt', weights_only=True), 'm.safetensors')\". The experts may instead be "
                    "PEFT adapter directories of the base, all LoRA or all IA³ (mergecal.adapters).")
    p.add_argument("--pretrained", required=True, help="the pretrained checkpoint theta_0")
    p.add_argument("--finetuned", required=True, nargs="+",
                   help="the K fine-tuned checkpoints, or K PEFT adapter directories of the base (all LoRA or all IA³)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--method", help="merge method name (see `mergecal methods`)")
    how.add_argument("--recipe", help='a data-free recipe: a merge method then svc and/or wsc steps, e.g. '
                                      '"tsv_m>svc(alpha=1.0)" (wsc without sensitive=[...] applies its scaling both '
                                      'ways); distac, fsc and dsc need data: use the pipeline or mergecal.run_recipe')
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a hyperparameter (repeatable)")
    p.add_argument("--out", required=True,
                   help="output checkpoint directory, written atomically; it may not be or hold an input, and an "
                        "existing directory that mergecal did not write is kept unless --overwrite is given")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out that mergecal did not write (inputs are still never replaced)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], help="output dtype of float keys")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-shard-size", default="2GB", help="shard size of the output (default 2GB)")
    p.add_argument("--tokenizer-from", metavar="DIR",
                   help="when --pretrained is a Hugging Face model directory (config.json), the output is one too "
                        "(the base's configs, tokenizer files and a model card beside the weights): take the "
                        "tokenizer files from DIR instead of the base")
    p.add_argument("--weights-only", action="store_true",
                   help="write the merged weights and their index only, even for a Hugging Face base")
    p.add_argument("--as-lora", type=int, metavar="RANK",
                   help="when the experts are PEFT LoRA adapter directories (adapter_config.json): write the merge "
                        "as a LoRA adapter of this rank (truncated SVD of each changed key's merged update) instead of "
                        "the full model, and report the energy kept")
    p.add_argument("--lora-deltas", choices=["merged", "float32"], default="merged",
                   help="when the experts are PEFT LoRA adapter directories: how each one's task vector is read. "
                        "merged (default): peft's merged weight minus the base, bit for bit what merge_and_unload "
                        "adds (on a 16-bit base each expert is rounded to the base's dtype first); float32: the "
                        "float32 delta B @ A * scaling, unrounded, so the merge is rounded once, when written "
                        "(full model or --as-lora)")
    p.add_argument("--full-model", action="store_true",
                   help="when the experts are PEFT IA³ adapter directories: write the base scaled by the merged "
                        "vectors (as peft's merge_and_unload) instead of an IA³ adapter")
    p.set_defaults(func=cmd_merge)

    from .perf.merging import add_arguments

    p = sub.add_parser("perf", help="time every merge method on ViT-B/32-shaped task vectors (speed and memory)")
    add_arguments(p)
    p.set_defaults(func=cmd_perf)

    def pipeline_args(p):
        p.add_argument("--root", default=".", help="repository root of the pipeline (default .)")
        p.add_argument("--params", default="params.yaml")

    p = sub.add_parser("report", help="leaderboards, plots and history from the MLflow store")
    pipeline_args(p)
    p.add_argument("--out", help="output directory (default <root>/reports; with --lab <root>/reports/lab)")
    p.add_argument("--invocation", help="benchmark invocation id (default: the latest)")
    p.add_argument("--no-cache", action="store_true",
                   help=f"with --lab: read every run from the store again (default: keep what was read in "
                        f"{BOARD_CACHE} and ask only for what is new)")
    p.add_argument("--lab", action="store_true",
                   help="one board from every finished invocation of every checkout that logged to the store, each "
                        "row with its provenance (docs/lab.md)")
    p.add_argument("--since", help="with --lab: runs started at or after this UTC date or time (2026-11-01)")
    p.add_argument("--track", help="with --lab: one track (vision, text, llm, local_clip or local_clip:<name>, ...)")
    p.add_argument("--user", help="with --lab: runs computed by this user")
    p.add_argument("--commit", help="with --lab: runs computed at this commit (a prefix)")
    p.add_argument("--experiment", action="append",
                   help="with --lab: only this MLflow experiment (repeatable; default: every experiment of the store)")
    p.add_argument("--threshold", type=float, default=1.0, help="regression threshold in points (default 1)")
    p.add_argument("--costs", action="store_true",
                   help="each merge's and calibration step's own cost (seconds per pass, peak MiB, data per task) "
                        "per track and regime, from the newest finished invocation of each profile (or "
                        "--invocation): a measurement committed by hand, read by reports/papers")
    p.add_argument("--output", help="with --costs: the files' path stem (default <root>/docs/measurements/cell-costs: "
                                    ".md and .json)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("ui", help="MLflow UI (and Prefect UI) on 127.0.0.1 until Ctrl-C")
    pipeline_args(p)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--no-prefect", action="store_true")
    p.set_defaults(func=cmd_ui)

    # these two need a mergecal checkout (dvc.yaml, stages/, flows/, mergecal/): an installed wheel has no pipeline
    p = sub.add_parser("schedule", help="a scheduled rerun of a checkout (git pull, dvc pull, dvc repro, dvc push, "
                                        "publish the reports): served from here, or on a work pool (--pool)")
    p.add_argument("--root", default=".", help="the mergecal checkout to rerun (default .)")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='cron schedule, e.g. "0 3 * * 1"')
    when.add_argument("--interval", type=float, help="every this many seconds")
    when.add_argument("--status", action="store_true",
                      help="list the deployment's runs that hold or wait for its concurrency slot (state, age, id) "
                           "and the command that clears a stale one; changes nothing")
    when.add_argument("--clear-stale", action="store_true",
                      help="cancel the runs --status calls stale, which gives their slot back")
    p.add_argument("--pool", help="register the deployment on this Prefect work pool (run by `prefect worker start "
                                  "--pool NAME`) instead of serving it from this process")
    p.add_argument("--no-git-pull", action="store_true", help="do not git pull --ff-only first")
    p.add_argument("--no-dvc-pull", action="store_true", help="do not dvc pull (done only with a DVC remote)")
    p.add_argument("--no-dvc-push", action="store_true", help="do not dvc push (done only with a DVC remote)")
    p.add_argument("--no-publish", action="store_true",
                   help="do not log the reports as artifacts of the invocation's run on the tracking store")
    p.add_argument("--publish-dir", help="also copy the reports into this folder (a lab's shared board)")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("presets", help="list the shipped presets (published model pools), or show one")
    p.add_argument("name", nargs="?", help="a preset's name (or a preset file's path): show what it holds")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("smoke", help="copy a checkout's pipeline into DIR with the smoke-size params and run dvc repro")
    p.add_argument("dir")
    p.add_argument("--root", default=".", help="the mergecal checkout whose pipeline is copied (default .)")
    p.set_defaults(func=cmd_smoke)
    return parser


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) as an exception, so that writers remove their staging directories as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # signals received during this main(): a library may turn the exception into another


def _raise_interrupted(signum, frame):
    _received.append(signum)
    raise Interrupted(signum)


def _signal_of(err: BaseException) -> int | None:
    """The signal that ended the command: the exception's own, or one received while it ran (safetensors turns
    an exception raised inside get_tensor into a ValueError), or SIGINT for a plain KeyboardInterrupt."""
    if getattr(err, "signum", None) is not None:
        return err.signum
    if _received:
        return _received[0]
    return signal.SIGINT if isinstance(err, KeyboardInterrupt) else None


def _os_error(err: OSError) -> str:
    if err.filename is None:
        return str(err)
    return f"{err.filename}: {err.strerror or err}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    _received.clear()
    # SIGINT only where Python's own handler is installed (a background job may run with SIGINT ignored)
    handled = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is signal.default_int_handler
                                  else [])
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in handled} if in_main_thread else {}
    try:
        return args.func(args)
    except BaseException as err:
        signum = _signal_of(err)
        if signum is not None:
            print(f"mergecal: error: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
            return 128 + signum
        if isinstance(err, MergecalError):
            print(f"mergecal: error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, OSError):
            print(f"mergecal: error: {_os_error(err)}", file=sys.stderr)
            return 2
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
