"""Does mergecal's CLIP zero-shot evaluation give FusionBench's predictions, example for example? (#42, step 3)

FusionBench is never a dependency of mergecal: fetch its wheel where PyPI is reachable and put its source on
PYTHONPATH for this script only (its own imports are torch, transformers, datasets, which mergecal has):

    pip download fusion-bench==0.2.33 --no-deps -d /tmp/fb && unzip -q /tmp/fb/fusion_bench-0.2.33-*.whl -d /tmp/fb/src
    PYTHONPATH=/tmp/fb/src python scripts/compare_fusionbench_eval.py --out /tmp/fb-compare

On identical inputs — a small random Hugging Face CLIP with the real parameter names at 224 px (its tokenizer files
written from open_clip's bundled BPE, the one OpenAI's CLIP uses), and fabricated images of many sizes and aspect
ratios for each of the twenty tasks' class lists — it compares, task by task, what FusionBench's CLIP task pool
(``CLIPVisionModelTaskPool``: ``get_classnames_and_templates``, ``CLIPProcessor``, ``HFCLIPClassifier``) and
mergecal's local_clip evaluation (``real_vision`` names and templates, ``clip_resize`` + ``preprocess``, the HF
directory read into open_clip, ``zero_shot_head``, ``logits``) compute: class names, templates, token ids, the
pixels, the text head, the logits and the predictions; and mergecal's model on FusionBench's pixels, which
separates a preprocessing difference from a model one. Writes ``comparison.json`` and ``comparison.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

# mergecal's task -> FusionBench's dataset name (its CLIPTemplateFactory keys)
FUSIONBENCH_NAMES = {"SUN397": "sun397", "Cars": "stanford-cars", "RESISC45": "resisc45", "EuroSAT": "eurosat",
                     "SVHN": "svhn", "GTSRB": "gtsrb", "MNIST": "mnist", "DTD": "dtd",
                     # the TALL-mask paper's twelve (FusionBench's TALL14 / TALL20 task pools)
                     "Flowers102": "oxford_flowers102", "PCAM": "pcam", "FER2013": "fer2013",
                     "OxfordIIITPet": "oxford-iiit-pet", "STL10": "stl10", "CIFAR100": "cifar100", "CIFAR10": "cifar10",
                     "Food101": "food101", "FashionMNIST": "fashion_mnist", "EMNIST": "emnist_letters",
                     "KMNIST": "kmnist", "RenderedSST2": "rendered-sst2"}
SIZE = 224


def write_tokenizer_files(out: Path) -> None:
    """vocab.json and merges.txt of open_clip's bundled BPE (OpenAI's CLIP vocabulary), for HF's CLIPTokenizer."""
    from open_clip.tokenizer import SimpleTokenizer

    simple = SimpleTokenizer()
    out.mkdir(parents=True, exist_ok=True)
    # OpenAI's (and the hub's tokenizer files') names of the two special tokens; open_clip renames them
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (out / "vocab.json").write_text(json.dumps({names.get(k, k): v for k, v in simple.encoder.items()}))
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")


def build_processor(folder: Path):
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="<|endoftext|>",
                              model_max_length=77)
    images = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE},
                                do_center_crop=True, resample=3, do_convert_rgb=True,
                                image_mean=[0.48145466, 0.4578275, 0.40821073],
                                image_std=[0.26862954, 0.26130258, 0.27577711])
    return CLIPProcessor(image_processor=images, tokenizer=tokenizer)


def build_clip(folder: Path, seed: int):
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    tower = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=2)
    model = CLIPModel(CLIPConfig(text_config=dict(tower, vocab_size=49408, max_position_embeddings=77),
                                 vision_config=dict(tower, image_size=SIZE, patch_size=32),
                                 projection_dim=32)).eval()
    with torch.no_grad():  # a spread of logits wide enough that predictions are not ties of noise
        model.logit_scale.fill_(float(np.log(100.0)))
    model.save_pretrained(folder)
    return model


