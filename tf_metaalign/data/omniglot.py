"""Omniglot (Lake et al. 2015) for few-shot learning, read from the official zips.

Layout read
-----------
A set is `<root>/<set>.zip` (or the extracted folder `<root>/<set>/`) holding
`<set>/<Alphabet>/<characterNN>/<file>.png`: the official `images_background.zip` (30
alphabets, 964 characters), `images_evaluation.zip` (20 alphabets, 659 characters) and
the "small" background subsets `images_background_small1.zip` / `_small2.zip` (5 alphabets
each; Greek and Latin are in both, byte-identical). Every character has 20 drawings (one
per drawer), 105x105 1-bit PNGs. `all_runs.zip` is Lake's one-shot test: 20 runs of
20-way 1-shot classification on characters of the evaluation alphabets (see
`load_official_runs`).

By default `root` is `$TF_METAALIGN_OMNIGLOT_DIR`, else `../shared/data/omniglot` next
to the repository (which has the two small sets and `all_runs.zip`); point `root` at your
own copy of the full set to use `sets=("images_background", "images_evaluation")`.

Pixel convention (for the background sets AND the official runs)
-----------------------------------------------------------------
The PNGs are white background (1) with black strokes (0). They are inverted, so that
STROKES ARE 1 and the background 0 (the common convention of MAML code), as float32 in
[0, 1] of shape `(image_size, image_size, 1)`. Resizing (default 105 -> 28) is
antialiased: `tf.image.resize(method=resize_method, antialias=True)` with
`resize_method="lanczos3"` by default (like PIL's LANCZOS in MAML's data preparation), on
the inverted float image, then clipped to [0, 1] (Lanczos rings slightly past the range).
`image_size=None` keeps the original 105x105 binary images (exactly 0 and 1).

Classes
-------
`load_omniglot` returns an ordered dict `"Alphabet/characterNN" -> float32 [20, S, S, 1]`
(drawings in file-name order), characters deduplicated by (alphabet, character) when
several sets hold one (the first set read wins). `split_classes` splits such a dict into
meta-train / validation / test class sets (by character, or keeping alphabets disjoint),
`augment_rotations` adds the 90/180/270 degree rotations as new classes (rotate AFTER
splitting, so the rotations of a test character stay in the test split), and
`tf_metaalign.data.episodes.EpisodeSampler` samples N-way K-shot episodes from any of them.

Decoded arrays are cached as `.npz` under `cache_dir` (default `$TF_METAALIGN_CACHE`, else
`$XDG_CACHE_HOME/tf_metaalign`, else `~/.cache/tf_metaalign`), keyed by the content
hash of the source zips (path, size and mtime of the files of a source folder), the image
size and the resize method; `cache_dir=False` turns caching off.

Without TensorFlow (JAX)
------------------------
Decoding the PNGs and resizing them is TensorFlow's (`tf.io.decode_png`,
`tf.image.resize`). On another Keras backend, Pillow decodes them (the same pixels) and
`keras.ops.image.resize` resizes them (on JAX `jax.image.resize`, a port of TensorFlow's
ScaleAndTranslate kernel: the arrays agree with TensorFlow's within 5e-6, so a run's
numbers do not depend on which backend made the cache). Without Pillow or TensorFlow,
`load_omniglot` reads its `.npz` cache (copy `cache_dir` over from a machine that made it)
and raises an ImportError that says so when there is none.
`split_classes`, `augment_rotations`, `evaluate_official_runs` and
`official_runs_dataset(..., as_numpy=True)` (a `keras.utils.PyDataset`) need no
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from tf_metaalign import backend
from tf_metaalign.data._numpy_route import NumpyBatches, tensorflow_for
from tf_metaalign.data.episodes import mean_confidence_interval
from tf_metaalign.data.splits import check_positive_int

__all__ = [
    "SMALL_SETS",
    "OFFICIAL_SETS",
    "default_omniglot_root",
    "load_omniglot",
    "ClassSplit",
    "split_classes",
    "augment_rotations",
    "alphabet_of",
    "OfficialRun",
    "load_official_runs",
    "official_runs_dataset",
    "OfficialRunsResult",
    "evaluate_official_runs",
]

#: The two small background subsets shipped in ../shared/data/omniglot.
SMALL_SETS = ("images_background_small1", "images_background_small2")
#: The full official sets (964 + 659 characters); give `root` a folder holding them.
OFFICIAL_SETS = ("images_background", "images_evaluation")

_CACHE_VERSION = 1
_ROT_SUFFIX = re.compile(r"/rot\d{3}$")


def default_omniglot_root() -> Path:
    """`$TF_METAALIGN_OMNIGLOT_DIR`, else `<repository>/../shared/data/omniglot`."""
    env = os.environ.get("TF_METAALIGN_OMNIGLOT_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "omniglot"


def _default_cache_dir() -> Path:
    env = os.environ.get("TF_METAALIGN_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tf_metaalign"


# ----------------------------------------------------------------------------- decoding


def _check_image_size(image_size):
    if image_size is None:
        return None
    return check_positive_int(image_size, "image_size")


_CACHE_INSTEAD = (
    "load_omniglot reads its .npz cache without TensorFlow: run it once where TensorFlow "
    "is installed with the same root, sets, image_size, resize_method and cache_dir (and "
    "copy cache_dir here)."
)


def _decode_images(
    pngs: Sequence[bytes],
    image_size: int | None,
    resize_method: str,
    what: str = "images",
    instead: str = "",
) -> np.ndarray:
    """PNG bytes -> float32 [n, S, S, 1], strokes = 1 (see the module doc)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        try:
            from PIL import Image
        except ImportError:
            Image = None
        if Image is not None:
            return _decode_images_with_pillow(pngs, image_size, resize_method, what, Image)
        instead = f"pip install pillow (Pillow decodes, Keras resizes); or {instead}"
    tf = backend.require_tensorflow(
        f"Decoding and resizing {what} (tf.io.decode_png, tf.image.resize)", instead
    )
    decoded = []
    for i, b in enumerate(pngs):
        try:
            img = tf.io.decode_png(b, channels=1).numpy()
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            raise ValueError(f"could not decode PNG #{i} of {what}: {e}") from None
        decoded.append(img)
    shapes = {d.shape for d in decoded}
    out = []
    # Group by shape (the official images are all 105x105) and resize in chunks.
    for shape in sorted(shapes):
        idx = [i for i, d in enumerate(decoded) if d.shape == shape]
        x = 1.0 - np.stack([decoded[i] for i in idx]).astype(np.float32) / 255.0
        if image_size is not None and shape[:2] != (image_size, image_size):
            parts = []
            for s in range(0, len(x), 2048):
                r = tf.image.resize(
                    x[s : s + 2048], (image_size, image_size), method=resize_method, antialias=True
                )
                parts.append(np.clip(r.numpy(), 0.0, 1.0).astype(np.float32))
            x = np.concatenate(parts)
        out.append((idx, x))
    if len(out) == 1:
        return out[0][1]
    if image_size is None:
        raise ValueError(
            f"{what} have different sizes {sorted(s[:2] for s in shapes)}; give "
            "`image_size` to resize them to one size."
        )
    result = np.empty((len(decoded), image_size, image_size, 1), np.float32)
    for idx, x in out:
        result[idx] = x
    return result


