"""The real vision tasks of model merging, read from local files only (nothing is downloaded).

Tasks (``VISION_TASKS``): the eight standard ones (``REAL_TASKS``: SUN397, Cars (Stanford Cars), RESISC45,
EuroSAT, SVHN, GTSRB, MNIST, DTD) and the twelve the TALL-mask paper adds for its 14- and 20-task sets
(Flowers102, PCAM, FER2013, OxfordIIITPet, STL10, CIFAR100, then CIFAR10, Food101, FashionMNIST, EMNIST (letters),
KMNIST, RenderedSST2; ``TASK_SETS``), with the class names and templates of ``real_vision_metadata``.
``load_real_split(root, name, split)`` finds the dataset under ``root`` (the "data location" of task_vectors /
torchvision) in one of three layouts:

``imagefolder`` -- task_vectors' preprocessed splits: ``ROOT/<dir>/{train,val,test}/<class>/<image>``, with
    ``<dir>`` one of ``DATASET_DIRS[name]`` (e.g. ``EuroSAT_splits``, ``dtd``, ``sun397``/``SUN397``,
    ``stanford_cars_folder_based``, ``resisc45``). Class folders are matched to the standard classes by name
    (case, spaces, ``_``, ``/``, ``-`` ignored; SUN397's ``a_abbey`` letter prefix and EuroSAT's ``AnnualCrop``
    style accepted). When there is no ``test/`` folder, ``val/`` is the test split: the common preprocessing
    script writes DTD's ``test1.txt`` and SUN397's ``Testing_01.txt`` there, and task_vectors tests on it.
``torchvision`` -- (the eight tasks) what ``torchvision.datasets.X(root, download=False)`` (or task_vectors'
    own class) reads:
    MNIST ``ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``;
    SVHN ``ROOT/svhn/{train,test}_32x32.mat`` (or directly under ROOT; label 10 means digit 0);
    EuroSAT ``ROOT/eurosat/2750/<class>/*.jpg`` (also ``ROOT/2750``, ``ROOT/EuroSAT_RGB``); it has no official
    split, so each class is split by a fixed seeded permutation into 270 validation, 270 test and the rest
    train images (the sizes of the common ``EuroSAT_splits`` script, whose own shuffle was unseeded);
    GTSRB ``ROOT/gtsrb/GTSRB/Training/<00000..00042>/*.ppm`` and ``ROOT/gtsrb/GTSRB/Final_Test/Images`` with
    ``ROOT/gtsrb/GT-final_test.csv``;
    DTD ``ROOT/dtd/dtd/{images/<class>/*.jpg,labels/{train,val,test}1.txt}`` (partition 1, as task_vectors);
    Cars ``ROOT/stanford_cars/{devkit/cars_meta.mat,devkit/cars_train_annos.mat,cars_train/,
    cars_test_annos_withlabels.mat,cars_test/}``;
    SUN397 ``ROOT/SUN397/<letter>/<class>/sun_*.jpg`` with the partition files ``ROOT/SUN397/{Training,Testing}_01.txt``
    (partition 1, as task_vectors);
    RESISC45 (torchgeo / task_vectors) ``ROOT/resisc45/NWPU-RESISC45/<class>/*.jpg`` with
    ``ROOT/resisc45/resisc45-{train,val,test}.txt``.
``hf`` -- Hugging Face ``datasets`` files under ``ROOT/<dir>``: a ``DatasetDict.save_to_disk`` directory
    (``dataset_dict.json``), or parquet shards ``**/{train,validation,test}-*.parquet`` as in the hub repos
    FusionBench uses (``tanganke/sun397`` etc.), with an ``image`` and a ``label`` column; ``ROOT`` may also be
    such a repository's snapshot in a Hugging Face cache (a hub id, ``mergecal.hub_cache``); or webdataset tar
    shards ``<split>/<n>.tar`` (``<key>.jpg`` + ``<key>.cls``: clip-benchmark/wds_fer2013, FusionBench's FER2013).
    As FusionBench reads them: CIFAR-100's ``fine_label`` where there is no ``label`` column, and Food-101's
    ``validation`` split as its test split (its validation then held out of train). Label names from the
    ``ClassLabel`` feature are matched to the standard classes; when they do not match but their number does,
    the integer labels are taken as the standard order. Read with pyarrow / ``load_from_disk``, never the hub.

``layout="auto"`` tries them in that order. ``split`` is ``"train"``, ``"validation"`` or ``"test"``; the
validation split is the layout's own (EuroSAT_splits' ``val``, RESISC45's and DTD's official val, an HF
``validation`` split) and otherwise ``mergecal.data.vision.validation_indices`` of train (task_vectors'
"<name>Val": 10% of train, at most 5000, seeded). Images are decoded lazily: ``RealSplit.images`` and
``iter_batches`` return uint8 RGB [n, size, size, 3] arrays, resized like CLIP's preprocessing (shorter side to
``size``, bicubic, then centre crop) for ``mergecal.evaluation.zeroshot``.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from PIL import Image

from ..errors import MergecalError, ParameterError, UnknownNameError
from .real_vision_metadata import CLASSNAMES, NATIVE_NAMES, REAL_TASKS, TEMPLATES, VISION_TASKS  # noqa: F401 (re-exported)
from .vision import validation_indices


class DatasetError(MergecalError):
    """A dataset file or folder is missing, unreadable or not in the expected layout."""


LAYOUTS = ("imagefolder", "torchvision", "hf")
SPLITS = ("train", "validation", "test")
# torchvision.datasets.folder.IMG_EXTENSIONS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Per-class validation and test sizes of the common EuroSAT_splits script (val_size=270, test_size=270).
EUROSAT_HOLDOUT_PER_CLASS = 270
EUROSAT_SPLIT_SEED = 0

# Folder names under ROOT for the imagefolder and hf layouts.
DATASET_DIRS: dict[str, tuple[str, ...]] = {
    "SUN397": ("sun397", "SUN397"),
    "Cars": ("stanford_cars_folder_based", "cars", "Cars", "stanford_cars", "stanford-cars"),
    "RESISC45": ("resisc45", "RESISC45"),
    "EuroSAT": ("EuroSAT_splits", "eurosat", "EuroSAT"),
    "SVHN": ("svhn", "SVHN"),
    "GTSRB": ("gtsrb", "GTSRB"),
    "MNIST": ("mnist", "MNIST"),
    "DTD": ("dtd", "DTD"),
    # the TALL-mask tasks (their hub repositories' names, FusionBench's and torchvision's spellings)
    "Flowers102": ("oxford_flowers102", "flowers102", "Flowers102", "flowers-102"),
    "PCAM": ("pcam", "PCAM", "PatchCamelyon"),
    "FER2013": ("fer2013", "FER2013", "wds_fer2013"),
    "OxfordIIITPet": ("oxford-iiit-pet", "oxford_iiit_pet", "OxfordIIITPet", "oxford_pets"),
    "STL10": ("stl10", "STL10"),
    "CIFAR100": ("cifar100", "CIFAR100", "cifar-100"),
    "CIFAR10": ("cifar10", "CIFAR10", "cifar-10"),
    "Food101": ("food101", "Food101", "food-101"),
    "FashionMNIST": ("fashion_mnist", "FashionMNIST", "fashion-mnist"),
    "EMNIST": ("emnist_letters", "EMNIST", "emnist"),
    "KMNIST": ("kmnist", "KMNIST"),
    "RenderedSST2": ("rendered-sst2", "rendered_sst2", "RenderedSST2"),
}
# Among several parquet configurations in one hub repository, the one that holds the task.
_HF_PREFERRED_CONFIG = {"SVHN": "cropped_digits", "MNIST": "mnist"}
_NAME_ALIASES = {"stanfordcars": "Cars", "cars": "Cars", "oxfordflowers102": "Flowers102", "flower102": "Flowers102",
                 "patchcamelyon": "PCAM", "oxfordpets": "OxfordIIITPet", "emnistletters": "EMNIST"}
# Label columns tried in order, where a task's hub copies name theirs otherwise (CIFAR-100's fine labels)
_LABEL_COLUMNS = {"CIFAR100": ("label", "labels", "fine_label")}
# FusionBench's test split where it is not the split named test: Food-101 has none (its validation split, 25,250
# images, is what FusionBench and the TALL-mask code test on); the validation split is then held out of train
_HF_TEST_SPLIT = {"Food101": "validation"}


def _norm(text: str) -> str:
    """Matching key of a class or dataset name: lower case, letters and digits only (any script: KMNIST's
    classes are hiragana)."""
    return re.sub(r"[\W_]", "", str(text).lower())


def canonical_task(name: str) -> str:
    """The ``VISION_TASKS`` spelling of ``name`` (case and punctuation ignored; "StanfordCars" -> "Cars")."""
    by_key = {_norm(t): t for t in VISION_TASKS} | _NAME_ALIASES
    task = by_key.get(_norm(name))
    if task is None:
        raise UnknownNameError(f"unknown real vision task {name!r}; expected one of {', '.join(VISION_TASKS)}")
    return task


def task_metadata(name: str) -> tuple[list[str], list[str]]:
    """(class names, zero-shot templates) of a task, in the standard label order."""
    task = canonical_task(name)
    return list(CLASSNAMES[task]), list(TEMPLATES[task])


@functools.lru_cache(maxsize=None)
def label_lookup(task: str) -> dict[str, int]:
    """Normalised on-disk class name -> standard label, from the class names, ``NATIVE_NAMES`` and (SUN397)
    the first-letter directory prefix. Raises if two classes would share a key."""
    lookup: dict[str, int] = {}
    for i, classname in enumerate(CLASSNAMES[task]):
        keys = {_norm(classname)}
        if task == "GTSRB":  # class folders may also be plain class ids
            keys.add(str(i))
        if task in NATIVE_NAMES:
            keys.add(_norm(NATIVE_NAMES[task][i]))
        if task == "SUN397":
            keys.add(_norm(classname[0] + classname))
        for key in keys:
            if lookup.setdefault(key, i) != i:
                raise AssertionError(f"{task}: classes {lookup[key]} and {i} share the matching key {key!r}")
    return lookup


def resolve_label(task: str, raw_name: str, where: str) -> int:
    """Standard label of an on-disk class name; a DatasetError naming ``where`` when it matches none."""
    label = label_lookup(task).get(_norm(raw_name))
    if label is None:
        examples = ", ".join(repr(c) for c in CLASSNAMES[task][:3])
        raise DatasetError(f"{task}: class {raw_name!r} in {where} is none of the {len(CLASSNAMES[task])} "
                           f"{task} classes (e.g. {examples})")
    return label


# ---------------------------------------------------------------------------------------------- images


CENTER_CROPS = ("round", "floor")


def clip_resize(image: Image.Image, size: int, crop: str = "round") -> np.ndarray:
    """uint8 RGB [size, size, 3]: shorter side resized to ``size`` (bicubic), then centre crop -- torchvision's
    ``Resize(size, BICUBIC)`` + ``CenterCrop(size)`` as in CLIP's preprocessing (same rounding). ``crop``: where
    an odd margin puts the crop: ``round`` (torchvision's CenterCrop: open_clip, task_vectors) or ``floor``
    (Hugging Face's CLIPImageProcessor: FusionBench), one pixel apart (scripts/compare_fusionbench_eval.py)."""
    if crop not in CENTER_CROPS:
        raise ParameterError(f"crop: expected one of {', '.join(CENTER_CROPS)}, got {crop!r}")
    image = image.convert("RGB")
    w, h = image.size
    if (w, h) != (size, size):
        nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        if (nw, nh) != (w, h):
            image = image.resize((nw, nh), Image.BICUBIC)
        if crop == "round":
            left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
        else:
            left, top = (nw - size) // 2, (nh - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image, dtype=np.uint8)


def _open_image(path: Path, task: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{task}: cannot read image {path}: {exc}") from None


def _to_pil(value, base: Path, task: str) -> Image.Image:
    """An image cell of an HF dataset: a PIL image, {"bytes", "path"} or an array."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            try:
                image = Image.open(io.BytesIO(value["bytes"]))
                image.load()
                return image
            except (OSError, ValueError) as exc:
                raise DatasetError(f"{task}: cannot decode an image stored in {base}: {exc}") from None
        if value.get("path"):
            path = Path(value["path"])
            return _open_image(path if path.is_absolute() else base / path, task)
    if isinstance(value, (np.ndarray, list)):
        return Image.fromarray(np.asarray(value, dtype=np.uint8))
    raise DatasetError(f"{task}: image cell of type {type(value).__name__} in {base} is not an image")


@dataclass(frozen=True)
class _Source:
    """One split as stored: standard labels per row, a loader of row i's image and the files it reads (label
    files and images: what ``dataset_files`` hashes)."""

    labels: np.ndarray
    load: Callable[[int], Image.Image]
    location: str
    files: tuple[Path, ...] = ()

    def subset(self, rows: np.ndarray) -> _Source:
        rows = np.asarray(rows, dtype=np.int64)
        return _Source(self.labels[rows], lambda i: self.load(int(rows[i])), self.location, self.files)


def _file_source(task: str, files: Sequence[Path], labels: Sequence[int], location: Path | str,
                 read: Sequence[Path] = ()) -> _Source:
    """Images read from ``files``, after the label files ``read`` (a list or annotation file)."""
    if len(files) == 0:
        raise DatasetError(f"{task}: no images found in {location}")
    files = list(files)
    return _Source(np.asarray(labels, dtype=np.int64), lambda i: _open_image(files[i], task), str(location),
                   (*read, *files))


@dataclass(frozen=True)
class RealSplit:
    """One split of a real task: labels in the standard class order, the task's class names and templates,
    and images decoded on demand (so evaluation streams batches instead of holding the dataset)."""

    name: str
    split: str
    labels: np.ndarray
    classnames: list[str]
    templates: list[str]
    layout: str
    location: str
    _source: _Source = field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> Image.Image:
        """Image ``index`` as stored (PIL, any size and mode)."""
        return self._source.load(int(index))

    def images(self, indices: Sequence[int] | np.ndarray, size: int, crop: str = "round") -> np.ndarray:
        """uint8 RGB [len(indices), size, size, 3], CLIP-style resized and centre-cropped (``clip_resize``)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if size < 1:
            raise ParameterError(f"{self.name} {self.split}: size must be >= 1, got {size}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise ParameterError(f"{self.name} {self.split}: indices must lie in [0, {len(self)}), got "
                                 f"[{idx.min()}, {idx.max()}]")
        out = np.empty((idx.size, size, size, 3), dtype=np.uint8)
        for k, i in enumerate(idx):
            out[k] = clip_resize(self._source.load(int(i)), size, crop)
        return out

    def iter_batches(self, batch_size: int, size: int, indices: Sequence[int] | np.ndarray | None = None,
                     crop: str = "round") -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(uint8 images [b, size, size, 3], int64 labels [b]) over ``indices`` (default: all, in order)."""
        if batch_size < 1:
            raise ParameterError(f"{self.name} {self.split}: batch_size must be >= 1, got {batch_size}")
        idx = np.arange(len(self)) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
        for start in range(0, len(idx), batch_size):
            chunk = idx[start:start + batch_size]
            yield self.images(chunk, size, crop), self.labels[chunk]


# ----------------------------------------------------------------------------------------- imagefolder


def _image_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def _class_folders(task: str, split_dir: Path) -> _Source:
    """ImageFolder: every subfolder is a class, matched to the standard labels by name."""
    files: list[Path] = []
    labels: list[int] = []
    for class_dir in sorted(d for d in split_dir.iterdir() if d.is_dir()):
        label = resolve_label(task, class_dir.name, str(class_dir))
        found = _image_files(class_dir)
        files += found
        labels += [label] * len(found)
    return _file_source(task, files, labels, split_dir)


def _imagefolder_find(root: Path, task: str) -> Path | None:
    for name in DATASET_DIRS[task]:
        d = root / name
        if (d / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk also writes train/ and test/
            continue
        if any((d / s).is_dir() and any(c.is_dir() for c in (d / s).iterdir()) for s in ("train", "val", "test")):
            return d
    return None


def _imagefolder_expected(root: Path, task: str) -> str:
    return f"imagefolder {root}/{{{','.join(DATASET_DIRS[task])}}}/{{train,val,test}}/<class>/<image>"


def _imagefolder_read(location: Path, task: str, split: str) -> _Source | None:
    has_test = (location / "test").is_dir()
    if split == "validation":
        if not (has_test and (location / "val").is_dir()):
            return None
        folder = location / "val"
    elif split == "test":
        folder = location / ("test" if has_test else "val")
    else:
        folder = location / "train"
    if not folder.is_dir():
        raise DatasetError(f"{task}: split folder {folder} is missing (imagefolder layout "
                           f"{location}/{{train,val,test}}/<class>/<image>)")
    return _class_folders(task, folder)


# ----------------------------------------------------------------------------------------- torchvision


def _read_idx(path: Path, task: str) -> np.ndarray:
    """An idx (LeCun) uint8 array, memory-mapped when uncompressed."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8)
        else:
            data = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise DatasetError(f"{task}: cannot read idx file {path}: {exc}") from None
    if data.size < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DatasetError(f"{task}: {path} is not an unsigned-byte idx file (magic 00 00 08 <ndim>)")
    ndim = int(data[3])
    dims = tuple(int(d) for d in np.frombuffer(data[4:4 + 4 * ndim].tobytes(), dtype=">i4"))
    body = data[4 + 4 * ndim:]
    if len(dims) != ndim or body.size != int(np.prod(dims)):
        raise DatasetError(f"{task}: {path} holds {body.size} bytes after its header, expected shape {dims}")
    return body.reshape(dims)


def _first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _tv_mnist(root: Path, task: str, split: str) -> _Source | None:
    if split == "validation":
        return None
    raw = root / "MNIST" / "raw"
    prefix = "train" if split == "train" else "t10k"
    arrays, paths = [], []
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{prefix}-{kind}-ubyte"
        path = _first_existing(raw / name, raw / f"{name}.gz")
        if path is None:
            raise DatasetError(f"{task}: {raw / name} (or .gz) is missing (torchvision MNIST layout)")
        arrays.append(_read_idx(path, task))
        paths.append(path)
    images, labels = arrays
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DatasetError(f"{task}: {raw} holds images {images.shape} and labels {labels.shape}, expected "
                           "[N, H, W] and [N]")
    return _Source(labels.astype(np.int64), lambda i: Image.fromarray(np.asarray(images[i])), str(raw), tuple(paths))


def _svhn_dir(root: Path) -> Path | None:
    return next((d for d in (root / "svhn", root / "SVHN", root)
                 if any((d / f"{s}_32x32.mat").is_file() for s in ("train", "test"))), None)


def _tv_svhn(root: Path, task: str, split: str) -> _Source | None:
    if split == "validation":
        return None
    import scipy.io

    path = (_svhn_dir(root) or root / "svhn") / f"{split}_32x32.mat"
    if not path.is_file():
        raise DatasetError(f"{task}: {path} is missing (torchvision SVHN layout)")
    try:
        mat = scipy.io.loadmat(path)
    except (OSError, ValueError, NotImplementedError) as exc:
        raise DatasetError(f"{task}: cannot read {path}: {exc}") from None
    if "X" not in mat or "y" not in mat:
        raise DatasetError(f"{task}: {path} lacks the variables X and y")
    images = np.asarray(mat["X"], dtype=np.uint8)  # [32, 32, 3, N]
    labels = np.asarray(mat["y"], dtype=np.int64).reshape(-1)
    if labels.size and (labels.min() < 0 or labels.max() > 10):
        raise DatasetError(f"{task}: {path} has labels outside [1, 10]")
    labels = labels % 10  # SVHN stores the digit 0 as label 10
    if images.ndim != 4 or images.shape[2] != 3 or images.shape[3] != len(labels):
        raise DatasetError(f"{task}: {path} holds X {images.shape} and y of length {len(labels)}, expected "
                           "[H, W, 3, N] and N")
    return _Source(labels, lambda i: Image.fromarray(np.ascontiguousarray(images[:, :, :, i])), str(path), (path,))


def _eurosat_dir(root: Path) -> Path | None:
    return next((d for d in (root / "eurosat" / "2750", root / "2750", root / "EuroSAT_RGB",
                             root / "eurosat" / "EuroSAT_RGB") if d.is_dir()), None)


def eurosat_split_rows(n_per_class: Sequence[int], holdout: int = EUROSAT_HOLDOUT_PER_CLASS,
                       seed: int = EUROSAT_SPLIT_SEED) -> dict[str, list[np.ndarray]]:
    """Per class, a seeded permutation of its n files: the first ``holdout`` -> validation, the next
    ``holdout`` -> test, the rest -> train (sorted row numbers within the class)."""
    out: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for c, n in enumerate(n_per_class):
        perm = np.random.default_rng([seed, c]).permutation(n)
        out["validation"].append(np.sort(perm[:holdout]))
        out["test"].append(np.sort(perm[holdout:2 * holdout]))
        out["train"].append(np.sort(perm[2 * holdout:]))
    return out


def _tv_eurosat(root: Path, task: str, split: str) -> _Source:
    data = _eurosat_dir(root)
    if data is None:
        raise DatasetError(f"{task}: {root / 'eurosat' / '2750'} is missing (torchvision EuroSAT layout)")
    per_class: list[tuple[int, list[Path]]] = []
    for class_dir in sorted(d for d in data.iterdir() if d.is_dir()):
        files = _image_files(class_dir)
        if len(files) <= 2 * EUROSAT_HOLDOUT_PER_CLASS:
            raise DatasetError(f"{task}: {class_dir} has {len(files)} images; the seeded EuroSAT split needs more "
                               f"than {2 * EUROSAT_HOLDOUT_PER_CLASS} per class")
        per_class.append((resolve_label(task, class_dir.name, str(class_dir)), files))
    rows = eurosat_split_rows([len(f) for _, f in per_class], EUROSAT_HOLDOUT_PER_CLASS)[split]
    files = [f for (_, fs), r in zip(per_class, rows) for f in (fs[int(i)] for i in r)]
    labels = [lab for (lab, _), r in zip(per_class, rows) for _ in r]
    return _file_source(task, files, labels, data)


def _tv_gtsrb(root: Path, task: str, split: str) -> _Source | None:
    if split == "validation":
        return None
    base = root / "gtsrb"
    if split == "train":
        folder = base / "GTSRB" / "Training"
        if not folder.is_dir():
            raise DatasetError(f"{task}: {folder} is missing (torchvision GTSRB layout)")
        return _class_folders(task, folder)
    csv_path, images = base / "GT-final_test.csv", base / "GTSRB" / "Final_Test" / "Images"
    for path in (csv_path, images):
        if not path.exists():
            raise DatasetError(f"{task}: {path} is missing (torchvision GTSRB test layout)")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter=";", skipinitialspace=True))
    if rows and not {"Filename", "ClassId"} <= set(rows[0]):
        raise DatasetError(f"{task}: {csv_path} lacks the columns Filename and ClassId")
    labels = [int(r["ClassId"]) for r in rows]
    if any(not 0 <= lab < len(CLASSNAMES[task]) for lab in labels):
        raise DatasetError(f"{task}: {csv_path} has a ClassId outside [0, {len(CLASSNAMES[task])})")
    return _file_source(task, [images / r["Filename"] for r in rows], labels, csv_path, [csv_path])