def fabricated_images(n: int, seed: int):
    """PIL images of many sizes and aspect ratios (odd and even margins around the crop), random content."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = int(rng.integers(40, 400)), int(rng.integers(40, 400))
        mode = "L" if i % 5 == 0 else "RGB"  # MNIST-like greyscale images too
        pixels = rng.integers(0, 256, size=(h, w) if mode == "L" else (h, w, 3), dtype=np.uint8)
        out.append(Image.fromarray(pixels, mode=mode))
    return out


def compare(out: Path, n_images: int, seed: int) -> dict:
    from fusion_bench.models.hf_clip import HFCLIPClassifier
    from fusion_bench.tasks.clip_classification import get_classnames_and_templates

    from mergecal.backbones import clip_checkpoints
    from mergecal.backbones.open_clip_vit import get_tokenizer, logits, preprocess, zero_shot_head
    from mergecal.data.real_vision import clip_resize, task_metadata

    torch.set_num_threads(1)
    write_tokenizer_files(out / "clip")
    hf_clip = build_clip(out / "clip", seed)
    processor = build_processor(out / "clip")
    checkpoint = clip_checkpoints.open_checkpoint(out / "clip")
    arch = clip_checkpoints.register_hf_arch(out / "clip")
    oc_model = clip_checkpoints.build_model(arch, checkpoint)
    oc_tokenizer = get_tokenizer(arch)
    classifier = HFCLIPClassifier(hf_clip, processor)

    report = {"fusionbench": "0.2.33", "images_per_task": n_images, "tasks": {}}
    for task, name in FUSIONBENCH_NAMES.items():
        fb_names, fb_templates = get_classnames_and_templates(name)
        mc_names, mc_templates = task_metadata(task)
        fb_template_text = [t("{}") for t in fb_templates]
        entry = {"class_names_equal": list(fb_names) == list(mc_names),
                 "class_names_differing": [[a, b] for a, b in zip(fb_names, mc_names) if a != b][:10],
                 "n_classes": [len(fb_names), len(mc_names)],
                 "templates_equal": fb_template_text == list(mc_templates),
                 "templates": [len(fb_template_text), len(mc_templates)]}
        texts = [t.format(c) for c in mc_names for t in mc_templates]
        hf_ids = processor.tokenizer(texts)["input_ids"]
        oc_ids = [[int(x) for x in row if x != 0] for row in oc_tokenizer(texts)]
        entry["token_ids_differing"] = sum(a != b for a, b in zip(hf_ids, oc_ids))
        entry["texts"] = len(texts)

        # the same class names and templates on both sides (mergecal's), so the rest compares the evaluators
        with torch.no_grad():
            classifier.set_classification_task(list(mc_names), [lambda c, t=t: t.format(c) for t in mc_templates])
            fb_head = classifier.zeroshot_weights  # [C, d]
            mc_head = zero_shot_head(oc_model, oc_tokenizer, list(mc_names), list(mc_templates))  # [d, C]
            entry["head_max_abs_diff"] = float((fb_head.T - mc_head).abs().max())

            images = fabricated_images(n_images, seed + len(report["tasks"]))
            fb_pixels = torch.cat([processor(images=[im.convert("RGB")], return_tensors="pt")["pixel_values"]
                                   for im in images])
            mc_pixels = preprocess(np.stack([clip_resize(im, SIZE) for im in images]))
            floor_pixels = preprocess(np.stack([clip_resize(im, SIZE, crop="floor") for im in images]))
            diff = (fb_pixels - mc_pixels).abs().flatten(1).max(dim=1).values
            entry["pixels_max_abs_diff"] = float(diff.max())
            entry["images_with_pixel_diff_over_1e-3"] = int((diff > 1e-3).sum())
            floor_diff = (fb_pixels - floor_pixels).abs().flatten(1).max(dim=1).values
            entry["floor_pixels_max_abs_diff"] = float(floor_diff.max())
            # in intensity levels of [0, 255]: the resampling difference left once the crop agrees
            entry["floor_pixels_max_levels"] = float(floor_diff.max() * 255 * min(processor.image_processor.image_std))

            fb_logits = classifier(fb_pixels)
            mc_logits = logits(oc_model, mc_head, mc_pixels)
            mc_on_fb_pixels = logits(oc_model, mc_head, fb_pixels)
            entry["logits_max_abs_diff"] = float((fb_logits - mc_logits).abs().max())
            entry["logits_max_abs_diff_same_pixels"] = float((fb_logits - mc_on_fb_pixels).abs().max())
            fb_pred, mc_pred = fb_logits.argmax(1), mc_logits.argmax(1)
            entry["predictions_equal"] = int((fb_pred == mc_pred).sum())
            entry["predictions_equal_floor_crop"] = int(
                (fb_pred == logits(oc_model, mc_head, floor_pixels).argmax(1)).sum())
            entry["predictions_equal_same_pixels"] = int((fb_pred == mc_on_fb_pixels.argmax(1)).sum())
        report["tasks"][task] = entry
        print(f"{task}: names {'=' if entry['class_names_equal'] else '≠'}, templates "
              f"{'=' if entry['templates_equal'] else '≠'}, token ids differing {entry['token_ids_differing']}/"
              f"{len(texts)}, pixels max |Δ| {entry['pixels_max_abs_diff']:.2e}, predictions equal "
              f"{entry['predictions_equal']}/{n_images}, with center_crop floor "
              f"{entry['predictions_equal_floor_crop']}/{n_images} (pixels max |Δ| "
              f"{entry['floor_pixels_max_levels']:.1f} levels), on FusionBench's pixels "
              f"{entry['predictions_equal_same_pixels']}/{n_images}", flush=True)
    return report


def markdown(report: dict) -> str:
    lines = [f"FusionBench {report['fusionbench']} vs mergecal, {report['images_per_task']} fabricated images a task:",
             "", "| task | class names | templates | token ids differing | head max abs diff | pixels max abs diff "
             "(images > 1e-3) | logits max abs diff (same pixels) | predictions equal: round crop, floor crop, "
             "FusionBench's pixels |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for task, e in report["tasks"].items():
        lines.append(f"| {task} | {'equal' if e['class_names_equal'] else 'differ'} {e['n_classes']} | "
                     f"{'equal' if e['templates_equal'] else 'differ'} {e['templates']} | "
                     f"{e['token_ids_differing']}/{e['texts']} | {e['head_max_abs_diff']:.1e} | "
                     f"{e['pixels_max_abs_diff']:.1e} ({e['images_with_pixel_diff_over_1e-3']}) | "
                     f"{e['logits_max_abs_diff']:.1e} ({e['logits_max_abs_diff_same_pixels']:.1e}) | "
                     f"{e['predictions_equal']}, {e['predictions_equal_floor_crop']}, "
                     f"{e['predictions_equal_same_pixels']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=40, help="fabricated images per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import fusion_bench  # noqa: F401
    except ImportError:
        print("error: fusion_bench is not importable: put FusionBench 0.2.33's source on PYTHONPATH (see the "
              "docstring)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = compare(args.out, args.images, args.seed)
    (args.out / "comparison.json").write_text(json.dumps(report, indent=1))
    (args.out / "comparison.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
