"""The default vision task suite: procedurally rendered, captioned images, generated offline and deterministically.

Datasets (each image carries every attribute; tasks read different attributes of the SAME images, so their
task vectors conflict when merged, as an early pilot showed: docs/references.md):

* ``scenes``: 1-4 identical objects on a textured background -> tasks ``shapes`` (6), ``colors`` (8),
  ``counts`` (4), ``textures`` (6);
* ``glyphs``: a rendered digit -> tasks ``digits`` (10), ``typefaces`` (6 font families), ``inks`` (6 colours);
* ``handwritten``: the real 8x8 scikit-learn digits (1,797 images), upsampled -> task ``handwritten`` (10);
* ``letters``: rendered letters A-T, the generic probe set of MAGIC's sensitivity probing (none of the tasks);
* ``mixed``: unlabeled collages of scene objects and glyphs, the task-agnostic data of DSC-A;
* ``pretrain``: scenes and glyphs with captions, for the project's contrastive pretraining.

A second task set, ``disjoint8`` (``TASK_SETS``), gives every task its own image distribution, as the papers'
suites do (SVHN, MNIST, EuroSAT, ...: no two tasks label the same images), so no task is trained to ignore
what another is trained to see:

* ``objects``: one large shape on a plain dark background -> task ``objects`` (6 shapes);
* ``glyphs`` -> task ``digits`` (its typeface and ink are nuisances no task of the set labels);
* ``symbols``: a DejaVu pictogram in a random ink -> task ``symbols`` (10);
* ``arrows``: a DejaVu arrow in a random ink -> task ``arrows`` (8 directions);
* ``dots``: 1-5 same-coloured dots on a plain background -> task ``dots`` (5 counts);
* ``swatches``: a soft blob of one of 8 colours on grey noise -> task ``swatches`` (8);
* ``patterns``: a two-tone texture filling the image -> task ``patterns`` (6);
* ``handwritten`` -> task ``handwritten``;
* its ``pretrain`` set cycles over the set's datasets and ``letters``, so the probe set is seen in pretraining.

``headroom8`` is disjoint8 without swatches (solved zero-shot) and handwritten (never seen in pretraining), with
``numerals`` (a digit filling the frame) and ``greek`` (10 lowercase Greek letters), both captioned in pretraining
(docs/testbed-pilots, P23-P25).

Every sample is drawn from its own generator, seeded by sha256(seed, dataset, split, index): the same seed
gives the same bytes on any machine with the same pinned Pillow and fonts, whatever the order of generation.
Images are rendered at 4x and downsampled (anti-aliased). Fonts come from matplotlib's bundled files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..config_types import Count, NonNegativeInt, UnitInterval
from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, ParameterError

SUPERSAMPLE = 4

SHAPES = ["circle", "square", "triangle", "cross", "diamond", "ring"]
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 215, 40),
          "magenta": (210, 50, 200), "cyan": (40, 200, 210), "orange": (245, 140, 30), "white": (245, 245, 245)}
COUNTS = ["one", "two", "three", "four"]
TEXTURES = ["plain", "horizontal stripes", "vertical stripes", "checkerboard", "dots", "diagonal stripes"]
# Typefaces whose digits differ visibly at 32 px (a pilot with DejaVu Sans Mono, whose digits are DejaVu Sans's
# but for the zero, left the task near chance between the two).
TYPEFACES = {"sans-serif": "DejaVuSans.ttf", "serif": "DejaVuSerif.ttf", "bold": "DejaVuSans-Bold.ttf",
             "italic": "DejaVuSerif-Italic.ttf", "computer modern": "cmr10.ttf"}
MAX_ROTATION = 5.0  # degrees; italic's slant (about 11 degrees) must stay distinguishable from a tilt
OBJECT_RADIUS = (0.14, 0.19)  # fraction of the image; objects span 9-12 px at 32 px, large enough for shapes
INKS = {"black": (20, 20, 20), "red": (200, 30, 30), "blue": (30, 60, 210), "green": (30, 150, 50),
        "purple": (130, 40, 170), "brown": (130, 80, 30)}
DIGITS = [str(d) for d in range(10)]
LETTERS = [chr(ord("A") + i) for i in range(20)]
# disjoint8's own datasets (DejaVu Sans has every code point; checked with fontTools's cmap)
SYMBOLS = {"star": "\u2605", "heart": "\u2665", "spade": "\u2660", "club": "\u2663", "musical note": "\u266a",
           "sun": "\u2600", "umbrella": "\u2602", "anchor": "\u2693", "airplane": "\u2708", "scissors": "\u2702"}
ARROWS = {"left": "\u2190", "up": "\u2191", "right": "\u2192", "down": "\u2193", "up and left": "\u2196",
          "up and right": "\u2197", "down and right": "\u2198", "down and left": "\u2199"}
DOT_COUNTS = ["one", "two", "three", "four", "five"]
GREEK = {"alpha": "\u03b1", "beta": "\u03b2", "gamma": "\u03b3", "delta": "\u03b4", "epsilon": "\u03b5",
         "zeta": "\u03b6", "theta": "\u03b8", "lambda": "\u03bb", "pi": "\u03c0", "psi": "\u03c8"}


@dataclass(frozen=True)
class TaskSpec:
    """A classification task: which dataset's images, which attribute as label, its class names and the
    prompt templates of its zero-shot head."""

    name: str
    dataset: str
    label: str
    classnames: list[str]
    templates: list[str] = field(default_factory=lambda: ["a photo of a {}."])


TASKS: dict[str, TaskSpec] = {t.name: t for t in [
    TaskSpec("shapes", "scenes", "shape", SHAPES,
             ["a photo of a {}.", "a drawing of {} shapes.", "a picture of a {}."]),
    TaskSpec("colors", "scenes", "color", list(COLORS), ["a photo of {} objects.", "something coloured {}.",
                                                         "a {} shape."]),
    TaskSpec("counts", "scenes", "count", COUNTS, ["a photo of {} objects.", "{} shapes.", "there are {} things."]),
    TaskSpec("textures", "scenes", "texture", TEXTURES, ["a photo of a {} background.", "a {} pattern.",
                                                         "shapes on {}."]),
    TaskSpec("digits", "glyphs", "digit", [f"the digit {d}" for d in DIGITS], ["a photo of {}.", "a rendering of {}.",
                                                                                "{} printed."]),
    TaskSpec("typefaces", "glyphs", "typeface", list(TYPEFACES), ["a digit in a {} font.", "{} lettering.",
                                                                  "text set in {} type."]),
    TaskSpec("inks", "glyphs", "ink", list(INKS), ["a digit written in {} ink.", "{} print.", "a {} character."]),
    TaskSpec("handwritten", "handwritten", "digit", [f"the handwritten digit {d}" for d in DIGITS],
             ["a photo of {}.", "a scan of {}.", "{} written by hand."]),
    # disjoint8: each task on a dataset of its own
    TaskSpec("numerals", "numerals", "digit", [f"the number {d}" for d in DIGITS],
             ["a photo of {}.", "a crop showing {}.", "{} printed."]),
    TaskSpec("greek", "greek", "letter", [f"the greek letter {g}" for g in GREEK],
             ["a photo of {}.", "a rendering of {}.", "{} printed."]),
    TaskSpec("objects", "objects", "shape", SHAPES, ["a photo of a {}.", "a drawing of a {}.", "a {} shape."]),
    TaskSpec("symbols", "symbols", "symbol", list(SYMBOLS), ["a {} symbol.", "an icon of a {}.", "a printed {}."]),
    TaskSpec("arrows", "arrows", "direction", list(ARROWS), ["an arrow pointing {}.", "a {} arrow.",
                                                             "a sign pointing {}."]),
    TaskSpec("dots", "dots", "count", DOT_COUNTS, ["{} dots.", "a picture of {} dots.", "there are {} dots."]),
    TaskSpec("swatches", "swatches", "color", list(COLORS), ["a {} blob.", "a patch of {}.", "the colour {}."]),
    TaskSpec("patterns", "patterns", "texture", TEXTURES, ["a {} pattern.", "a texture of {}.", "a {} surface."]),
]}
TASK_SETS: dict[str, list[str]] = {
    "vision8": ["shapes", "colors", "counts", "textures", "digits", "typefaces", "inks", "handwritten"],
    "disjoint8": ["objects", "digits", "symbols", "arrows", "dots", "swatches", "patterns", "handwritten"],
    # disjoint8 without its two tasks outside the papers' regime (docs/testbed-pilots, P23-P25): swatches, solved
    # zero-shot (82-100 % in the pilots), and handwritten, unseen in pretraining (zero-shot at chance); numerals and
    # greek instead, both captioned in pretraining
    "headroom8": ["objects", "digits", "numerals", "symbols", "arrows", "greek", "dots", "patterns"],
    # a pilot pool: every single-dataset task, to compare 8-task subsets on one pretrained model
    "disjoint_pool": ["objects", "digits", "numerals", "symbols", "arrows", "greek", "dots", "swatches", "patterns",
                      "handwritten"],
}
PROBE_TASK = TaskSpec("letters", "letters", "letter", [f"the letter {c}" for c in LETTERS],
                      ["a photo of {}.", "a rendering of {}.", "{} printed."])
DATASETS = ("scenes", "glyphs", "handwritten", "letters", "mixed", "pretrain", "objects", "symbols", "arrows", "dots",
            "swatches", "patterns", "numerals", "greek")


def sample_rng(seed: int, dataset: str, split: str, index: int) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{dataset}:{split}:{index}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _fonts_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


_FONT_CACHE: dict[tuple[str, int], ImageFont.FreeTypeFont] = {}


def _font(file: str, size: int) -> ImageFont.FreeTypeFont:
    if (file, size) not in _FONT_CACHE:
        _FONT_CACHE[(file, size)] = ImageFont.truetype(str(_fonts_dir() / file), size)
    return _FONT_CACHE[(file, size)]


def _background(rng: np.random.Generator, texture: str, size: int) -> Image.Image:
    """A two-tone textured background in muted colours (so object colours stay distinguishable)."""
    a = tuple(int(v) for v in rng.integers(60, 140, 3))
    b = tuple(int(v) for v in rng.integers(60, 140, 3))
    image = Image.new("RGB", (size, size), a)
    draw = ImageDraw.Draw(image)
    period = int(rng.integers(size // 8, size // 4))
    half = max(1, period // 2)
    if texture == "horizontal stripes":
        for y in range(0, size, period):
            draw.rectangle([0, y, size, y + half - 1], fill=b)
    elif texture == "vertical stripes":
        for x in range(0, size, period):
            draw.rectangle([x, 0, x + half - 1, size], fill=b)
    elif texture == "checkerboard":
        for y in range(0, size, half):
            for x in range(0, size, half):
                if (x // half + y // half) % 2:
                    draw.rectangle([x, y, x + half - 1, y + half - 1], fill=b)
    elif texture == "dots":
        r = max(2, half // 2)
        for y in range(half, size, period):
            for x in range(half, size, period):
                draw.ellipse([x - r, y - r, x + r, y + r], fill=b)
    elif texture == "diagonal stripes":
        width = max(2, half)
        for offset in range(-size, size, period):
            draw.line([(offset, 0), (offset + size, size)], fill=b, width=width)
    return image


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, color: tuple) -> None:
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle([cx - 0.85 * r, cy - 0.85 * r, cx + 0.85 * r, cy + 0.85 * r], fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=color)
    elif shape == "cross":
        w = 0.35 * r
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=color)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=color)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=color)
    elif shape == "ring":
        draw.ellipse(box, outline=color, width=max(2, int(0.35 * r)))


def _place(rng: np.random.Generator, n: int, big: int, r: float) -> list[tuple[float, float]]:
    """n non-overlapping centres (rejection sampling; falls back to a grid)."""
    centres: list[tuple[float, float]] = []
    for _ in range(200):
        if len(centres) == n:
            break
        c = (float(rng.uniform(r, big - r)), float(rng.uniform(r, big - r)))
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 > (2.1 * r) ** 2 for x, y in centres):
            centres.append(c)
    grid = [(big * (0.25 + 0.5 * (i % 2)), big * (0.25 + 0.5 * (i // 2))) for i in range(4)]
    return centres if len(centres) == n else grid[:n]


def render_scene(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    shape = int(rng.integers(len(SHAPES)))
    color = int(rng.integers(len(COLORS)))
    count = int(rng.integers(len(COUNTS)))
    texture = int(rng.integers(len(TEXTURES)))
    big = size * SUPERSAMPLE
    image = _background(rng, TEXTURES[texture], big)
    draw = ImageDraw.Draw(image)
    r = big * float(rng.uniform(*OBJECT_RADIUS))
    rgb = COLORS[list(COLORS)[color]]
    jitter = tuple(int(np.clip(v + rng.integers(-15, 16), 0, 255)) for v in rgb)
    for cx, cy in _place(rng, count + 1, big, r):
        _draw_shape(draw, SHAPES[shape], cx, cy, r, jitter)
    caption = (f"{COUNTS[count]} {list(COLORS)[color]} {SHAPES[shape]}{'s' if count else ''} on a "
               f"{TEXTURES[texture]} background")
    labels = {"shape": shape, "color": color, "count": count, "texture": texture}
    return _downsample(image, size), labels, caption


def _glyph_image(rng: np.random.Generator, text: str, font_file: str, ink: tuple, size: int,
                 scale: tuple[float, float] = (0.6, 0.8)) -> Image.Image:
    """``text`` in a font of ``scale`` times the image height (uniform in the range), placed at random."""
    big = size * SUPERSAMPLE
    paper = tuple(int(v) for v in rng.integers(200, 256, 3))
    image = Image.new("RGB", (big, big), paper)
    draw = ImageDraw.Draw(image)
    font = _font(font_file, int(big * rng.uniform(*scale)))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    w, h = right - left, bottom - top
    x = float(rng.uniform(0, max(1, big - w))) - left
    y = float(rng.uniform(0, max(1, big - h))) - top
    draw.text((x, y), text, font=font, fill=ink)
    return image.rotate(float(rng.uniform(-MAX_ROTATION, MAX_ROTATION)), resample=Image.BILINEAR, fillcolor=paper)


def render_glyph(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    digit = int(rng.integers(10))
    typeface = int(rng.integers(len(TYPEFACES)))
    ink = int(rng.integers(len(INKS)))
    name = list(TYPEFACES)[typeface]
    image = _glyph_image(rng, DIGITS[digit], TYPEFACES[name], INKS[list(INKS)[ink]], size)
    caption = f"the digit {digit} in a {name} font, written in {list(INKS)[ink]} ink"
    return _downsample(image, size), {"digit": digit, "typeface": typeface, "ink": ink}, caption


def render_numeral(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """A printed digit filling most of the frame (an SVHN-like crop: 0.85-1.05 of the height in font units),
    random typeface and ink."""
    digit = int(rng.integers(10))
    name = list(TYPEFACES)[int(rng.integers(len(TYPEFACES)))]
    ink_name, ink = _ink(rng)
    image = _glyph_image(rng, DIGITS[digit], TYPEFACES[name], ink, size, scale=(0.85, 1.05))
    return _downsample(image, size), {"digit": digit}, f"the number {digit} printed in {ink_name}"


def render_greek(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """A lowercase Greek letter in a random DejaVu typeface and ink (the Latin ``letters`` stay the probe set)."""
    letter = int(rng.integers(len(GREEK)))
    name = list(GREEK)[letter]
    fonts = [f for f in TYPEFACES.values() if f.startswith("DejaVu")]  # cmr10 has no Greek
    image = _glyph_image(rng, GREEK[name], fonts[int(rng.integers(len(fonts)))], _ink(rng)[1], size)
    return _downsample(image, size), {"letter": letter}, f"the greek letter {name}"


def render_letter(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    letter = int(rng.integers(len(LETTERS)))
    font = list(TYPEFACES.values())[int(rng.integers(len(TYPEFACES)))]
    ink = list(INKS.values())[int(rng.integers(len(INKS)))]
    image = _glyph_image(rng, LETTERS[letter], font, ink, size)
    return _downsample(image, size), {"letter": letter}, f"the letter {LETTERS[letter]}"


def _ink(rng: np.random.Generator) -> tuple[str, tuple]:
    name = list(INKS)[int(rng.integers(len(INKS)))]
    return name, INKS[name]


def _plain(rng: np.random.Generator, big: int, low: int, high: int) -> Image.Image:
    return Image.new("RGB", (big, big), tuple(int(v) for v in rng.integers(low, high, 3)))


def render_object(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """One large shape in a light random colour on a plain dark background (shape is all that varies usefully)."""
    shape = int(rng.integers(len(SHAPES)))
    big = size * SUPERSAMPLE
    image = _plain(rng, big, 10, 90)
    r = big * float(rng.uniform(0.22, 0.34))
    cx, cy = (float(rng.uniform(r, big - r)) for _ in range(2))
    _draw_shape(ImageDraw.Draw(image), SHAPES[shape], cx, cy, r, tuple(int(v) for v in rng.integers(150, 256, 3)))
    return _downsample(image, size), {"shape": shape}, f"a {SHAPES[shape]}"


def render_symbol(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    symbol = int(rng.integers(len(SYMBOLS)))
    name = list(SYMBOLS)[symbol]
    ink_name, ink = _ink(rng)
    image = _glyph_image(rng, SYMBOLS[name], "DejaVuSans.ttf", ink, size)
    return _downsample(image, size), {"symbol": symbol}, f"a {name} symbol in {ink_name}"


def render_arrow(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    direction = int(rng.integers(len(ARROWS)))
    name = list(ARROWS)[direction]
    ink_name, ink = _ink(rng)
    image = _glyph_image(rng, ARROWS[name], "DejaVuSans.ttf", ink, size)
    return _downsample(image, size), {"direction": direction}, f"an arrow pointing {name} in {ink_name}"


def render_dots(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    count = int(rng.integers(len(DOT_COUNTS)))
    big = size * SUPERSAMPLE
    image = _plain(rng, big, 170, 240)
    draw = ImageDraw.Draw(image)
    r = big * float(rng.uniform(0.07, 0.1))
    colour = tuple(int(v) for v in rng.integers(0, 120, 3))
    centres: list[tuple[float, float]] = []
    while len(centres) <= count:  # rejection sampling; 5 dots of radius <= 0.1 always fit
        c = (float(rng.uniform(r, big - r)), float(rng.uniform(r, big - r)))
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 > (2.4 * r) ** 2 for x, y in centres):
            centres.append(c)
    for cx, cy in centres:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    return _downsample(image, size), {"count": count}, f"{DOT_COUNTS[count]} dot{'s' if count else ''}"


def render_swatch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """A soft ellipse of one of the named colours (jittered) on grey pixel noise."""
    color = int(rng.integers(len(COLORS)))
    name = list(COLORS)[color]
    big = size * SUPERSAMPLE
    grey = rng.integers(70, 160, (size, size, 1)) + rng.integers(-25, 26, (size, size, 1))
    noise = Image.fromarray(np.repeat(np.clip(grey, 0, 255), 3, axis=-1).astype(np.uint8))
    image = noise.resize((big, big), Image.NEAREST)
    rx, ry = (big * float(rng.uniform(0.2, 0.4)) for _ in range(2))
    cx, cy = float(rng.uniform(rx, big - rx)), float(rng.uniform(ry, big - ry))
    rgb = tuple(int(np.clip(v + rng.integers(-25, 26), 0, 255)) for v in COLORS[name])
    ImageDraw.Draw(image).ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=rgb)
    return _downsample(image, size), {"color": color}, f"a {name} blob"


def render_pattern(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    texture = int(rng.integers(len(TEXTURES)))
    image = _background(rng, TEXTURES[texture], size * SUPERSAMPLE)
    return _downsample(image, size), {"texture": texture}, f"a {TEXTURES[texture]} pattern"


def render_lowres_digit(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """A printed digit reduced to 8x8 grey levels and upsampled, as scikit-learn's handwritten digits are shown
    (pretraining only: it gives the handwritten task's image domain a caption without using its images)."""
    digit = int(rng.integers(10))
    font = list(TYPEFACES.values())[int(rng.integers(len(TYPEFACES)))]
    page = np.asarray(_glyph_image(rng, DIGITS[digit], font, (0, 0, 0), size).convert("L"), dtype=np.float32)
    page = np.pad(page, page.shape[0], constant_values=page.max())  # paper around it: the box may leave the page
    rows, cols = np.nonzero(page < page.max() - 60)  # the ink's bounding box, squared: the digit fills the frame
    cy, cx = (rows.min() + rows.max()) / 2, (cols.min() + cols.max()) / 2
    half = 0.55 * max(rows.max() - rows.min(), cols.max() - cols.min()) + 1
    box = (cx - half, cy - half, cx + half, cy + half)
    grey = np.asarray(Image.fromarray(page.astype(np.uint8)).resize((8, 8), Image.BOX, box=box), dtype=np.float32)
    grey = 255 * (grey - grey.min()) / max(1.0, float(grey.max() - grey.min()))  # full contrast, as sklearn's
    up = Image.fromarray(grey.astype(np.uint8)).resize((size, size), Image.BICUBIC)
    caption = f"a low resolution scan of the digit {digit}"
    return np.repeat(np.asarray(up)[..., None], 3, axis=-1), {"digit": digit}, caption


def render_mixed(rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, str]:
    """An unlabeled collage: a scene with a glyph pasted into one corner (task-agnostic data)."""
    scene, _, _ = render_scene(rng, size)
    glyph, _, _ = render_glyph(rng, size // 2)
    out = scene.copy()
    y, x = (int(rng.integers(2)) * size // 2), (int(rng.integers(2)) * size // 2)
    out[y:y + size // 2, x:x + size // 2] = glyph
    return out, {}, ""


def _downsample(image: Image.Image, size: int) -> np.ndarray:
    return np.asarray(image.resize((size, size), Image.LANCZOS), dtype=np.uint8)


RENDERERS = {"scenes": render_scene, "glyphs": render_glyph, "letters": render_letter, "mixed": render_mixed,
             "objects": render_object, "symbols": render_symbol, "arrows": render_arrow, "dots": render_dots,
             "swatches": render_swatch, "patterns": render_pattern, "lowres_digits": render_lowres_digit,
             "numerals": render_numeral, "greek": render_greek}
GENERIC_CAPTIONS = {"scenes": "some shapes", "glyphs": "a printed digit", "letters": "a printed letter",
                    "mixed": "a collage", "objects": "a shape", "symbols": "a symbol", "arrows": "an arrow",
                    "dots": "some dots", "swatches": "a coloured blob", "patterns": "a pattern",
                    "lowres_digits": "a low resolution scan", "numerals": "a printed number", "greek": "a greek letter"}
# what each task set's captioned pretraining set cycles over (vision8: scenes and glyphs alternately)
PRETRAIN_SOURCES = {"vision8": ("scenes", "glyphs"),
                    "disjoint8": ("objects", "glyphs", "symbols", "arrows", "dots", "swatches", "patterns", "letters"),
                    "headroom8": ("objects", "glyphs", "numerals", "symbols", "arrows", "greek", "dots", "patterns",
                                  "letters"),
                    "disjoint_pool": ("objects", "glyphs", "numerals", "symbols", "arrows", "greek", "dots", "swatches",
                                      "patterns", "letters")}


def task_set_datasets(task_set: str) -> list[str]:
    """The generated datasets a task set's tasks read, in task order (``handwritten`` holds real images)."""
    if task_set not in TASK_SETS:
        raise ParameterError(f"task_set={task_set!r}: choose one of {', '.join(TASK_SETS)}")
    return list(dict.fromkeys(TASKS[t].dataset for t in TASK_SETS[task_set] if TASKS[t].dataset != "handwritten"))


def generate(dataset: str, split: str, n: int, *, seed: int = 0, image_size: int = 32,
             task_set: str = "vision8", pretrain_sources: str = "",
             caption_rate: float = 1.0) -> dict[str, np.ndarray | list]:
    """``n`` samples of a procedural dataset: ``images`` uint8 [n, H, W, 3], one int64 array per label
    attribute, and ``captions``. ``pretrain`` cycles over ``PRETRAIN_SOURCES[task_set]`` (or the comma-separated
    datasets of ``pretrain_sources``) and keeps captions; with ``caption_rate`` < 1 a pretraining caption names its
    label with that probability only, else it is the source's generic caption (``GENERIC_CAPTIONS``)."""
    if n < 0:
        raise ParameterError(f"generate: n must be >= 0, got {n}")
    if dataset == "handwritten":
        raise ParameterError("generate: 'handwritten' holds real images; use handwritten_splits()")
    if dataset == "pretrain":
        if task_set not in PRETRAIN_SOURCES:
            raise ParameterError(f"task_set={task_set!r}: choose one of {', '.join(PRETRAIN_SOURCES)}")
        names = pretrain_sources.split(",") if pretrain_sources else PRETRAIN_SOURCES[task_set]
        unknown = [name for name in names if name not in RENDERERS]
        if unknown:
            raise ParameterError(f"pretrain_sources: unknown dataset {unknown[0]!r}; "
                                 f"choose from {', '.join(RENDERERS)}")
        renderers = [RENDERERS[name] for name in names]
        generic = lambda i: GENERIC_CAPTIONS[names[i % len(names)]]  # noqa: E731
        pick = lambda i: renderers[i % len(renderers)]  # noqa: E731
    elif dataset in RENDERERS:
        pick = lambda i: RENDERERS[dataset]  # noqa: E731
    else:
        raise ParameterError(f"generate: unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    images = np.zeros((n, image_size, image_size, 3), dtype=np.uint8)
    labels: dict[str, list[int]] = {}
    captions = []
    for i in range(n):
        image, sample_labels, caption = pick(i)(sample_rng(seed, dataset, split, i), image_size)
        unnamed = (dataset == "pretrain" and caption_rate < 1.0
                   and sample_rng(seed, "caption", split, i).random() >= caption_rate)
        if unnamed:
            caption = generic(i)
        images[i] = image
        for key, value in sample_labels.items():
            labels.setdefault(key, []).append(value)
        captions.append(caption)
    out: dict[str, np.ndarray | list] = {"images": images, "captions": captions}
    if dataset != "pretrain":
        out.update({k: np.asarray(v, dtype=np.int64) for k, v in labels.items()})
    return out


def handwritten_splits(*, seed: int = 0, n_test: int = 597, image_size: int = 32) -> dict[str, dict[str, np.ndarray]]:
    """scikit-learn's 1,797 real 8x8 digits, upsampled and shown as dark ink on light paper, split into
    train (1,200) and test (597) by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    gray = (255 - digits.images * (255 / 16)).astype(np.uint8)  # 0..16 intensities -> ink on paper
    up = np.stack([np.asarray(Image.fromarray(g).resize((image_size, image_size), Image.BICUBIC)) for g in gray])
    rgb = np.repeat(up[..., None], 3, axis=-1)
    test, train = order[:n_test], order[n_test:]
    return {"train": {"images": rgb[train], "digit": digits.target[train].astype(np.int64)},
            "test": {"images": rgb[test], "digit": digits.target[test].astype(np.int64)}}


def validation_indices(n_train: int, seed: int = 0, fraction: float = 0.1, cap: int = 5000) -> np.ndarray:
    """The validation split: 10% of train (at most 5000), a fixed seeded choice (docs/references.md)."""
    n_val = min(cap, int(round(fraction * n_train)))
    return np.sort(np.random.default_rng(seed).permutation(n_train)[:n_val])


def array_digest(arrays: dict) -> str:
    """sha256 over the arrays' bytes and shapes, in key order (for determinism checks and DVC metadata)."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        value = arrays[key]
        if isinstance(value, np.ndarray):
            h.update(f"{key}:{value.dtype}:{value.shape}".encode())
            h.update(np.ascontiguousarray(value).tobytes())
        else:
            h.update(f"{key}:{json.dumps(value)}".encode())
    return h.hexdigest()


@dataclass
class SuiteConfig:
    """Sizes per dataset. Every scene/glyph task reads all ``n_train`` images of its dataset: 4000 because the
    tiny ViT overfits 1000 (train loss 0.75, shapes test accuracy 0.48 in a pilot); rendering is cheap
    (about 2,600 scenes/s and 700 glyphs/s on one core). ``handwritten`` is always sklearn's 1,200/597."""

    n_train: Count = 4000
    n_test: Count = 600
    n_probe: Count = 1000
    n_agnostic: Count = 512
    n_pretrain: Count = 8000
    image_size: Count = 32
    seed: NonNegativeInt = 0
    task_set: str = "vision8"  # TASK_SETS: which datasets are generated and what pretraining shows
    pretrain_sources: str = ""  # comma-separated renderers the pretraining set cycles over; "" = the task set's
    caption_rate: UnitInterval = 1.0  # probability that a pretraining caption names its label (else a generic one)


# CI size: every task keeps a handful of examples per class (handwritten is always the real 1,797 digits).
SMOKE_SUITE = SuiteConfig(n_train=60, n_test=40, n_probe=20, n_agnostic=16, n_pretrain=64)


def _save_npz(path: Path, arrays: dict) -> None:
    """Write an .npz atomically (no pickled objects: captions are stored as a fixed-width string array)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    clean = {k: (np.asarray(v, dtype=np.str_) if isinstance(v, list) else v) for k, v in arrays.items()}
    with open(tmp, "wb") as fh:
        np.savez(fh, **clean)
    tmp.replace(path)


def load_split(root: str | Path, dataset: str, split: str) -> dict[str, np.ndarray]:
    """A generated split as arrays (``allow_pickle=False``: nothing is unpickled)."""
    path = Path(root) / dataset / f"{split}.npz"
    if not path.exists():
        raise CheckpointError(f"{path}: split not found (build the suite with build_vision_suite first)")
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def build_vision_suite(root: str | Path, config: SuiteConfig | None = None, progress: bool = True) -> dict:
    """Generate every dataset of the suite under ``root`` and write ``manifest.json`` (tasks, class names,
    templates, sizes, digests). Returns the manifest."""
    from tqdm.auto import tqdm

    config = config or SuiteConfig()
    root = Path(root)
    plan = [(dataset, split, config.n_train if split == "train" else config.n_test)
            for dataset in task_set_datasets(config.task_set) for split in ("train", "test")]
    plan += [("letters", "test", config.n_probe), ("mixed", "train", config.n_agnostic),
             ("pretrain", "train", config.n_pretrain)]
    digests = {}
    for dataset, split, n in tqdm(plan, desc="vision suite", unit="split", disable=not progress):
        arrays = generate(dataset, split, n, seed=config.seed, image_size=config.image_size, task_set=config.task_set,
                          pretrain_sources=config.pretrain_sources, caption_rate=config.caption_rate)
        _save_npz(root / dataset / f"{split}.npz", arrays)
        digests[f"{dataset}/{split}"] = array_digest(arrays)
    for split, arrays in handwritten_splits(seed=config.seed, image_size=config.image_size).items():
        _save_npz(root / "handwritten" / f"{split}.npz", arrays)
        digests[f"handwritten/{split}"] = array_digest(arrays)
    manifest = {"config": asdict(config), "tasks": {name: asdict(TASKS[name]) for name in TASK_SETS[config.task_set]},
                "probe": asdict(PROBE_TASK), "agnostic": "mixed/train", "pretrain": "pretrain/train",
                "digests": digests}
    atomic_write_text(root / "manifest.json", json.dumps(manifest, indent=2))
    return manifest