def _dtd_dir(root: Path) -> Path | None:
    return next((d for d in (root / "dtd" / "dtd", root / "dtd")
                 if (d / "images").is_dir() and (d / "labels").is_dir()), None)


def _tv_dtd(root: Path, task: str, split: str) -> _Source:
    data = _dtd_dir(root) or root / "dtd" / "dtd"
    list_file = data / "labels" / f"{'val' if split == 'validation' else split}1.txt"
    if not list_file.is_file():
        raise DatasetError(f"{task}: {list_file} is missing (torchvision DTD layout, partition 1)")
    entries = [line.strip() for line in list_file.read_text().splitlines() if line.strip()]
    labels = [resolve_label(task, e.split("/")[0], str(list_file)) for e in entries]
    return _file_source(task, [data / "images" / e for e in entries], labels, list_file, [list_file])


def _load_mat(path: Path, task: str) -> dict:
    import scipy.io

    try:
        return scipy.io.loadmat(path, squeeze_me=True)
    except (OSError, ValueError, NotImplementedError) as exc:
        raise DatasetError(f"{task}: cannot read {path}: {exc}") from None


def _tv_cars(root: Path, task: str, split: str) -> _Source | None:
    if split == "validation":
        return None
    base = root / "stanford_cars"
    devkit = base / "devkit"
    if split == "train":
        annotations, images = devkit / "cars_train_annos.mat", base / "cars_train"
    else:
        name = "cars_test_annos_withlabels.mat"
        annotations = _first_existing(base / name, devkit / name) or base / name
        images = base / "cars_test"
    for path in (annotations, images):
        if not path.exists():
            raise DatasetError(f"{task}: {path} is missing (torchvision StanfordCars layout)")
    records = np.atleast_1d(_load_mat(annotations, task).get("annotations", np.empty(0)))
    if records.dtype.names is None or not {"fname", "class"} <= set(records.dtype.names):
        raise DatasetError(f"{task}: {annotations} lacks an 'annotations' struct with fields fname and class")
    classes = [int(r["class"]) - 1 for r in records]  # 1-based in the .mat files
    meta = devkit / "cars_meta.mat"
    read = [annotations, *([meta] if meta.is_file() else [])]
    if meta.is_file():  # map the file's class order onto the standard one by name
        names = [str(n) for n in np.atleast_1d(_load_mat(meta, task).get("class_names", np.empty(0)))]
        if any(not 0 <= c < len(names) for c in classes):
            raise DatasetError(f"{task}: {annotations} has a class outside the {len(names)} names of {meta}")
        order = [resolve_label(task, n, str(meta)) for n in names]
        classes = [order[c] for c in classes]
    elif any(not 0 <= c < len(CLASSNAMES[task]) for c in classes):
        raise DatasetError(f"{task}: {annotations} has a class outside [1, {len(CLASSNAMES[task])}]")
    return _file_source(task, [images / str(r["fname"]) for r in records], classes, annotations, read)


