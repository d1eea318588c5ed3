"""End-to-end vision pilot: build the default suite cold, pretrain the tiny CLIP, fine-tune it on the eight
tasks in every regime, merge the standard fine-tunes by task arithmetic.

    .venv/bin/python scripts/pilot_vision.py                 # the default benchmark size (library defaults)
    .venv/bin/python scripts/pilot_vision.py --smoke         # CI size: micro arch, tiny data, a few steps
    .venv/bin/python scripts/pilot_vision.py --regimes standard --pretrained /tmp/clip.safetensors

Stages, each timed with the machine's load average beside it (the machine is shared): the suite
(``build_vision_suite``, written to disk and read back as the pipeline does), contrastive pretraining,
zero-shot accuracy, the fine-tunes (8 standard, 8 low_confidence, 1 norm_mismatch by default), individual
accuracy, task arithmetic theta_0 + lambda * sum_t tau_t over a lambda grid chosen by average normalized
VALIDATION accuracy (docs/references.md), test accuracies reported. Prints one table.

Testbed diagnostics beside it: each task vector's norm relative to the pretrained image encoder's
(||tau_t|| / ||theta_0||), the task vectors' pairwise cosines, the MAGIC probe set (``letters``) scored zero-shot
and by the weight-averaged model (theta_0 + mean_t tau_t), and with ``--damage LAMBDA`` the damage matrix
acc_t(theta_0 + LAMBDA tau_u) - zeroshot_t on test (K^2 evaluations). ``--set suite.task_set=disjoint8`` picks
a task set of ``mergecal.data.vision.TASK_SETS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal import merge_models  # noqa: E402
from mergecal.checkpoint import load_state_dict, save_state_dict  # noqa: E402
from mergecal.backbones import create_clip, get_tokenizer, load_clip, save_clip, zero_shot_head  # noqa: E402
from mergecal.data.vision import PROBE_TASK, SMOKE_SUITE, TASK_SETS, SuiteConfig, build_vision_suite, load_split  # noqa: E402
from mergecal.data.vision import TASKS as ALL_TASKS  # noqa: E402
from mergecal.evaluation import evaluate as evaluate_on  # noqa: E402
from mergecal.pipeline.tracks.vision.stages import task_split  # noqa: E402  (the one owner of train/validation/test splits)
from mergecal.train import FinetuneConfig, PretrainConfig, finetune, pretrain_clip  # noqa: E402
from mergecal.train.finetune import SMOKE_FINETUNE  # noqa: E402
from mergecal.train.pretrain_clip import SMOKE_PRETRAIN  # noqa: E402


def stamp(label: str, start: float) -> float:
    print(f"[{label}] {time.time() - start:.1f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    return time.time() - start


def ta_sweep(sds, reference, lambdas, pre_sd, arch, split_eval, tasks) -> dict:
    """Task arithmetic of one set of fine-tunes over the lambda grid; normalized by ``reference`` (task ->
    (validation, test) accuracy of the set's own fine-tuned models), lambda chosen on normalized validation."""
    curve = {}
    for lam in lambdas:
        m = load_clip(arch, merge_models(pre_sd, sds, "task_arithmetic", scaling=lam))
        scores = {n: split_eval(m, n) for n in tasks}
        curve[f"{lam:g}"] = {
            "val_norm": float(np.mean([scores[n][0] / max(reference[n][0], 1e-9) for n in tasks])),
            "test": float(np.mean([scores[n][1]["accuracy"] for n in tasks])),
            "test_norm": float(np.mean([scores[n][1]["accuracy"] / max(reference[n][1], 1e-9) for n in tasks])),
            "per_task_test": {n: scores[n][1]["accuracy"] for n in tasks}}
    best = max(lambdas, key=lambda lam: curve[f"{lam:g}"]["val_norm"])
    return {"best_lambda": best, **{k: curve[f"{best:g}"][k] for k in ("test", "test_norm")}, "curve": curve}


def regime_report(args, tasks, rows, states, pre_sd, taus, lambdas, best, arch, split_eval) -> dict:
    """The failure regimes against the standard one (issue #14, item 4): low_confidence's mean test entropy over
    the standard models' and its task arithmetic; for each norm-mismatched task, its vector's norm over the mean
    of the others' (standard) norms and task arithmetic's normalized test accuracy lost at the standard regime's
    lambda (as the pipeline's testbed health) and at the lambda the mismatched set selects itself."""
    std_ref = {n: (rows[n]["individual_val"], rows[n]["individual"]) for n in tasks}
    std_norm = float(np.mean([rows[n][f"ta_{best:g}"] / max(rows[n]["individual"], 1e-9) for n in tasks]))
    report: dict = {"standard": {"best_lambda": best, "test_norm": std_norm,
                                 "entropy": float(np.mean([rows[n]["individual_entropy"] for n in tasks]))}}
    regimes = args.regimes.split(",")
    if "low_confidence" in regimes:
        ref = {n: (rows[n]["individual_low_confidence_val"], rows[n]["individual_low_confidence"]) for n in tasks}
        sweep = ta_sweep([states[("low_confidence", n)] for n in tasks], ref, lambdas, pre_sd, arch, split_eval,
                         tasks)
        entropy = float(np.mean([rows[n]["individual_low_confidence_entropy"] for n in tasks]))
        report["low_confidence"] = {
            "entropy": entropy, "entropy_ratio": entropy / max(report["standard"]["entropy"], 1e-12),
            "individual_avg": float(np.mean([rows[n]["individual_low_confidence"] for n in tasks])),
            "ta": sweep, "ta_norm_loss": std_norm - sweep["test_norm"]}
        print(f"low_confidence: mean entropy {entropy:.3f} vs standard {report['standard']['entropy']:.3f} "
              f"(x{report['low_confidence']['entropy_ratio']:.2f}); individual avg "
              f"{report['low_confidence']['individual_avg']:.3f}; TA lambda {sweep['best_lambda']:g} test "
              f"{sweep['test']:.3f}, normalized {sweep['test_norm']:.3f} (standard {std_norm:.3f})")
    if "norm_mismatch" in regimes:
        visual = [k for k in pre_sd if k.startswith("visual.") and pre_sd[k].is_floating_point()]
        flat0 = torch.cat([pre_sd[k].flatten().double() for k in visual])
        report["norm_mismatch"] = {}
        for hot in args.norm_mismatch_task.split(","):
            hot_tau = torch.cat([states[("norm_mismatch", hot)][k].flatten().double() for k in visual]) - flat0
            ratio = float(hot_tau.norm()) / float(np.mean([float(taus[n].norm()) for n in tasks if n != hot]))
            sds = [states[("norm_mismatch" if n == hot else "standard", n)] for n in tasks]
            ref = {**std_ref, hot: (rows[hot]["individual_norm_mismatch_val"], rows[hot]["individual_norm_mismatch"])}
            sweep = ta_sweep(sds, ref, lambdas, pre_sd, arch, split_eval, tasks)
            at_std = sweep["curve"][f"{best:g}"]
            report["norm_mismatch"][hot] = {
                "norm_ratio": ratio, "individual": rows[hot]["individual_norm_mismatch"],
                "individual_standard": rows[hot]["individual"],
                "ta_norm_at_standard_lambda": at_std["test_norm"],
                "loss_at_standard_lambda": std_norm - at_std["test_norm"],
                "ta": sweep, "loss_at_own_lambda": std_norm - sweep["test_norm"]}
            r = report["norm_mismatch"][hot]
            print(f"norm_mismatch {hot:<12} ratio {ratio:5.2f}, fine-tuned {r['individual']:.3f} "
                  f"(standard {r['individual_standard']:.3f}); TA normalized loss at standard lambda {best:g}: "
                  f"{100 * r['loss_at_standard_lambda']:+.1f} points; at its own lambda {sweep['best_lambda']:g}: "
                  f"{100 * r['loss_at_own_lambda']:+.1f}", flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--root", help="suite directory (default: a temporary one, built cold)")
    p.add_argument("--pretrained", help="safetensors path: loaded if it exists, else written after pretraining")
    p.add_argument("--regimes", default="standard,low_confidence,norm_mismatch")
    p.add_argument("--norm-mismatch-task", default="shapes",
                   help="the task fine-tuned at the lr multiple; a comma-separated list measures each in turn")
    p.add_argument("--norm-mismatch-lr-multiplier", type=float, default=15.0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a default, e.g. finetune.steps=100 or pretrain.lr=1e-3 or suite.n_train=2000")
    p.add_argument("--lambdas", default="0.05,0.1,0.2,0.3,0.5,0.7,1.0", help="params.yaml's task arithmetic grid")
    p.add_argument("--damage", type=float, help="also measure acc_t(theta_0 + DAMAGE * tau_u) - zeroshot_t")
    p.add_argument("--json", help="write the measured figures here")
    p.add_argument("--save-finetuned", metavar="DIR",
                   help="write each fine-tuned state dict to DIR/REGIME/TASK.safetensors")
    p.add_argument("--load-finetuned", metavar="DIR",
                   help="reuse DIR/REGIME/TASK.safetensors where it exists instead of fine-tuning (same settings!)")
    p.add_argument("--logit-scale", type=float, metavar="S",
                   help="set the pretrained model's temperature exp(logit_scale) to S before the heads and fine-tunes "
                        "(CLIP's clamp is 100); zero-shot accuracy is unchanged, confidence is not")
    p.add_argument("--init-logit-scale", type=float, metavar="S",
                   help="start pretraining with the temperature exp(logit_scale) = S (open_clip's init: 1/0.07; "
                        "still learned, clamped at 100 as CLIP)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda: pretraining, fine-tunes and evaluation (a GPU pilot's "
                   "figures are not bitwise the CPU pipeline's; use it to screen recipes, then confirm on CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    evaluate = functools.partial(evaluate_on, device=args.device)  # every evaluation of this pilot
    configs = {"suite": SMOKE_SUITE if args.smoke else SuiteConfig(),
               "pretrain": SMOKE_PRETRAIN if args.smoke else PretrainConfig(),
               "finetune": SMOKE_FINETUNE if args.smoke else FinetuneConfig()}
    for item in args.set:
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        kind = type(getattr(configs[section], field))
        configs[section] = dataclasses.replace(configs[section], **{field: kind(value)})
    suite, pre_cfg, ft_cfg = configs["suite"], configs["pretrain"], configs["finetune"]
    TASKS = {name: ALL_TASKS[name] for name in TASK_SETS[suite.task_set]}  # noqa: N806
    arch = pre_cfg.arch
    timings: dict[str, float] = {}
    t0 = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="mergecal-pilot-")
    root = Path(args.root or tmp.name)
    if not (root / "manifest.json").exists():
        build_vision_suite(root, suite, progress=False)
    timings["suite"] = stamp("suite", t0)

    t = time.time()
    if args.pretrained and Path(args.pretrained).exists():
        model = load_clip(arch, args.pretrained)
    else:
        pre = load_split(root, "pretrain", "train")
        start = None
        if args.init_logit_scale is not None:
            start = create_clip(arch, seed=pre_cfg.seed)
            with torch.no_grad():
                start.logit_scale.fill_(float(np.log(args.init_logit_scale)))
        model, hist = pretrain_clip(pre["images"], pre["captions"].tolist(), pre_cfg, model=start,
                                    device=args.device, progress=False)
        model = model.cpu()  # the heads, theta_0 and every merge stay on the CPU; evaluation moves its model
        print(f"pretrain loss {np.mean(hist['loss'][:10]):.3f} -> {np.mean(hist['loss'][-10:]):.3f}, "
              f"logit scale {hist['logit_scale'][-1]:.1f}")
        if args.pretrained:
            save_clip(model, args.pretrained, {"arch": arch})
    timings["pretrain"] = stamp("pretrain", t)
    learned_scale = float(model.logit_scale.detach().exp())
    if args.logit_scale is not None:
        with torch.no_grad():
            model.logit_scale.fill_(float(np.log(args.logit_scale)))
        print(f"logit scale {learned_scale:.1f} -> {args.logit_scale:g}")
    tokenizer = get_tokenizer(arch)
    pre_sd = {k: v.clone() for k, v in model.state_dict().items()}
    heads = {name: zero_shot_head(model, tokenizer, spec.classnames, spec.templates) for name, spec in TASKS.items()}
    probe_head = zero_shot_head(model, tokenizer, PROBE_TASK.classnames, PROBE_TASK.templates)
    probe = load_split(root, PROBE_TASK.dataset, "test")
    probe_x, probe_y = probe["images"], probe[PROBE_TASK.label]
    data = {name: {split: task_split(root, name, split) for split in ("train", "validation", "test")} for name in TASKS}

    def split_eval(m, name):
        (xv, yv), (xt, yt) = data[name]["validation"], data[name]["test"]
        return evaluate(m, heads[name], xv, yv)["accuracy"], evaluate(m, heads[name], xt, yt)

    zs_test = {name: split_eval(model, name)[1] for name in TASKS}
    rows = {name: {"chance": 1.0 / len(spec.classnames), "zeroshot": zs_test[name]["accuracy"],
                   "zeroshot_entropy": zs_test[name]["entropy"]} for name, spec in TASKS.items()}
    hot_tasks = args.norm_mismatch_task.split(",")
    runs = [(regime, name) for regime in args.regimes.split(",") for name in TASKS
            if regime != "norm_mismatch" or name in hot_tasks]
    states: dict[tuple[str, str], dict] = {}
    t = time.time()
    for regime, name in runs:
        t1 = time.time()
        cached = Path(args.load_finetuned or "") / regime / f"{name}.safetensors"
        if args.load_finetuned and cached.exists():
            states[(regime, name)] = load_state_dict(cached)
            print(f"  loaded {cached}", flush=True)
            continue
        # norm mismatch: a standard fine-tune at the pipeline's lr multiple (mergecal.regimes)
        config = (dataclasses.replace(ft_cfg, lr=ft_cfg.lr * args.norm_mismatch_lr_multiplier)
                  if regime == "norm_mismatch" else dataclasses.replace(ft_cfg, regime=regime))
        states[(regime, name)], _ = finetune(model, heads[name], *data[name]["train"], config, device=args.device,
                                             progress=False)
        print(f"  fine-tuned {regime:<15} {name:<12} {time.time() - t1:5.1f} s "
              f"({(time.time() - t1) / ft_cfg.steps:.3f} s/step), load {os.getloadavg()[0]:.2f}", flush=True)
        if args.save_finetuned:
            save_state_dict(states[(regime, name)], Path(args.save_finetuned) / regime / f"{name}.safetensors")
    timings["finetunes"] = stamp(f"{len(runs)} fine-tunes", t)
    timings["build_total"] = timings["suite"] + timings["pretrain"] + timings["finetunes"]

    for regime in args.regimes.split(","):
        for name in TASKS:
            if (regime, name) in states:
                val_acc, test = split_eval(load_clip(arch, states[(regime, name)]), name)
                key = "individual" if regime == "standard" else f"individual_{regime}"
                rows[name].update({key: test["accuracy"], f"{key}_val": val_acc, f"{key}_entropy": test["entropy"]})
    result = {"configs": {k: dataclasses.asdict(v) for k, v in configs.items()}, "rows": rows, "timings": timings,
              "load": os.getloadavg(), "learned_logit_scale": learned_scale, "logit_scale": args.logit_scale,
              "init_logit_scale": args.init_logit_scale,
              "device": args.device}
    if "standard" in args.regimes.split(","):
        visual = [k for k in pre_sd if k.startswith("visual.") and pre_sd[k].is_floating_point()]
        flat0 = torch.cat([pre_sd[k].flatten().double() for k in visual])
        taus = {n: torch.cat([states[("standard", n)][k].flatten().double() for k in visual]) - flat0 for n in TASKS}
        for n in TASKS:
            rows[n]["relative_norm"] = float(taus[n].norm() / flat0.norm())
        result["cosines"] = {a: {b: float(taus[a] @ taus[b] / (taus[a].norm() * taus[b].norm())) for b in TASKS}
                             for a in TASKS}
        averaged = load_clip(arch, merge_models(pre_sd, [states[("standard", n)] for n in TASKS], "task_arithmetic",
                                                scaling=1.0 / len(TASKS)))
        result["probe"] = {"chance": 1.0 / len(PROBE_TASK.classnames),
                           "zeroshot": evaluate(model, probe_head, probe_x, probe_y)["accuracy"],
                           "weight_averaged": evaluate(averaged, probe_head, probe_x, probe_y)["accuracy"]}
        print("relative norms: " + ", ".join(f"{n} {rows[n]['relative_norm']:.4f}" for n in TASKS))
        print("cosines:\n" + "\n".join(f"{a:<12}" + "".join(f"{result['cosines'][a][b]:>8.2f}" for b in TASKS)
                                       for a in TASKS))
        print("probe (letters): " + ", ".join(f"{k} {v:.3f}" for k, v in result["probe"].items()))
        if args.damage is not None:
            t = time.time()
            result["damage"] = {}
            for u in TASKS:  # rows: the task vector added; columns: the task scored
                m = load_clip(arch, merge_models(pre_sd, [states[("standard", u)]], "task_arithmetic",
                                                 scaling=args.damage))
                result["damage"][u] = {n: split_eval(m, n)[1]["accuracy"] - rows[n]["zeroshot"] for n in TASKS}
            print(f"damage acc_t(theta_0 + {args.damage:g} tau_u) - zeroshot_t (rows u, columns t):")
            print(f"{'':<12}" + "".join(f"{n[:7]:>8}" for n in TASKS))
            for u in TASKS:
                print(f"{u:<12}" + "".join(f"{result['damage'][u][n]:>8.3f}" for n in TASKS))
            timings["damage"] = stamp("damage matrix", t)
    if "standard" in args.regimes.split(","):
        lambdas = [float(v) for v in args.lambdas.split(",")]
        ft_sds = [states[("standard", name)] for name in TASKS]
        merged = {}
        for lam in lambdas:
            m = load_clip(arch, merge_models(pre_sd, ft_sds, "task_arithmetic", scaling=lam))
            merged[lam] = {name: split_eval(m, name) for name in TASKS}
        norm_val = {lam: np.mean([merged[lam][n][0] / max(rows[n]["individual_val"], 1e-9) for n in TASKS])
                    for lam in lambdas}
        best = max(lambdas, key=lambda lam: norm_val[lam])
        result["ta_normalized_validation"] = {f"{lam:g}": float(norm_val[lam]) for lam in lambdas}
        for name in TASKS:
            rows[name].update({f"ta_val_{lam:g}": merged[lam][name][0] for lam in lambdas})
        for name in TASKS:
            rows[name].update({f"ta_{lam:g}": merged[lam][name][1]["accuracy"] for lam in lambdas})
            rows[name]["ta_best"] = rows[name][f"ta_{best:g}"]
        result["best_lambda"] = best
        cols = ["chance", "zeroshot", "individual", "ta_best"] + [f"ta_{lam:g}" for lam in lambdas]
        if "low_confidence" in args.regimes.split(","):
            cols.insert(3, "individual_low_confidence")
        print(f"\narch {arch}; TA lambda chosen on validation: {best:g}")
        print(f"{'task':<12}" + "".join(f"{c[:11]:>12}" for c in cols))
        for name in TASKS:
            print(f"{name:<12}" + "".join(f"{rows[name][c]:>12.3f}" for c in cols))
        result["average"] = {c: float(np.mean([rows[n][c] for n in TASKS])) for c in cols}
        print(f"{'average':<12}" + "".join(f"{result['average'][c]:>12.3f}" for c in cols))
    if "standard" in args.regimes.split(",") and len(args.regimes.split(",")) > 1:
        result["regimes"] = regime_report(args, TASKS, rows, states, pre_sd, taus, lambdas, best, arch, split_eval)
    print("TA average normalized validation accuracy per lambda: "
          + ", ".join(f"{k} {v:.3f}" for k, v in result.get("ta_normalized_validation", {}).items()))
    print("time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + f"; load {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
