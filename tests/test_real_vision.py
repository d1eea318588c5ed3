"""Real-dataset loaders on tiny fake copies written in each dataset's own on-disk formats (tmp_path only)."""

import csv
import gzip
import struct

import numpy as np
import pytest
import scipy.io
from PIL import Image

from mergecal.data import real_vision as rv
from mergecal.data.real_vision import (REAL_TASKS, DatasetError, clip_resize, hf_label_map, load_real_split,
                                       resolve_label, task_metadata)
from mergecal.data.real_vision_metadata import CLASSNAMES, TEMPLATES
from mergecal.data.vision import validation_indices
from mergecal.errors import MergecalError, ParameterError, UnknownNameError


def pixels(seed: int, h: int = 6, w: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def save(path, array: np.ndarray, fmt: str = "PNG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)


def torchvision_datasets():
    import torchvision.datasets

    return torchvision.datasets


def check_images(split, expected: list[np.ndarray]) -> None:
    """Stored images come back bit-exact at their own size (no resize), uint8 RGB [n, s, s, 3]."""
    size = expected[0].shape[0]
    got = split.images(range(len(expected)), size)
    assert got.dtype == np.uint8 and got.shape == (len(expected), size, size, 3)
    np.testing.assert_array_equal(got, np.stack(expected))


# ---------------------------------------------------------------------------------------------- metadata


def test_metadata_class_counts_and_templates():
    counts = {"SUN397": 397, "Cars": 196, "RESISC45": 45, "EuroSAT": 10, "SVHN": 10, "GTSRB": 43, "MNIST": 10,
              "DTD": 47}
    assert set(REAL_TASKS) == set(counts)
    for task, n in counts.items():
        classnames, templates = task_metadata(task)
        assert len(classnames) == n and len(set(classnames)) == n
        assert templates and all(t.count("{}") == 1 for t in templates)
        rv.label_lookup(task)  # raises if two classes share a matching key
    assert task_metadata("stanford_cars")[0][0] == "AM General Hummer SUV 2000"
    assert TEMPLATES["MNIST"][0].format("7") == 'a photo of the number: "7".'
    assert CLASSNAMES["EuroSAT"][9] == "lake or sea" and CLASSNAMES["DTD"][-1] == "zigzagged"


def test_on_disk_class_names_resolve():
    sun = CLASSNAMES["SUN397"]
    assert resolve_label("SUN397", "a/apartment_building/outdoor", "x") == sun.index("apartment building outdoor")
    assert resolve_label("SUN397", "a_abbey", "x") == 0 and resolve_label("SUN397", "youth_hostel", "x") == 396
    assert resolve_label("EuroSAT", "SeaLake", "x") == 9 and resolve_label("EuroSAT", "Industrial", "x") == 4
    assert resolve_label("GTSRB", "00042", "x") == 42
    assert resolve_label("MNIST", "3 - three", "x") == 3
    assert resolve_label("RESISC45", "thermal_power_station", "x") == 43
    assert resolve_label("Cars", "Ram C-V Cargo Van Minivan 2012", "x") == CLASSNAMES["Cars"].index(
        "Ram C/V Cargo Van Minivan 2012")
    with pytest.raises(DatasetError, match="'not_a_texture' in /some/dir"):
        resolve_label("DTD", "not_a_texture", "/some/dir")


def test_clip_resize_matches_torchvision_resize_and_center_crop():
    from torchvision import transforms

    reference = transforms.Compose([transforms.Resize(16, interpolation=transforms.InterpolationMode.BICUBIC),
                                    transforms.CenterCrop(16)])
    for h, w in [(37, 23), (23, 37), (16, 40), (9, 9)]:
        image = Image.fromarray(pixels(h * w, h, w))
        np.testing.assert_array_equal(clip_resize(image, 16), np.asarray(reference(image)))
    gray = Image.fromarray(pixels(1, 8, 8)[:, :, 0])  # MNIST-like L image -> replicated RGB
    np.testing.assert_array_equal(clip_resize(gray, 8), np.repeat(np.asarray(gray)[:, :, None], 3, axis=2))


def test_the_floor_crop_is_hugging_faces_and_differs_only_on_odd_margins():
    """center_crop "floor": where Hugging Face's CLIPImageProcessor (FusionBench's preprocessing) puts the crop,
    (margin) // 2; "round" is torchvision's round(margin / 2): one pixel apart on an odd margin, equal on an even
    one (scripts/compare_fusionbench_eval.py: with floor, FusionBench's predictions example for example)."""
    from mergecal.errors import ParameterError

    odd = pixels(10 * 13, 13, 10)  # width 10 = the size: no resize, a vertical margin of 3
    image = Image.fromarray(odd)
    np.testing.assert_array_equal(clip_resize(image, 10, crop="floor"), odd[1:11])
    np.testing.assert_array_equal(clip_resize(image, 10, crop="round"), odd[2:12])  # round(1.5) = 2
    even = Image.fromarray(pixels(10 * 14, 14, 10))
    np.testing.assert_array_equal(clip_resize(even, 10, crop="floor"), clip_resize(even, 10))
    with pytest.raises(ParameterError, match=r"^crop: expected one of round, floor, got 'ceil'$"):
        clip_resize(image, 10, crop="ceil")


# ------------------------------------------------------------------------------------- torchvision layouts


def write_idx(path, array: np.ndarray, compress: bool = False) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if compress else data)


def test_mnist_idx_files_and_seeded_validation(tmp_path):
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8), rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    y_train, y_test = np.arange(20) % 10, np.array([9, 8, 7, 6, 5])
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", train)
    write_idx(raw / "train-labels-idx1-ubyte", y_train)
    write_idx(raw / "t10k-images-idx3-ubyte", test)
    write_idx(raw / "t10k-labels-idx1-ubyte", y_test)
    gz = tmp_path / "gz" / "MNIST" / "raw"  # torchvision's archives, not yet extracted
    write_idx(gz / "t10k-images-idx3-ubyte.gz", test, compress=True)
    write_idx(gz / "t10k-labels-idx1-ubyte.gz", y_test, compress=True)

    split = load_real_split(tmp_path, "mnist", "train")
    assert (split.name, split.layout, len(split)) == ("MNIST", "torchvision", 20)
    assert split.labels.dtype == np.int64 and split.labels.tolist() == y_train.tolist()
    assert split.classnames == [str(d) for d in range(10)]
    check_images(split, [np.repeat(im[:, :, None], 3, axis=2) for im in train])
    tv = torchvision_datasets().MNIST(tmp_path, train=True, download=False)  # the same files, torchvision's reader
    assert tv.targets.tolist() == split.labels.tolist()
    np.testing.assert_array_equal(tv.data.numpy(), train)
    for root in (tmp_path, tmp_path / "gz"):
        te = load_real_split(root, "MNIST", "test")
        assert te.labels.tolist() == y_test.tolist()
        np.testing.assert_array_equal(te.images([4], 28)[0, :, :, 1], test[4])

    val = load_real_split(tmp_path, "MNIST", "validation")
    rows = validation_indices(20, seed=0)
    assert len(val) == len(rows) == 2 and val.labels.tolist() == y_train[rows].tolist()
    np.testing.assert_array_equal(val.images(range(len(rows)), 28)[..., 0], train[rows])
    batches = list(split.iter_batches(8, 14))
    assert [len(b[1]) for b in batches] == [8, 8, 4] and batches[0][0].shape == (8, 14, 14, 3)
    assert np.concatenate([b[1] for b in batches]).tolist() == y_train.tolist()