def _sun397_dir(root: Path) -> Path | None:
    return next((d for d in (root / "SUN397", root / "sun397")
                 if (d / "ClassName.txt").is_file() or (d / "Training_01.txt").is_file()), None)


def _tv_sun397(root: Path, task: str, split: str) -> _Source | None:
    if split == "validation":
        return None
    data = _sun397_dir(root) or root / "SUN397"
    list_file = data / f"{'Training' if split == 'train' else 'Testing'}_01.txt"
    if not list_file.is_file():
        raise DatasetError(f"{task}: {list_file} is missing (SUN397 layout with Partitions.zip, partition 1)")
    entries = [line.strip().lstrip("/") for line in list_file.read_text().splitlines() if line.strip()]
    labels = [resolve_label(task, "/".join(e.split("/")[:-1]), str(list_file)) for e in entries]
    return _file_source(task, [data / e for e in entries], labels, list_file, [list_file])


def _tv_resisc45(root: Path, task: str, split: str) -> _Source:
    base = root / "resisc45"
    images = base / "NWPU-RESISC45"
    list_file = base / f"resisc45-{'val' if split == 'validation' else split}.txt"
    for path in (images, list_file):
        if not path.exists():
            raise DatasetError(f"{task}: {path} is missing (torchgeo/task_vectors RESISC45 layout)")
    wanted = {line.strip() for line in list_file.read_text().splitlines() if line.strip()}
    files: list[Path] = []
    labels: list[int] = []
    for class_dir in sorted(d for d in images.iterdir() if d.is_dir()):
        found = [p for p in _image_files(class_dir) if p.name in wanted]
        if found:
            files += found
            labels += [resolve_label(task, class_dir.name, str(class_dir))] * len(found)
    return _file_source(task, files, labels, list_file, [list_file])