def _decode_images_with_pillow(pngs, image_size, resize_method, what, Image) -> np.ndarray:
    """`_decode_images` without TensorFlow: Pillow decodes (the same pixels as
    `tf.io.decode_png`), `keras.ops.image.resize` resizes (on JAX, `jax.image.resize`, a
    port of TensorFlow's ScaleAndTranslate: within 5e-6 of `tf.image.resize` on the
    official runs)."""
    import io

    import keras

    decoded = []
    for i, b in enumerate(pngs):
        try:
            with Image.open(io.BytesIO(b)) as img:
                decoded.append(np.asarray(img.convert("L"), np.uint8)[..., None])
        except Exception as e:  # Pillow's UnidentifiedImageError, OSError, ...
            raise ValueError(f"could not decode PNG #{i} of {what}: {e}") from None
    shapes = {d.shape for d in decoded}
    if image_size is None and len(shapes) > 1:
        raise ValueError(
            f"{what} have different sizes {sorted(s[:2] for s in shapes)}; give "
            "`image_size` to resize them to one size."
        )
    result = None
    for shape in sorted(shapes):
        idx = [i for i, d in enumerate(decoded) if d.shape == shape]
        x = 1.0 - np.stack([decoded[i] for i in idx]).astype(np.float32) / 255.0
        if image_size is not None and shape[:2] != (image_size, image_size):
            parts = []
            for s in range(0, len(x), 2048):
                r = keras.ops.image.resize(
                    x[s : s + 2048],
                    (image_size, image_size),
                    interpolation=resize_method,
                    antialias=True,
                    data_format="channels_last",
                )
                parts.append(np.clip(keras.ops.convert_to_numpy(r), 0.0, 1.0).astype(np.float32))
            x = np.concatenate(parts)
        if len(shapes) == 1:
            return x
        if result is None:
            result = np.empty((len(decoded), *x.shape[1:]), np.float32)
        result[idx] = x
    return result