def test_svhn_mat_files(tmp_path):
    x = np.random.default_rng(1).integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
    (tmp_path / "svhn").mkdir()
    scipy.io.savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": x, "y": np.array([[10], [1], [2], [10]], np.uint8)})
    split = load_real_split(tmp_path, "SVHN", "test")
    assert split.labels.tolist() == [0, 1, 2, 0]  # SVHN's label 10 is the digit 0
    check_images(split, [x[:, :, :, i] for i in range(4)])
    with pytest.raises(DatasetError, match=r"train_32x32\.mat is missing"):
        load_real_split(tmp_path, "SVHN", "train")


def test_eurosat_torchvision_layout_split_is_seeded_disjoint_and_complete(tmp_path, monkeypatch):
    monkeypatch.setattr(rv, "EUROSAT_HOLDOUT_PER_CLASS", 1)
    images = {}
    for c, name in enumerate(["AnnualCrop", "Forest", "SeaLake"]):
        for k in range(4):
            images[(c, k)] = pixels(10 * c + k)
            save(tmp_path / "eurosat" / "2750" / name / f"{name}_{k}.jpg", images[(c, k)], "PNG")
    seen = []
    for split_name, per_class in [("train", 2), ("validation", 1), ("test", 1)]:
        split = load_real_split(tmp_path, "EuroSAT", split_name)
        assert sorted(split.labels.tolist()) == sorted([0, 1, 9] * per_class)
        seen += [im.tobytes() for im in split.images(range(len(split)), 5)]
    assert len(seen) == 12 and len(set(seen)) == 12  # every file in exactly one split
    again = load_real_split(tmp_path, "EuroSAT", "test")
    assert [again.images([i], 5)[0].tobytes() for i in range(3)] == seen[-3:]