# task -> (where the layout lives, reader, expected layout for messages)
_TORCHVISION: dict[str, tuple[Callable[[Path], Path | None], Callable, str]] = {
    "MNIST": (lambda r: r / "MNIST" / "raw" if (r / "MNIST" / "raw").is_dir() else None, _tv_mnist,
              "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]"),
    "SVHN": (_svhn_dir, _tv_svhn, "svhn/{train,test}_32x32.mat"),
    "EuroSAT": (_eurosat_dir, _tv_eurosat, "eurosat/2750/<class>/*.jpg"),
    "GTSRB": (lambda r: r / "gtsrb" / "GTSRB" if (r / "gtsrb" / "GTSRB").is_dir() else None, _tv_gtsrb,
              "gtsrb/GTSRB/{Training/<class>,Final_Test/Images} + gtsrb/GT-final_test.csv"),
    "DTD": (_dtd_dir, _tv_dtd, "dtd/dtd/{images/<class>,labels/{train,val,test}1.txt}"),
    "Cars": (lambda r: r / "stanford_cars" if (r / "stanford_cars" / "devkit").is_dir() else None, _tv_cars,
             "stanford_cars/{devkit/{cars_meta,cars_train_annos}.mat,cars_train,cars_test_annos_withlabels.mat,"
             "cars_test}"),
    "SUN397": (_sun397_dir, _tv_sun397, "SUN397/{ClassName.txt,Training_01.txt,Testing_01.txt,<l>/<class>/*.jpg}"),
    "RESISC45": (lambda r: r / "resisc45" if (r / "resisc45" / "NWPU-RESISC45").is_dir() else None, _tv_resisc45,
                 "resisc45/{NWPU-RESISC45/<class>,resisc45-{train,val,test}.txt}"),
}