class _Source:
    """One set: a zip `<root>/<set>.zip` or a folder `<root>/<set>/`."""

    def __init__(self, root: Path, name: str):
        self.name = name
        zip_path = root / f"{name}.zip"
        dir_path = root / name
        if zip_path.is_file():
            self.path, self.is_zip = zip_path, True
        elif dir_path.is_dir():
            self.path, self.is_zip = dir_path, False
        else:
            raise FileNotFoundError(
                f"Omniglot set {name!r} not found: neither {zip_path} nor the folder "
                f"{dir_path} exists (`root`={str(root)!r}). The official zips are "
                "images_background.zip / images_evaluation.zip from "
                "github.com/brendenlake/omniglot (python/); point `root` at the folder "
                "holding them."
            )

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        if self.is_zip:
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        else:
            for p in sorted(self.path.rglob("*.png")):
                st = p.stat()
                h.update(f"{p.relative_to(self.path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return f"{self.name}:{'zip' if self.is_zip else 'dir'}:{h.hexdigest()}"

    def characters(self) -> dict[tuple[str, str], list[bytes]]:
        """(alphabet, character) -> the PNG bytes of its drawings, sorted by file name."""
        chars: dict[tuple[str, str], list] = {}
        if self.is_zip:
            with zipfile.ZipFile(self.path) as zf:
                for info in zf.infolist():
                    parts = info.filename.split("/")
                    if (
                        info.is_dir()
                        or len(parts) != 4
                        or parts[0].startswith("__MACOSX")
                        or not parts[3].lower().endswith(".png")
                        or parts[3].startswith(".")
                    ):
                        continue
                    chars.setdefault((parts[1], parts[2]), []).append((parts[3], zf.read(info)))
        else:
            for p in self.path.glob("*/*/*.png"):
                if p.name.startswith("."):
                    continue
                chars.setdefault((p.parent.parent.name, p.parent.name), []).append(
                    (p.name, p.read_bytes())
                )
        if not chars:
            raise ValueError(
                f"{self.path} holds no images in the Omniglot layout "
                f"'{self.name}/<Alphabet>/<character>/<file>.png'."
            )
        return {k: [b for _, b in sorted(v, key=lambda e: e[0])] for k, v in sorted(chars.items())}


def load_omniglot(
    root: str | os.PathLike | None = None,
    sets: Sequence[str] = SMALL_SETS,
    image_size: int | None = 28,
    resize_method: str = "lanczos3",
    cache_dir: str | os.PathLike | None | bool = None,
) -> dict[str, np.ndarray]:
    """Omniglot characters as classes: `"Alphabet/characterNN" -> float32 [n, S, S, 1]`.

    Args:
      root: the folder holding the sets (default `default_omniglot_root()`).
      sets: set names, each `<root>/<set>.zip` or `<root>/<set>/` (default the two small
        background sets; `OFFICIAL_SETS` for a copy of the full dataset). A character
        present in several sets (same alphabet and character folder names) is kept once,
        from the first set listed.
      image_size: S, the side of the (square) output images (28 by default); None keeps
        the originals (105x105, exactly 0/1).
      resize_method: a `tf.image.resize` method, applied with `antialias=True`.
      cache_dir: where the decoded arrays are cached (see the module doc); False: no cache.

    Returns:
      An ordered dict, in set order then sorted alphabet / character names; each array's
      rows are the drawings in file-name order. Strokes are 1, background 0.

    Example:
      >>> import pathlib, tempfile, zipfile
      >>> from tf_metaalign.data import load_omniglot
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> blank = tf.io.encode_png(tf.fill([105, 105, 1], tf.constant(255, tf.uint8))).numpy()
      >>> with zipfile.ZipFile(root / "tiny.zip", "w") as zf:  # Omniglot's layout, 2 x 3 drawings
      ...     for c in (1, 2):
      ...         for d in (1, 2, 3):
      ...             zf.writestr(f"tiny/Latin/character{c:02d}/01{c:02d}_{d:02d}.png", blank)
      >>> classes = load_omniglot(root, sets=["tiny"], cache_dir=False)
      >>> {name: x.shape for name, x in classes.items()}
      {'Latin/character01': (3, 28, 28, 1), 'Latin/character02': (3, 28, 28, 1)}

    References:
      Lake et al., "Human-level concept learning through probabilistic program induction",
      Science 2015. https://github.com/brendenlake/omniglot
    """
    root = Path(root) if root is not None else default_omniglot_root()
    image_size = _check_image_size(image_size)
    if isinstance(sets, str):
        sets = (sets,)
    sets = tuple(sets)
    if not sets:
        raise ValueError("`sets` is empty: name at least one set, e.g. 'images_background'.")
    if len(set(sets)) != len(sets):
        raise ValueError(f"`sets` lists a set twice: {sets}.")
    if not root.is_dir():
        raise FileNotFoundError(
            f"Omniglot `root` {str(root)!r} is not a folder; give the folder holding "
            f"{', '.join(s + '.zip' for s in sets)} (or set $TF_METAALIGN_OMNIGLOT_DIR)."
        )
    sources = [_Source(root, s) for s in sets]

    cache_path = _cache_path(sources, image_size, resize_method, cache_dir)
    if cache_path is not None:
        if cache_path.is_file():
            try:
                return _read_cache(cache_path)
            except Exception:  # a corrupt / partial cache file: rebuild it
                pass

    seen: set[tuple[str, str]] = set()
    names, counts, pngs = [], [], []
    for source in sources:
        for key_, files in source.characters().items():
            if key_ in seen:
                continue
            seen.add(key_)
            names.append(f"{key_[0]}/{key_[1]}")
            counts.append(len(files))
            pngs.extend(files)
    images = _decode_images(
        pngs, image_size, resize_method, what=f"Omniglot sets {sets}", instead=_CACHE_INSTEAD
    )
    if cache_path is not None:
        _write_cache(cache_path, names, counts, images)
    return _to_classes(names, counts, images)


def _cache_path(sources, image_size, resize_method, cache_dir) -> Path | None:
    """Where `load_omniglot` caches these arguments' arrays (None: no cache)."""
    if cache_dir is False:
        return None
    cache_root = Path(cache_dir) if cache_dir not in (None, True) else _default_cache_dir()
    key = json.dumps(
        {
            "v": _CACHE_VERSION,
            "sources": [s.fingerprint() for s in sources],
            "image_size": image_size,
            "resize_method": resize_method,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root / f"omniglot_{digest}.npz"


def _to_classes(names, counts, images) -> dict[str, np.ndarray]:
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {n: images[bounds[i] : bounds[i + 1]] for i, n in enumerate(names)}


def _write_cache(path: Path, names, counts, images):
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                images=images,
                counts=np.asarray(counts, np.int64),
                names=np.asarray(names, dtype=str),
            )
        os.replace(tmp, path)  # atomic: a concurrent reader never sees a partial file
    except OSError:  # e.g. a read-only cache folder: go on without caching
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _read_cache(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        images, counts, names = z["images"], z["counts"], [str(n) for n in z["names"]]
    return _to_classes(names, counts, images)


# ----------------------------------------------------------------------------- class splits


def alphabet_of(name: str) -> str:
    """The alphabet of a class name "Alphabet/character[/rotNNN]" (the name itself when it
    has no "/")."""
    return name.split("/", 1)[0]


class ClassSplit(NamedTuple):
    """Disjoint class sets (ordered dicts name -> array) for meta-learning."""

    train: dict
    validation: dict
    test: dict


def _split_counts(n: int, fractions, counts) -> tuple[int, int, int]:
    if counts is not None:
        if fractions is not None:
            raise ValueError("Give `fractions` or `counts`, not both.")
        counts = list(counts)
        if len(counts) != 3:
            raise ValueError(f"`counts` must be (train, validation, test); got {counts!r}.")
        if counts[0] is None:
            rest = counts[1:]
            for c in rest:
                if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
                    raise ValueError(f"`counts` must be integers >= 0; got {counts!r}.")
            counts[0] = n - sum(rest)
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
                raise ValueError(
                    f"`counts` must be integers >= 0 (train may be None: the "
                    f"rest); got {counts!r} for {n} classes."
                )
        if sum(counts) != n:
            raise ValueError(
                f"`counts` {counts} sum to {sum(counts)}, not to the number of classes ({n})."
            )
        return tuple(int(c) for c in counts)
    if fractions is None:
        fractions = (0.7, 0.1, 0.2)
    fractions = list(fractions)
    if len(fractions) != 3 or any(
        isinstance(f, bool) or not isinstance(f, (int, float, np.floating)) or f < 0
        for f in fractions
    ):
        raise ValueError(
            f"`fractions` must be three numbers >= 0 (train, validation, test); got {fractions!r}."
        )
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"`fractions` {fractions} must sum to 1.")
    n_val = int(round(fractions[1] * n))
    n_test = int(round(fractions[2] * n))
    return n - n_val - n_test, n_val, n_test


def split_classes(
    classes: Mapping[str, np.ndarray],
    fractions: Sequence[float] | None = None,
    counts: Sequence[int | None] | None = None,
    seed: int = 0,
    disjoint_alphabets: bool = False,
) -> ClassSplit:
    """Split classes into meta-train / validation / test sets, disjoint and complete.

    Args:
      classes: name -> array (e.g. `load_omniglot()`), NOT yet rotated (rotate each split
        afterwards with `augment_rotations`, so that the rotations of a character stay in
        its split; names ending in "/rotNNN" are refused).
      fractions: (train, validation, test) fractions of the classes, summing to 1 (default
        (0.7, 0.1, 0.2)); validation and test get `round(f * n)` classes, train the rest.
      counts: (train, validation, test) numbers of classes instead, summing to the number
        of classes (train may be None: the rest).
      seed: the split is a function of `seed` and the class names.
      disjoint_alphabets: False (default, MAML's convention): characters are shuffled and
        split whatever their alphabet, so an alphabet may appear in several splits. True:
        whole alphabets (the part of a name before "/") go to one split (as in the
        official background / evaluation split); alphabets are shuffled and handed to test,
        then validation, each until it has at least its target number of classes, and
        the rest to train, so the sizes only approximate the targets.

    Returns:
      `ClassSplit(train, validation, test)`, each an ordered dict in `classes`' order.

    Example:
      >>> from tf_metaalign.data import split_classes
      >>> names = [f"Alphabet{a}/character{c:02d}" for a in range(4) for c in range(5)]
      >>> classes = {name: np.zeros((2, 4, 4, 1)) for name in names}
      >>> split = split_classes(classes, counts=(None, 5, 5), disjoint_alphabets=True)
      >>> [len(part) for part in split]  # 4 alphabets of 5: one to test, one to validation
      [10, 5, 5]
      >>> len({name.split("/")[0] for name in split.test})
      1
    """
    if not isinstance(classes, Mapping):
        raise ValueError(
            f"`classes` must be a mapping class name -> array; got {type(classes).__name__}."
        )
    names = [str(k) for k in classes]
    if not names:
        raise ValueError("`classes` is empty.")
    rotated = [n for n in names if _ROT_SUFFIX.search(n)]
    if rotated:
        raise ValueError(
            f"`classes` holds rotated classes (e.g. {rotated[0]!r}): split the unrotated "
            "classes first and call augment_rotations on each split, so that all rotations "
            "of a character land in the same split."
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"`seed` must be an integer; got {seed!r}.")
    n = len(names)
    n_train, n_val, n_test = _split_counts(n, fractions, counts)
    rng = np.random.default_rng(int(seed))
    if not disjoint_alphabets:
        order = rng.permutation(n)
        test = set(order[:n_test].tolist())
        val = set(order[n_test : n_test + n_val].tolist())
        assign = ["test" if i in test else "validation" if i in val else "train" for i in range(n)]
    else:
        alphabets = sorted({alphabet_of(nm) for nm in names})
        sizes = {a: 0 for a in alphabets}
        for nm in names:
            sizes[alphabet_of(nm)] += 1
        order = [alphabets[i] for i in rng.permutation(len(alphabets))]
        where, got = {}, {"test": 0, "validation": 0}
        for a in order:
            for part, target in (("test", n_test), ("validation", n_val)):
                if got[part] < target:
                    where[a] = part
                    got[part] += sizes[a]
                    break
            else:
                where[a] = "train"
        assign = [where[alphabet_of(nm)] for nm in names]
    out = {"train": {}, "validation": {}, "test": {}}
    for nm, key, part in zip(names, classes, assign):
        out[part][nm] = classes[key]
    return ClassSplit(out["train"], out["validation"], out["test"])


def augment_rotations(
    classes: Mapping[str, np.ndarray], angles: Sequence[int] = (0, 90, 180, 270)
) -> dict[str, np.ndarray]:
    """Each class once per angle, as a new class `"<name>/rotNNN"`: the examples rotated
    by NNN degrees counter-clockwise (`np.rot90(x, k=NNN // 90, axes=(1, 2))`).

    The usual Omniglot augmentation (Santoro et al. 2016; MAML): 4x the classes. Apply it
    to each split of `split_classes` separately. Images must be square ([n, S, S, ...]).

    Args:
      classes: name -> array `[n, S, S, ...]`.
      angles: multiples of 90 degrees.

    Returns:
      name + "/rotNNN" -> rotated array, each class's angles in `angles`' order.

    Example:
      >>> from tf_metaalign.data import augment_rotations
      >>> x = np.zeros((1, 3, 3, 1)); x[0, 0, 2, 0] = 1  # a dot in the top-right corner
      >>> rotated = augment_rotations({"A/char01": x})
      >>> list(rotated), np.argwhere(rotated["A/char01/rot090"][0, ..., 0]).tolist()
      (['A/char01/rot000', 'A/char01/rot090', 'A/char01/rot180', 'A/char01/rot270'], [[0, 0]])

    References:
      Santoro et al., "Meta-Learning with Memory-Augmented Neural Networks", ICML 2016.
      https://proceedings.mlr.press/v48/santoro16.html
    """
    if not isinstance(classes, Mapping):
        raise ValueError(
            f"`classes` must be a mapping class name -> array; got {type(classes).__name__}."
        )
    angles = list(angles)
    if not angles:
        raise ValueError("`angles` is empty.")
    for a in angles:
        if (
            isinstance(a, bool)
            or not isinstance(a, (int, np.integer))
            or a % 90
            or not (0 <= a < 360)
        ):
            raise ValueError(f"`angles` must be multiples of 90 in [0, 360); got {angles!r}.")
    if len(set(angles)) != len(angles):
        raise ValueError(f"`angles` repeats an angle: {angles!r}.")
    out = {}
    for name, x in classes.items():
        x = np.asarray(x)
        if x.ndim < 3 or x.shape[1] != x.shape[2]:
            raise ValueError(
                f"`classes`[{name!r}] must be square images [n, S, S, ...] to "
                f"be rotated; got shape {x.shape}."
            )
        if _ROT_SUFFIX.search(str(name)):
            raise ValueError(f"`classes`[{name!r}] is already a rotated class.")
        for a in angles:
            out[f"{name}/rot{int(a):03d}"] = np.ascontiguousarray(
                np.rot90(x, k=int(a) // 90, axes=(1, 2))
            )
    return out


# ----------------------------------------------------------------------------- official runs


class OfficialRun(NamedTuple):
    """One run of Lake's 20-way 1-shot test.

    support_x: [20, S, S, 1], the training image of class j at row j (file classJJ.png);
    support_y: [20] int32, = 0..19; query_x: [20, S, S, 1], test item i at row i
    (itemII.png); query_y: [20] int32, the class of each test item (class_labels.txt).
    """

    support_x: np.ndarray
    support_y: np.ndarray
    query_x: np.ndarray
    query_y: np.ndarray
    name: str


_RUN_FILE = re.compile(r"^(?:.*/)?(run\d+)/(training|test)/(class|item)(\d+)\.png$")


def load_official_runs(
    path: str | os.PathLike | None = None,
    image_size: int | None = 28,
    resize_method: str = "lanczos3",
) -> list[OfficialRun]:
    """Lake's official one-shot runs (`all_runs.zip`): 20 runs of 20-way 1-shot.

    Layout: `runNN/training/classKK.png` (one image per class), `runNN/test/itemKK.png`
    (one test image per class) and `runNN/class_labels.txt`, one line per test item
    `runNN/test/itemII.png runNN/training/classJJ.png` (the item's class). Images get the
    pixel convention of `load_omniglot` (strokes 1, resized to `image_size`, antialiased).

    Args:
      path: `all_runs.zip` or the extracted folder holding `run01/`...; default
        `default_omniglot_root() / "all_runs.zip"`.

    Returns:
      The runs in name order, as `OfficialRun`s.

    Example:
      >>> import pathlib, tempfile, zipfile
      >>> from tf_metaalign.data import load_official_runs
      >>> def drawing(j):  # class j: a bar in row 20 j
      ...     img = np.full((105, 105, 1), 255, np.uint8)
      ...     img[20 * j] = 0
      ...     return tf.io.encode_png(img).numpy()
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "all_runs.zip"
      >>> with zipfile.ZipFile(path, "w") as zf:  # 1 run, 3-way (Lake's: 20 runs, 20-way)
      ...     labels = ""
      ...     for j in (1, 2, 3):
      ...         zf.writestr(f"run01/training/class{j:02d}.png", drawing(j))
      ...         zf.writestr(f"run01/test/item{j:02d}.png", drawing(4 - j))
      ...         labels += f"run01/test/item{j:02d}.png run01/training/class{4 - j:02d}.png\\n"
      ...     zf.writestr("run01/class_labels.txt", labels)
      >>> runs = load_official_runs(path)
      >>> runs[0].support_x.shape, runs[0].query_y.tolist()
      ((3, 28, 28, 1), [2, 1, 0])

    References:
      Lake et al., "Human-level concept learning through probabilistic program
      induction", Science 2015. https://github.com/brendenlake/omniglot
    """
    path = Path(path) if path is not None else default_omniglot_root() / "all_runs.zip"
    image_size = _check_image_size(image_size)
    files: dict[str, bytes] = {}  # all_runs.zip is small (~350 kB): read it whole
    if path.is_file():
        try:
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if not info.is_dir() and not info.filename.startswith("__MACOSX"):
                        files[info.filename] = zf.read(info)
        except zipfile.BadZipFile:
            raise ValueError(f"`path` {str(path)!r} is not a zip file.") from None
    elif path.is_dir():
        for p in path.rglob("*"):
            if p.is_file():
                files[p.relative_to(path).as_posix()] = p.read_bytes()
    else:
        raise FileNotFoundError(
            f"Official runs not found: `path` {str(path)!r} is neither all_runs.zip nor a "
            "folder holding run01/... (all_runs.zip is in github.com/brendenlake/omniglot, "
            "python/one-shot-classification)."
        )

    runs: dict[str, dict] = {}
    for fname in files:
        m = _RUN_FILE.match(fname)
        if m:
            run, part, _, idx = m.groups()
            runs.setdefault(run, {"training": {}, "test": {}, "labels": None})[part][int(idx)] = (
                fname
            )
        elif fname.endswith("class_labels.txt"):
            run = fname.split("/")[-2] if "/" in fname else None
            if run and re.fullmatch(r"run\d+", run):
                runs.setdefault(run, {"training": {}, "test": {}, "labels": None})["labels"] = fname
    if not runs:
        raise ValueError(
            f"{path} holds no runs in the layout runNN/training/classKK.png, "
            "runNN/test/itemKK.png, runNN/class_labels.txt."
        )

    out = []
    for run in sorted(runs, key=lambda r: int(r[3:])):
        entry = runs[run]
        if entry["labels"] is None:
            raise ValueError(f"{path}: {run} has no class_labels.txt.")
        train_idx, test_idx = sorted(entry["training"]), sorted(entry["test"])
        if not train_idx or not test_idx:
            raise ValueError(f"{path}: {run} has no training or no test images.")
        if train_idx != list(range(1, len(train_idx) + 1)):
            raise ValueError(
                f"{path}: {run}/training/ must hold class01.png ... "
                f"class{len(train_idx):02d}.png; got numbers {train_idx}."
            )
        if test_idx != list(range(1, len(test_idx) + 1)):
            raise ValueError(
                f"{path}: {run}/test/ must hold item01.png ... "
                f"item{len(test_idx):02d}.png; got numbers {test_idx}."
            )
        labels = {}
        text = files[entry["labels"]].decode("utf-8")
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            ma = _RUN_FILE.match(parts[0]) if len(parts) == 2 else None
            mb = _RUN_FILE.match(parts[1]) if len(parts) == 2 else None
            if not (ma and mb and ma.group(2) == "test" and mb.group(2) == "training"):
                raise ValueError(
                    f"{path}: {run}/class_labels.txt line {line_no} is not "
                    f"'<run>/test/itemII.png <run>/training/classJJ.png': "
                    f"{line!r}."
                )
            item, cls = int(ma.group(4)), int(mb.group(4))
            if item not in entry["test"] or cls not in entry["training"]:
                raise ValueError(
                    f"{path}: {run}/class_labels.txt line {line_no} names a "
                    f"missing image: {line!r}."
                )
            labels[item] = cls - 1
        if sorted(labels) != test_idx:
            raise ValueError(
                f"{path}: {run}/class_labels.txt labels items "
                f"{sorted(labels)}, not every test item {test_idx}."
            )
        pngs = [files[entry["training"][i]] for i in train_idx]
        pngs += [files[entry["test"][i]] for i in test_idx]
        images = _decode_images(
            pngs,
            image_size,
            resize_method,
            what=f"{path}: {run}",
            instead="install tensorflow-cpu beside JAX (the decoded runs are NumPy arrays).",
        )
        n = len(train_idx)
        out.append(
            OfficialRun(
                support_x=images[:n],
                support_y=np.arange(n, dtype=np.int32),
                query_x=images[n:],
                query_y=np.asarray([labels[i] for i in test_idx], np.int32),
                name=run,
            )
        )
    return out


def official_runs_dataset(
    runs: Sequence[OfficialRun], tasks_per_batch: int = 1, as_numpy: bool = False
):
    """The runs in the episode batch format `((support_x, support_y, query_x), query_y)`
    (see `tf_metaalign.data.episodes`), `tasks_per_batch` runs per batch (the last batch
    smaller when it does not divide the number of runs), e.g. for a meta-learning
    trainer's `evaluate`. The support is class-major (label j = classJJ.png).

    Args:
      runs: from `load_official_runs`.
      tasks_per_batch: runs per batch.
      as_numpy: a `keras.utils.PyDataset` of the same batches as NumPy arrays instead
        (no TensorFlow).

    Returns:
      A finite `tf.data.Dataset` (with `as_numpy`, the PyDataset).

    Example:
      >>> from tf_metaalign.data import official_runs_dataset
      >>> from tf_metaalign.data.omniglot import OfficialRun
      >>> run = OfficialRun(
      ...     np.zeros((20, 28, 28, 1), "float32"), np.arange(20, dtype="int32"),
      ...     np.zeros((20, 28, 28, 1), "float32"), np.arange(20, dtype="int32"), "run01",
      ... )
      >>> (support_x, support_y, query_x), query_y = next(iter(official_runs_dataset([run] * 3, 2)))
      >>> support_x.shape, query_y.shape  # 2 runs per batch (then 1)
      (TensorShape([2, 20, 28, 28, 1]), TensorShape([2, 20]))
    """
    tasks_per_batch = check_positive_int(tasks_per_batch, "tasks_per_batch")
    runs = list(runs)
    if not runs:
        raise ValueError("`runs` is empty.")
    sx = np.stack([r.support_x for r in runs])
    sy = np.stack([r.support_y for r in runs])
    qx = np.stack([r.query_x for r in runs])
    qy = np.stack([r.query_y for r in runs])
    if as_numpy:

        def batch(i):
            part = slice(i * tasks_per_batch, (i + 1) * tasks_per_batch)
            return (sx[part], sy[part], qx[part]), qy[part]

        return NumpyBatches(batch, -(-len(runs) // tasks_per_batch))
    tf = tensorflow_for("official_runs_dataset")
    return tf.data.Dataset.from_tensor_slices(((sx, sy, qx), qy)).batch(tasks_per_batch)


@dataclasses.dataclass
class OfficialRunsResult:
    """Accuracy on Lake's runs: `per_run_accuracy` [R], their mean, the half-width of its
    Student-t confidence interval over the R runs (`mean ± ci`), and the error rate
    (`1 - mean_accuracy`, what Lake et al. report)."""

    per_run_accuracy: np.ndarray
    mean_accuracy: float
    ci: float
    confidence: float
    error_rate: float

    def __str__(self):
        return (
            f"{self.mean_accuracy:.2%} ± {self.ci:.2%} ({self.confidence:.0%} CI over "
            f"{len(self.per_run_accuracy)} runs; error rate {self.error_rate:.2%})"
        )


def evaluate_official_runs(
    predict_fn, runs: Sequence[OfficialRun] | None = None, confidence: float = 0.95
) -> OfficialRunsResult:
    """Score `predict_fn` on Lake's runs (20-way 1-shot).

    Args:
      predict_fn: `predict_fn(support_x [20, S, S, 1], support_y int32 [20],
        query_x [20, S, S, 1])` -> logits / scores `[20, 20]` (argmax over the last axis
        is the prediction) or integer labels `[20]`; numpy or tensors.
      runs: from `load_official_runs` (default: `load_official_runs()`).
      confidence: of the t-interval over runs (`mean_confidence_interval`).

    Returns:
      An `OfficialRunsResult` (`per_run_accuracy`, `mean_accuracy`, `ci`, `error_rate`).

    Example:
      >>> from tf_metaalign.data import evaluate_official_runs
      >>> from tf_metaalign.data.omniglot import OfficialRun
      >>> eye = np.eye(20, dtype="float32").reshape(20, 20, 1, 1)  # 20 distinct "images"
      >>> run = OfficialRun(eye, np.arange(20), eye[::-1], np.arange(20)[::-1], "run01")
      >>> def nearest_neighbour(support_x, support_y, query_x):
      ...     distances = ((query_x[:, None] - support_x[None]) ** 2).sum(axis=(2, 3, 4))
      ...     return support_y[distances.argmin(axis=1)]
      >>> result = evaluate_official_runs(nearest_neighbour, [run, run])
      >>> result.mean_accuracy, result.error_rate
      (1.0, 0.0)

    References:
      Lake et al., "Human-level concept learning through probabilistic program
      induction", Science 2015. https://github.com/brendenlake/omniglot
    """
    if runs is None:
        runs = load_official_runs()
    runs = list(runs)
    if not runs:
        raise ValueError("`runs` is empty.")
    accs = []
    for run in runs:
        out = predict_fn(run.support_x, run.support_y, run.query_x)
        out = np.asarray(out)
        n_q, n_way = len(run.query_y), len(run.support_y)
        if out.shape == (n_q, n_way):
            pred = out.argmax(axis=-1)
        elif out.shape == (n_q,):
            if not np.issubdtype(out.dtype, np.integer):
                if not np.all(np.equal(np.mod(out, 1), 0)):
                    raise ValueError(
                        f"`predict_fn` returned non-integer labels of shape "
                        f"{out.shape} for {run.name}."
                    )
            pred = out.astype(np.int64)
        else:
            raise ValueError(
                f"`predict_fn` must return logits [{n_q}, {n_way}] or labels [{n_q}] for "
                f"{run.name}; got shape {out.shape}."
            )
        accs.append(float(np.mean(pred == run.query_y)))
    accs = np.asarray(accs)
    mean, ci = mean_confidence_interval(accs, confidence)
    return OfficialRunsResult(
        per_run_accuracy=accs,
        mean_accuracy=mean,
        ci=ci,
        confidence=float(confidence),
        error_rate=1.0 - mean,
    )
