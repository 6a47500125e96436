"""Small real translation pairs that work offline: Django's gettext catalogs.

`pip install django` ships ~790 English -> X user-interface strings per major language in
`django/**/locale/<lang>/LC_MESSAGES/django.mo`. `load_django_pairs("de")` reads them
with the standard library (`gettext.GNUTranslations(f)._catalog`); `CharVocab` and
`make_char_seq2seq` turn them into character-level encoder/decoder arrays for a small
Transformer (teacher forcing: decoder input = BOS + target, label = target + EOS).
"""

from __future__ import annotations

import glob
import gettext
import os
from typing import Sequence

import numpy as np

PAD, BOS, EOS, UNK = 0, 1, 2, 3


def django_locale_root():
    try:
        import django
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The Django translation pairs need `pip install django` (the gettext catalogs "
            "ship with it; nothing is downloaded at run time)."
        ) from e
    return os.path.dirname(django.__file__)


def load_django_pairs(lang: str = "de", root: str | None = None, max_chars: int | None = None):
    """Sorted, de-duplicated (english, translation) pairs of one language.

    Plural entries and empty translations are skipped; message contexts are stripped.
    `max_chars` drops pairs with either side longer than that.
    """
    root = root or django_locale_root()
    files = sorted(
        glob.glob(
            os.path.join(root, "**", "locale", lang, "LC_MESSAGES", "django.mo"), recursive=True
        )
    )
    if not files:
        raise ValueError(f"No Django catalogs for language {lang!r} under {root}.")
    pairs = {}
    for path in files:
        with open(path, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        for src, tgt in catalog.items():
            if not isinstance(src, str) or not src or not isinstance(tgt, str) or not tgt:
                continue
            src = src.split("\x04", 1)[-1].strip()
            tgt = tgt.strip()
            if not src or not tgt:
                continue
            if max_chars and (len(src) > max_chars or len(tgt) > max_chars):
                continue
            pairs.setdefault(src, tgt)
    return sorted(pairs.items())


class CharVocab:
    """Characters seen in `texts` (ids from 4; 0 pad, 1 BOS, 2 EOS, 3 unknown)."""

    def __init__(self, texts: Sequence[str]):
        chars = sorted({c for t in texts for c in t})
        self.chars = chars
        self.index = {c: i + 4 for i, c in enumerate(chars)}

    def __len__(self):
        return len(self.chars) + 4

    def encode(self, text: str):
        return [self.index.get(c, UNK) for c in text]

    def decode(self, ids):
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= 4:
                out.append(self.chars[i - 4])
        return "".join(out)


def make_char_seq2seq(pairs, vocab: CharVocab, max_len: int):
    """Arrays `(encoder_tokens, decoder_inputs), labels, mask` (int32, float32 mask)."""
    n = len(pairs)
    enc = np.zeros((n, max_len), np.int32)
    dec = np.zeros((n, max_len + 1), np.int32)
    lab = np.zeros((n, max_len + 1), np.int32)
    for i, (s, t) in enumerate(pairs):
        se = vocab.encode(s)[:max_len]
        te = vocab.encode(t)[:max_len]
        enc[i, : len(se)] = se
        dec[i, 0] = BOS
        dec[i, 1 : len(te) + 1] = te
        lab[i, : len(te)] = te
        lab[i, len(te)] = EOS
    mask = (lab != PAD).astype(np.float32)
    return (enc, dec), lab, mask


def split_pairs(pairs, dev_fraction=0.15, guidance_size=64, seed=0):
    """Shuffle and split into (train, guidance, dev) lists (disjoint)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    n_dev = int(round(dev_fraction * len(pairs)))
    dev = pairs[:n_dev]
    guidance = pairs[n_dev : n_dev + guidance_size]
    train = pairs[n_dev + guidance_size :]
    if not train:
        raise ValueError("split_pairs: nothing left to train on; lower dev_fraction/guidance_size.")
    return train, guidance, dev