def _torchvision_find(root: Path, task: str) -> Path | None:
    return _TORCHVISION[task][0](root) if task in _TORCHVISION else None  # the eight tasks only


def _torchvision_expected(root: Path, task: str) -> str:
    if task not in _TORCHVISION:
        return f"torchvision (not read for {task})"
    return f"torchvision {root}/{_TORCHVISION[task][2]}"


def _torchvision_read(location: Path, task: str, split: str, root: Path) -> _Source | None:
    return _TORCHVISION[task][1](root, task, split)


# -------------------------------------------------------------------------------------------------- hf


_SPLIT_FILE = re.compile(r"^(?P<split>[A-Za-z_]+?)(?:-\d+-of-\d+.*)?\.parquet$")
_HF_SPLIT_NAMES = {"train": ("train",), "validation": ("validation", "valid", "val"), "test": ("test",)}


def _parquet_split(path: Path) -> str | None:
    """Split name of a hub parquet shard: ``train-00000-of-00003[-hash].parquet``, ``train.parquet`` or
    ``train/0000.parquet`` (the hub's parquet conversion)."""
    match = _SPLIT_FILE.match(path.name)
    if match:
        return match["split"]
    return path.parent.name if re.fullmatch(r"\d+\.parquet", path.name) else None


def _parquet_files(directory: Path) -> list[Path]:
    """Parquet shards at most three folders deep (``data/``, ``<config>/``, ``<config>/<split>/``)."""
    patterns = ("*.parquet", "*/*.parquet", "*/*/*.parquet", "*/*/*/*.parquet")
    return sorted(p for pattern in patterns for p in directory.glob(pattern) if _parquet_split(p))