def test_gtsrb_training_folders_and_test_csv(tmp_path):
    base = tmp_path / "gtsrb"
    train = [pixels(i) for i in range(3)]
    save(base / "GTSRB" / "Training" / "00000" / "00000_00000.ppm", train[0], "PPM")
    save(base / "GTSRB" / "Training" / "00000" / "00000_00001.ppm", train[1], "PPM")
    save(base / "GTSRB" / "Training" / "00014" / "00000_00000.ppm", train[2], "PPM")
    (base / "GTSRB" / "Training" / "00000" / "GT-00000.csv").write_text("not an image\n")
    test = [pixels(10 + i) for i in range(2)]
    for i, im in enumerate(test):
        save(base / "GTSRB" / "Final_Test" / "Images" / f"{i:05d}.ppm", im, "PPM")
    with open(base / "GT-final_test.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter=";")
        writer.writerow(["Filename", "Width", "Height", "Roi.X1", "Roi.Y1", "Roi.X2", "Roi.Y2", "ClassId"])
        writer.writerows([["00000.ppm", 5, 6, 0, 0, 4, 5, 42], ["00001.ppm", 5, 6, 0, 0, 4, 5, 14]])
    tr = load_real_split(tmp_path, "GTSRB", "train")
    assert tr.labels.tolist() == [0, 0, 14] and len(tr.classnames) == 43
    check_images(tr, train)
    te = load_real_split(tmp_path, "GTSRB", "test")
    assert te.labels.tolist() == [42, 14] and te.classnames[14] == "stop"
    check_images(te, test)
    tv = torchvision_datasets().GTSRB(tmp_path, split="test", download=False)  # (its train labels are folder ranks)
    assert [t for _, t in tv._samples] == te.labels.tolist()


def test_dtd_torchvision_and_imagefolder_layouts(tmp_path):
    data = tmp_path / "tv" / "dtd" / "dtd"
    ims = {}
    for cls in ("banded", "zigzagged"):
        for k in range(3):
            ims[f"{cls}/{cls}_{k:04d}.png"] = pixels(len(ims))
            save(data / "images" / cls / f"{cls}_{k:04d}.png", ims[f"{cls}/{cls}_{k:04d}.png"])
    names = list(ims)
    (data / "labels").mkdir()
    for split, entries in [("train", names[0:1] + names[3:4]), ("val", names[1:2]), ("test", names[2:3] + names[5:])]:
        (data / "labels" / f"{split}1.txt").write_text("\n".join(entries) + "\n")
    te = load_real_split(tmp_path / "tv", "DTD", "test")
    assert te.labels.tolist() == [0, 46] and te.classnames[46] == "zigzagged"
    check_images(te, [ims[names[2]], ims[names[5]]])
    tv = torchvision_datasets().DTD(tmp_path / "tv", split="test", download=False)
    assert [resolve_label("DTD", tv.classes[t], "tv") for t in tv._labels] == te.labels.tolist()
    val = load_real_split(tmp_path / "tv", "DTD", "validation")  # DTD's own val1.txt
    assert val.labels.tolist() == [0]
    check_images(val, [ims[names[1]]])

    folder = tmp_path / "if" / "dtd"
    save(folder / "train" / "banded" / "a.png", ims[names[0]])
    save(folder / "train" / "polka-dotted" / "b.png", ims[names[3]])
    save(folder / "val" / "zigzagged" / "c.png", ims[names[5]])  # the preprocessing script's val = test1.txt
    tr = load_real_split(tmp_path / "if", "DTD", "train")
    assert tr.layout == "imagefolder" and tr.labels.tolist() == [0, CLASSNAMES["DTD"].index("polka-dotted")]
    te = load_real_split(tmp_path / "if", "DTD", "test")
    assert te.labels.tolist() == [46]
    check_images(te, [ims[names[5]]])


def write_cars(base, train: list[np.ndarray], classes: list[int], meta_names: list[str]) -> None:
    devkit = base / "devkit"
    devkit.mkdir(parents=True)
    scipy.io.savemat(devkit / "cars_meta.mat", {"class_names": np.array(meta_names, dtype=object)[None, :]})
    annotations = np.array([(f"{i:05d}.png", c) for i, c in enumerate(classes)],
                           dtype=[("fname", object), ("class", object)])
    scipy.io.savemat(devkit / "cars_train_annos.mat", {"annotations": annotations[None, :]})
    for i, im in enumerate(train):
        save(base / "cars_train" / f"{i:05d}.png", im)


def test_stanford_cars_mat_annotations(tmp_path):
    names = list(CLASSNAMES["Cars"])
    train = [pixels(i) for i in range(3)]
    write_cars(tmp_path / "a" / "stanford_cars", train, [1, 196, 50], names)
    split = load_real_split(tmp_path / "a", "Cars", "train")
    assert split.labels.tolist() == [0, 195, 49] and split.classnames == names
    check_images(split, train)
    tv = torchvision_datasets().StanfordCars(tmp_path / "a", split="train", download=False)
    assert [t for _, t in tv._samples] == split.labels.tolist()
    # a devkit whose class order differs is mapped onto the standard order by name
    write_cars(tmp_path / "b" / "stanford_cars", train, [1, 2, 3], names[::-1])
    assert load_real_split(tmp_path / "b", "Cars", "train").labels.tolist() == [195, 194, 193]
    with pytest.raises(DatasetError, match="cars_test_annos_withlabels.mat is missing"):
        load_real_split(tmp_path / "a", "Cars", "test")


def test_sun397_partition_files(tmp_path):
    data = tmp_path / "SUN397"
    entries = ["/a/abbey/sun_aaa.png", "/a/apartment_building/outdoor/sun_bbb.png", "/y/youth_hostel/sun_ccc.png"]
    ims = [pixels(i, 9, 7) for i in range(3)]
    for e, im in zip(entries, ims):
        save(data / e.lstrip("/"), im)
    (data / "ClassName.txt").write_text("/a/abbey\n/a/apartment_building/outdoor\n/y/youth_hostel\n")
    (data / "Training_01.txt").write_text("\n".join(entries[:2]) + "\n")
    split = load_real_split(tmp_path, "SUN397", "train")
    assert split.labels.tolist() == [0, 8] and split.classnames[8] == "apartment building outdoor"
    got = split.images([0, 1], 4)
    np.testing.assert_array_equal(got[1], clip_resize(Image.fromarray(ims[1]), 4))
    with pytest.raises(DatasetError, match=r"Testing_01\.txt is missing"):
        load_real_split(tmp_path, "SUN397", "test")


def test_resisc45_split_files(tmp_path):
    base = tmp_path / "resisc45"
    ims = {}
    for cls in ("airplane", "wetland"):
        for k in range(1, 4):
            ims[f"{cls}_{k:03d}.jpg"] = pixels(len(ims))
            save(base / "NWPU-RESISC45" / cls / f"{cls}_{k:03d}.jpg", ims[f"{cls}_{k:03d}.jpg"])
    (base / "resisc45-train.txt").write_text("airplane_001.jpg\nwetland_001.jpg\nwetland_002.jpg\n")
    (base / "resisc45-val.txt").write_text("airplane_002.jpg\n")
    (base / "resisc45-test.txt").write_text("airplane_003.jpg\nwetland_003.jpg\n")
    tr = load_real_split(tmp_path, "RESISC45", "train")
    assert tr.labels.tolist() == [0, 44, 44] and tr.classnames[44] == "wetland"
    check_images(tr, [ims["airplane_001.jpg"], ims["wetland_001.jpg"], ims["wetland_002.jpg"]])
    val = load_real_split(tmp_path, "RESISC45", "val")
    assert val.split == "validation" and val.labels.tolist() == [0]
    assert load_real_split(tmp_path, "RESISC45", "test").labels.tolist() == [0, 44]


def test_imagefolder_eurosat_splits_with_own_val(tmp_path):
    ims = {}
    for split in ("train", "val", "test"):
        for name in ("AnnualCrop", "Forest", "SeaLake"):
            ims[(split, name)] = pixels(len(ims))
            save(tmp_path / "EuroSAT_splits" / split / name / "x.jpg", ims[(split, name)])
    val = load_real_split(tmp_path, "EuroSAT", "validation")
    assert val.layout == "imagefolder" and val.labels.tolist() == [0, 1, 9]
    assert val.classnames[0] == "annual crop land" and val.templates[0] == "a centered satellite photo of {}."
    check_images(val, [ims[("val", n)] for n in ("AnnualCrop", "Forest", "SeaLake")])
    save(tmp_path / "EuroSAT_splits" / "test" / "Glacier" / "y.jpg", pixels(99))
    with pytest.raises(DatasetError, match=r"class 'Glacier' in .*EuroSAT_splits/test/Glacier"):
        load_real_split(tmp_path, "EuroSAT", "test")


# ---------------------------------------------------------------------------------------------- hf layouts


def hf_dataset(images: list[np.ndarray], labels: list[int], names: list[str]):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return datasets.Dataset.from_dict({"image": [Image.fromarray(im) for im in images], "label": labels},
                                      features=features)


def test_hf_parquet_shards_with_class_label_names(tmp_path):
    import pyarrow.parquet as pq

    ims = [pixels(i) for i in range(5)]
    ds = hf_dataset(ims, [0, 1, 1, 0, 1], ["abbey", "youth_hostel"])
    data = tmp_path / "sun397" / "data"
    data.mkdir(parents=True)
    table = ds.data.table
    pq.write_table(table.slice(0, 3), data / "train-00000-of-00002.parquet", row_group_size=2)
    pq.write_table(table.slice(3), data / "train-00001-of-00002.parquet", row_group_size=2)
    pq.write_table(table.slice(0, 2), data / "test-00000-of-00001.parquet")
    tr = load_real_split(tmp_path, "SUN397", "train", layout="hf")
    assert tr.layout == "hf" and tr.labels.tolist() == [0, 396, 396, 0, 396]
    check_images(tr, ims)
    np.testing.assert_array_equal(tr.images([4, 0, 2], 6), np.stack([ims[4], ims[0], ims[2]]))
    assert load_real_split(tmp_path, "SUN397", "test").labels.tolist() == [0, 396]
    val = load_real_split(tmp_path, "SUN397", "validation", seed=3)  # no validation shards: subset of train
    rows = validation_indices(5, seed=3)
    assert val.labels.tolist() == tr.labels[rows].tolist()


def test_hf_save_to_disk_dataset_dict(tmp_path):
    import datasets

    names = [CLASSNAMES["Cars"][5], CLASSNAMES["Cars"][0]]
    ims = [pixels(i) for i in range(4)]
    dd = datasets.DatasetDict(train=hf_dataset(ims[:3], [0, 1, 0], names), test=hf_dataset(ims[3:], [1], names))
    dd.save_to_disk(str(tmp_path / "stanford_cars"))
    tr = load_real_split(tmp_path, "Cars", "train")
    assert tr.layout == "hf" and tr.labels.tolist() == [5, 0, 5]
    check_images(tr, ims[:3])
    te = load_real_split(tmp_path, "Cars", "test")
    assert te.labels.tolist() == [0]
    check_images(te, ims[3:])


def test_hf_label_names_mapping_rules():
    assert hf_label_map("MNIST", None, "x") is None
    assert hf_label_map("EuroSAT", ["SeaLake", "AnnualCrop"], "x").tolist() == [9, 0]
    assert hf_label_map("MNIST", [f"digit {d}" for d in range(10)], "x") is None  # right count: kept as is
    with pytest.raises(DatasetError, match="match neither"):
        hf_label_map("MNIST", ["cat", "dog"], "x")


# -------------------------------------------------------------------------------------------------- errors


def test_missing_root_and_missing_layout_errors_name_the_path(tmp_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(DatasetError) as info:
        load_real_split(missing, "MNIST", "test")
    message = str(info.value)
    assert "\n" not in message and str(missing) in message and "MNIST/raw" in message
    assert isinstance(info.value, MergecalError)
    with pytest.raises(DatasetError) as info:
        load_real_split(tmp_path, "GTSRB", "train")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message
    assert all(lay in message for lay in ("imagefolder", "torchvision", "hf")) and "gtsrb/GTSRB" in message
    with pytest.raises(DatasetError, match="imagefolder") as info:
        load_real_split(tmp_path, "DTD", "train", layout="imagefolder")
    assert "torchvision" not in str(info.value)


def test_unknown_names_and_bad_arguments(tmp_path):
    with pytest.raises(UnknownNameError, match="SUN397, Cars, RESISC45"):
        load_real_split(tmp_path, "ImageNet", "test")
    with pytest.raises(UnknownNameError, match="layout"):
        load_real_split(tmp_path, "DTD", "test", layout="zip")
    with pytest.raises(ParameterError, match="split"):
        load_real_split(tmp_path, "DTD", "dev")
    folder = tmp_path / "dtd" / "train" / "banded"
    save(folder / "a.png", pixels(0))
    split = load_real_split(tmp_path, "DTD", "train")
    with pytest.raises(ParameterError, match=r"indices must lie in \[0, 1\)"):
        split.images([1], 4)
    with pytest.raises(ParameterError, match="batch_size"):
        next(split.iter_batches(0, 4))
    (folder / "b.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"cannot read image .*b\.png"):
        load_real_split(tmp_path, "DTD", "train").images([1], 4)


# ------------------------------------------------------------------------- the TALL-mask tasks (14- and 20-task sets)


def test_the_tall_tasks_have_their_datasets_class_counts_and_one_placeholder_templates():
    from mergecal.data.real_vision_metadata import TASK_SETS, VISION_TASKS

    # the datasets' own class counts (their papers / torchvision), not FusionBench's lists
    counts = {"Flowers102": 102, "PCAM": 2, "FER2013": 7, "OxfordIIITPet": 37, "STL10": 10, "CIFAR100": 100,
              "CIFAR10": 10, "Food101": 101, "FashionMNIST": 10, "EMNIST": 26, "KMNIST": 10, "RenderedSST2": 2}
    assert VISION_TASKS == REAL_TASKS + tuple(counts)
    assert [len(TASK_SETS[s]) for s in ("ta8", "tall14", "tall20")] == [8, 14, 20]
    assert TASK_SETS["tall14"][8:] == ("Flowers102", "PCAM", "FER2013", "OxfordIIITPet", "STL10", "CIFAR100")
    for task, n in counts.items():
        classnames, templates = task_metadata(task)
        assert len(classnames) == n and len(set(classnames)) == n, task
        assert templates and all(t.count("{}") == 1 and t.count("{") == 1 for t in templates), task
        rv.label_lookup(task)  # raises if two classes share a matching key (KMNIST's hiragana included)
    # FusionBench's spellings of the task names, and a few of its prompts as it writes them
    assert [rv.canonical_task(n) for n in ("oxford_flowers102", "oxford-iiit-pet", "emnist_letters", "fashion_mnist",
                                           "rendered-sst2", "pcam", "fer2013")] == [
        "Flowers102", "OxfordIIITPet", "EMNIST", "FashionMNIST", "RenderedSST2", "PCAM", "FER2013"]
    assert TEMPLATES["Food101"] == ("a photo of {}, a type of food.",)
    assert TEMPLATES["EMNIST"][0].format("A") == 'a photo of the digit character: "A".'
    assert CLASSNAMES["CIFAR100"][1] == "aquarium_fish" and CLASSNAMES["KMNIST"][0] == "お"
    assert resolve_label("KMNIST", "き", "here") == 1 and resolve_label("PCAM", "Lymph_Node", "here") == 0


def write_webdataset(path, examples: list[tuple[str, bytes, str | bytes]]) -> None:
    """A webdataset shard: for each (key, image bytes, label text) the members <key>.png and <key>.cls."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, image, label in examples:
            for name, data in ((f"{key}.png", image), (f"{key}.cls", label if isinstance(label, bytes) else
                                                          label.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def png_bytes(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_fer2013_from_clip_benchmarks_webdataset_shards(tmp_path):
    """clip-benchmark/wds_fer2013 as FusionBench reads it: ``<split>/<n>.tar`` of ``<key>.{jpg,cls}``; labels and
    pixels in shard and member order, no validation shards (held out of train), bad shards named in one line."""
    root = tmp_path / "fer2013"
    ims = [pixels(i, 8, 8) for i in range(7)]
    write_webdataset(root / "test" / "0.tar", [(f"s{i:07d}", png_bytes(ims[i]), str(i % 7)) for i in range(4)])
    write_webdataset(root / "test" / "1.tar", [(f"s{i:07d}", png_bytes(ims[i]), str(6 - i)) for i in range(4, 7)])
    write_webdataset(root / "train" / "0.tar", [(f"s{i:07d}", png_bytes(ims[i]), "3") for i in range(7)])
    (root / "classnames.txt").write_text("\n".join(CLASSNAMES["FER2013"]))
    test = load_real_split(tmp_path, "fer2013", "test")
    assert test.layout == "hf" and test.labels.tolist() == [0, 1, 2, 3, 2, 1, 0]
    check_images(test, ims)
    assert rv.dataset_files(tmp_path, "FER2013") == [root / "train" / "0.tar", root / "test" / "0.tar",
                                                     root / "test" / "1.tar"]  # train, validation (train's), test
    val = load_real_split(tmp_path, "FER2013", "validation", seed=1)
    assert len(val) == len(validation_indices(7, seed=1)) and set(val.labels.tolist()) == {3}
    write_webdataset(root / "test" / "2.tar", [("s9", png_bytes(ims[0]), "seven")])
    with pytest.raises(DatasetError, match=r"FER2013: label of .*s9.* in .*2\.tar is 'seven', expected an integer"):
        load_real_split(tmp_path, "FER2013", "test")
    write_webdataset(root / "test" / "2.tar", [("s9", png_bytes(ims[0]), b"\xff\xfe")])
    with pytest.raises(DatasetError, match=r"FER2013: cannot read webdataset shard .*2\.tar: .*utf-8"):
        load_real_split(tmp_path, "FER2013", "test")
    write_webdataset(root / "test" / "2.tar", [("s9", png_bytes(ims[0]), "7")])
    with pytest.raises(DatasetError, match=r"FER2013: labels of .* lie in \[0, 7\], expected \[0, 7\)"):
        load_real_split(tmp_path, "FER2013", "test")


def test_food101_tests_on_its_validation_split_and_cifar100_reads_its_fine_labels(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    ims = [pixels(i) for i in range(6)]
    food = hf_dataset(ims, [0, 1, 2, 3, 4, 5], list(CLASSNAMES["Food101"][:6]))
    (tmp_path / "food101" / "data").mkdir(parents=True)
    pq.write_table(food.data.table, tmp_path / "food101" / "data" / "train-00000-of-00001.parquet")
    pq.write_table(food.data.table.slice(4), tmp_path / "food101" / "data" / "validation-00000-of-00001.parquet")
    assert load_real_split(tmp_path, "Food101", "test").labels.tolist() == [4, 5]  # FusionBench's test: validation
    val = load_real_split(tmp_path, "Food101", "validation", seed=2)  # so validation is held out of train
    assert val.labels.tolist() == np.arange(6)[validation_indices(6, seed=2)].tolist()
    features = datasets.Features({"img": datasets.Image(), "fine_label": datasets.ClassLabel(
        names=list(CLASSNAMES["CIFAR100"])), "coarse_label": datasets.Value("int64")})
    cifar = datasets.Dataset.from_dict({"img": [Image.fromarray(im) for im in ims[:3]], "fine_label": [7, 99, 0],
                                        "coarse_label": [1, 2, 3]}, features=features)
    (tmp_path / "cifar100").mkdir()
    pq.write_table(cifar.data.table, tmp_path / "cifar100" / "test-00000-of-00001.parquet")
    test = load_real_split(tmp_path, "CIFAR100", "test")
    assert test.labels.tolist() == [7, 99, 0]
    check_images(test, ims[:3])
    pcam = datasets.Dataset.from_dict({"image": [Image.fromarray(im) for im in ims[:3]], "label": [True, False, True]},
                                      features=datasets.Features({"image": datasets.Image(),
                                                                  "label": datasets.Value("bool")}))
    (tmp_path / "pcam" / "data").mkdir(parents=True)
    pq.write_table(pcam.data.table, tmp_path / "pcam" / "data" / "test-00000-of-00001.parquet")
    assert load_real_split(tmp_path, "PCAM", "test").labels.tolist() == [1, 0, 1]  # boolean labels, as FusionBench
    with pytest.raises(DatasetError, match=r"STL10: no STL10 data under .*torchvision \(not read for STL10\)"):
        load_real_split(tmp_path, "STL10", "test")


# ------------------------------------------------------------------------------- the files a dataset is read from


def test_dataset_files_are_what_the_split_readers_read_and_no_other_file(tmp_path):
    """What an own-model track hashes of a dataset (``dataset_files``): the files each split's reader reads (a
    .mat per split; list files and the images they name; a save_to_disk directory's JSON and arrow files), and
    no other file of the data location, though SVHN's location is the data root itself."""
    import datasets

    def unrelated(directory):
        (directory / "shadow").write_text("root:x:0:0\n")
        (directory / "notes.txt").write_text("notes\n")

    svhn = tmp_path / "svhn-at-root"
    svhn.mkdir()
    x = np.random.default_rng(1).integers(0, 256, (32, 32, 3, 2), dtype=np.uint8)
    for split in ("train", "test"):
        scipy.io.savemat(svhn / f"{split}_32x32.mat", {"X": x, "y": np.array([[1], [2]], np.uint8)})
    unrelated(svhn)
    assert rv.dataset_files(svhn, "SVHN") == [svhn / "train_32x32.mat", svhn / "test_32x32.mat"]

    data = tmp_path / "tv" / "dtd" / "dtd"
    for k, name in enumerate(("banded/a.png", "banded/b.png", "zigzagged/c.png", "zigzagged/unlisted.png")):
        save(data / "images" / name, pixels(k))
    (data / "labels").mkdir()
    for split, entry in (("train", "banded/a.png"), ("val", "banded/b.png"), ("test", "zigzagged/c.png")):
        (data / "labels" / f"{split}1.txt").write_text(entry + "\n")
    unrelated(data)
    unrelated(data / "images")
    assert [p.relative_to(data).as_posix() for p in rv.dataset_files(tmp_path / "tv", "DTD")] == [
        "labels/train1.txt", "images/banded/a.png", "labels/val1.txt", "images/banded/b.png", "labels/test1.txt",
        "images/zigzagged/c.png"]

    names = [CLASSNAMES["Cars"][5], CLASSNAMES["Cars"][0]]
    ims = [pixels(i) for i in range(3)]
    dd = datasets.DatasetDict(train=hf_dataset(ims[:2], [0, 1], names), test=hf_dataset(ims[2:], [1], names))
    dd.save_to_disk(str(tmp_path / "hf" / "stanford_cars"))
    unrelated(tmp_path / "hf" / "stanford_cars")
    unrelated(tmp_path / "hf" / "stanford_cars" / "train")
    files = {p.resolve().relative_to((tmp_path / "hf" / "stanford_cars").resolve()).as_posix()
             for p in rv.dataset_files(tmp_path / "hf", "Cars")}
    assert files == {"dataset_dict.json", *(f"{s}/{n}" for s in ("train", "test") for n in (
        "dataset_info.json", "state.json", "data-00000-of-00001.arrow"))}