_TAR_SPLIT = re.compile(r"^(?P<split>[A-Za-z_]+?)[-_]\d+\.tar$")
_WDS_IMAGE = ("jpg", "jpeg", "png", "webp")
_WDS_LABEL = ("cls", "label")


def _tar_split(path: Path) -> str | None:
    """Split name of a webdataset shard: ``test/0.tar`` (CLIP_benchmark's ``wds_*`` repositories, e.g.
    clip-benchmark/wds_fer2013, FusionBench's FER2013) or ``test-000000.tar``."""
    match = _TAR_SPLIT.match(path.name)
    if match:
        return match["split"]
    known = {name for names in _HF_SPLIT_NAMES.values() for name in names}
    return path.parent.name if re.fullmatch(r"\d+\.tar", path.name) and path.parent.name in known else None


def _tar_files(directory: Path) -> list[Path]:
    return sorted(p for pattern in ("*.tar", "*/*.tar") for p in directory.glob(pattern) if _tar_split(p))


def _hf_holds(d: Path) -> bool:
    return (d / "dataset_dict.json").is_file() or (d.is_dir() and bool(_parquet_files(d) or _tar_files(d)))


def is_hub_dataset_snapshot(root: Path) -> bool:
    """``root`` is a snapshot folder of a dataset repository in a Hugging Face cache
    (``datasets--<org>--<name>/snapshots/<revision>``, what ``mergecal.hub_cache`` resolves a hub id to): one
    dataset, whatever its name."""
    return root.parent.name == "snapshots" and root.parent.parent.name.startswith("datasets--")


def _hf_find(root: Path, task: str) -> Path | None:
    for name in DATASET_DIRS[task]:
        if _hf_holds(root / name):
            return root / name
    if is_hub_dataset_snapshot(root) and _hf_holds(root):  # a hub id named for this task: the task's own dataset
        return root
    return None


def _hf_expected(root: Path, task: str) -> str:
    dirs = "{" + ",".join(DATASET_DIRS[task]) + "}"
    return f"hf {root}/{dirs}/dataset_dict.json or {root}/{dirs}/**/{{train,test}}-*.parquet"


def hf_label_map(task: str, names: Sequence[str] | None, where: str) -> np.ndarray | None:
    """Dataset label -> standard label: by ClassLabel name when every name matches a class; ``None`` (labels
    kept) when there are no names or they do not match but their number equals the class count."""
    if not names:
        return None
    lookup = label_lookup(task)
    mapped = [lookup.get(_norm(n)) for n in names]
    if all(m is not None for m in mapped):
        return np.asarray(mapped, dtype=np.int64)
    if len(names) == len(CLASSNAMES[task]):
        return None
    bad = next(n for n, m in zip(names, mapped) if m is None)
    raise DatasetError(f"{task}: label names of {where} ({len(names)}, e.g. {bad!r}) match neither the "
                       f"{len(CLASSNAMES[task])} {task} classes nor their number")


def _hf_labels(task: str, raw: np.ndarray, names: Sequence[str] | None, where: str) -> np.ndarray:
    raw = np.asarray(raw, dtype=np.int64)
    mapping = hf_label_map(task, names, where)
    bound = len(mapping) if mapping is not None else len(CLASSNAMES[task])
    if raw.size and (raw.min() < 0 or raw.max() >= bound):
        raise DatasetError(f"{task}: labels of {where} lie in [{raw.min()}, {raw.max()}], expected [0, {bound})")
    return mapping[raw] if mapping is not None else raw


def _split_names(task: str, split: str) -> tuple[str, ...]:
    """The stored split names that hold ``split`` of ``task`` (none: the layout lacks it)."""
    test = _HF_TEST_SPLIT.get(task)
    if test is None:
        return _HF_SPLIT_NAMES[split]
    return {"test": (test,), "validation": ()}.get(split, _HF_SPLIT_NAMES[split])


def _pick_columns(task: str, columns: Sequence[str], where: str) -> tuple[str, str]:
    image = next((c for c in ("image", "img") if c in columns), None)
    label = next((c for c in _LABEL_COLUMNS.get(task, ("label", "labels")) if c in columns), None)
    if image is None or label is None:
        raise DatasetError(f"{task}: {where} has columns {list(columns)}, expected an 'image' and a 'label' column")
    return image, label


def _hf_disk(location: Path, task: str, split: str) -> _Source | None:
    from datasets import load_from_disk

    splits = json.loads((location / "dataset_dict.json").read_text()).get("splits", [])
    key = next((s for s in _split_names(task, split) if s in splits), None)
    if key is None:
        if split == "validation":
            return None
        raise DatasetError(f"{task}: {location} has splits {splits}, no {split!r} (DatasetDict.save_to_disk layout)")
    try:
        ds = load_from_disk(str(location / key))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{task}: cannot load {location / key}: {exc}") from None
    where = str(location / key)
    image, label = _pick_columns(task, ds.column_names, where)
    ds = ds.select_columns([image, label])
    names = getattr(ds.features[label], "names", None)
    labels = _hf_labels(task, np.asarray(ds.with_format("numpy")[label]), names, where)
    read = [location / "dataset_dict.json", *(location / key / name for name in ("dataset_info.json", "state.json")
                                               if (location / key / name).is_file()),
            *(Path(f["filename"]) for f in ds.cache_files)]
    return _Source(labels, lambda i: _to_pil(ds[int(i)][image], location / key, task), where, tuple(read))


def _hf_parquet(location: Path, task: str, split: str) -> _Source | None:
    import pyarrow.parquet as pq

    files = [p for p in _parquet_files(location) if _parquet_split(p) in _split_names(task, split)]
    groups = sorted({p.parent for p in files})
    if len(groups) > 1:
        preferred = [g for g in groups if g.name in (_HF_PREFERRED_CONFIG.get(task), "data")]
        if len(preferred) != 1:
            raise DatasetError(f"{task}: {split} parquet shards in several folders of {location} "
                               f"({', '.join(g.name for g in groups)}); point ROOT at one configuration")
        files = [p for p in files if p.parent == preferred[0]]
    if not files:
        if split == "validation":
            return None
        raise DatasetError(f"{task}: no {split}-*.parquet shard under {location} (hf parquet layout)")
    where = str(files[0].parent / f"{_parquet_split(files[0])}-*.parquet")
    handles = [pq.ParquetFile(p) for p in files]
    image, label = _pick_columns(task, handles[0].schema_arrow.names, str(files[0]))
    names = None
    meta = handles[0].schema_arrow.metadata or {}
    if b"huggingface" in meta:
        feature = json.loads(meta[b"huggingface"]).get("info", {}).get("features", {}).get(label, {})
        names = feature.get("names") if isinstance(feature, dict) else None
    raw = np.concatenate([h.read(columns=[label]).column(0).to_numpy() for h in handles])
    labels = _hf_labels(task, raw, names, where)
    groups_rows = [(h, g, h.metadata.row_group(g).num_rows) for h in handles for g in range(h.num_row_groups)]
    starts = np.cumsum([0] + [n for _, _, n in groups_rows])
    cache: dict = {}

    def load(i: int) -> Image.Image:
        g = int(np.searchsorted(starts, i, side="right")) - 1
        if cache.get("group") != g:  # keep one decoded row group: sequential batches read each group once
            handle, group, _ = groups_rows[g]
            cache.update(group=g, rows=handle.read_row_group(group, columns=[image]).column(0).to_pylist())
        return _to_pil(cache["rows"][i - starts[g]], location, task)

    return _Source(labels, load, where, tuple(files))


def _hf_webdataset(location: Path, task: str, split: str) -> _Source | None:
    """Webdataset tar shards (what ``datasets`` reads from such a repository): members ``<key>.<field>``, an image
    field (jpg, png, webp) and an integer label (``cls``) per key, in shard and member order. Labels are taken
    as the standard class order (CLIP_benchmark writes its classnames.txt in it)."""
    import tarfile

    files = [p for p in _tar_files(location) if _tar_split(p) in _split_names(task, split)]
    if not files:
        if split == "validation":
            return None
        raise DatasetError(f"{task}: no {split} webdataset shard (<split>/<n>.tar) under {location}")
    where = str(files[0].parent / "*.tar")
    images: list[tuple[Path, int, int]] = []  # (shard, offset, size) of each example's image
    labels: list[int] = []
    for path in files:
        examples: dict[str, dict[str, tarfile.TarInfo]] = {}
        try:
            with tarfile.open(path) as tar:
                for member in tar:
                    if member.isfile() and "." in Path(member.name).name:
                        key, field = member.name.split("/")[-1].split(".", 1)
                        examples.setdefault(f"{Path(member.name).parent}/{key}", {})[field.lower()] = member
                for key, fields in examples.items():
                    image = next((fields[f] for f in _WDS_IMAGE if f in fields), None)
                    label = next((fields[f] for f in _WDS_LABEL if f in fields), None)
                    if image is None or label is None:
                        raise DatasetError(f"{task}: example {key!r} of {path} has fields {sorted(fields)}, expected "
                                           f"an image ({', '.join(_WDS_IMAGE)}) and a label ({', '.join(_WDS_LABEL)})")
                    text = tar.extractfile(label).read().decode().strip()
                    if not re.fullmatch(r"\d+", text):
                        raise DatasetError(f"{task}: label of {key!r} in {path} is {text[:20]!r}, expected an integer")
                    labels.append(int(text))
                    images.append((path, image.offset_data, image.size))
        except (OSError, tarfile.TarError, UnicodeDecodeError) as exc:  # a label that is not text, too
            raise DatasetError(f"{task}: cannot read webdataset shard {path}: {exc}") from None
    labels_array = _hf_labels(task, np.asarray(labels, dtype=np.int64), None, where)

    def load(i: int) -> Image.Image:
        path, offset, size = images[i]
        with open(path, "rb") as f:
            f.seek(offset)
            return _to_pil({"bytes": f.read(size)}, path, task)

    return _Source(labels_array, load, where, tuple(files))


def _hf_read(location: Path, task: str, split: str, root: Path) -> _Source | None:
    if (location / "dataset_dict.json").is_file():
        return _hf_disk(location, task, split)
    if not _parquet_files(location) and _tar_files(location):
        return _hf_webdataset(location, task, split)
    return _hf_parquet(location, task, split)


# --------------------------------------------------------------------------------------------- loading


_LAYOUT_FUNCS = {
    "imagefolder": (_imagefolder_find, _imagefolder_expected,
                    lambda loc, task, split, root: _imagefolder_read(loc, task, split)),
    "torchvision": (_torchvision_find, _torchvision_expected, _torchvision_read),
    "hf": (_hf_find, _hf_expected, _hf_read),
}


def expected_layouts(root: str | os.PathLike, name: str, layout: str = "auto") -> str:
    """Where each layout tried would find the task under ``root`` (for messages)."""
    task, root = canonical_task(name), Path(root).expanduser()
    return "; ".join(_LAYOUT_FUNCS[lay][1](root, task) for lay in (LAYOUTS if layout == "auto" else (layout,)))


def find_layout(root: str | os.PathLike, name: str, layout: str = "auto") -> tuple[str, Path]:
    """(layout, location) of a task under ``root``; a DatasetError naming the paths tried when absent."""
    task = canonical_task(name)
    if layout != "auto" and layout not in LAYOUTS:
        raise UnknownNameError(f"unknown dataset layout {layout!r}; expected auto, {', '.join(LAYOUTS)}")
    root = Path(root).expanduser()
    tried = LAYOUTS if layout == "auto" else (layout,)
    expected = expected_layouts(root, task, layout)
    if not root.is_dir():
        raise DatasetError(f"{task}: data root {root} does not exist or is not a directory (expected {expected})")
    for lay in tried:
        location = _LAYOUT_FUNCS[lay][0](root, task)
        if location is not None:
            return lay, location
    raise DatasetError(f"{task}: no {task} data under {root} (expected {expected})")


def dataset_files(root: str | os.PathLike, name: str, layout: str = "auto") -> list[Path]:
    """The files a task's splits are read from, as each split's reader names them (label and list files,
    images, shards; a validation split taken from train reads train's): no other file under ``root``. A split
    that cannot be read adds nothing (reading it names what is wrong), and when none can, the first split's
    error is raised (a layout that holds the task but does not fit it: 12 classes for a 10-class head); no layout
    found is a DatasetError."""
    task = canonical_task(name)
    found, location = find_layout(root, task, layout)
    read = _LAYOUT_FUNCS[found][2]
    files: dict[Path, None] = {}
    errors: list[MergecalError] = []
    for split in SPLITS:
        try:
            source = read(location, task, split, Path(root).expanduser())
        except MergecalError as err:
            errors.append(err)
            continue
        files.update(dict.fromkeys(source.files if source is not None else ()))
    if not files and errors:
        raise errors[0]
    return list(files)


def load_real_split(root: str | os.PathLike, name: str, split: str, *, layout: str = "auto",
                    seed: int = 0) -> RealSplit:
    """One split of a real task from local files (see the module docstring for the layouts). ``seed`` picks
    the validation subset of train where the layout has no validation split of its own."""
    task = canonical_task(name)
    split = "validation" if split == "val" else split
    if split not in SPLITS:
        raise ParameterError(f"{task}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    found, location = find_layout(root, task, layout)
    read = _LAYOUT_FUNCS[found][2]
    root = Path(root).expanduser()
    source = read(location, task, split, root)
    if source is None:  # validation = task_vectors' held-out part of train
        train = read(location, task, "train", root)
        source = train.subset(validation_indices(len(train.labels), seed=seed))
    classnames, templates = task_metadata(task)
    return RealSplit(task, split, source.labels, classnames, templates, found, source.location, source)
