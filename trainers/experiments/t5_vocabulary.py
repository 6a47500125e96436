"""A T5-style SentencePiece vocabulary trained offline, and T5's special ids.

  PAD_ID, EOS_ID, UNK_ID  T5's special ids (pad 0, eos 1, unk 2, no bos)
  sentinel_id             the id of `<extra_id_k>`: T5 counts sentinels down from the last id
  train_sentencepiece     a unigram SentencePiece model with T5's conventions (pad=0, eos=1,
                          unk=2, no bos, `<extra_id_k>` sentinels at the END of the
                          vocabulary), cached by a content hash of (corpus, settings)
  t5_tokenizer            `keras_hub.models.T5Tokenizer` on that model
  normalize_text          a text as SentencePiece's normalizer sees it
  tokenize_texts          texts -> id arrays (no EOS), batched through a tokenizer
  check_int               an integer argument with a lower bound, or an error naming it

The corpus is `trainers.experiments.english_corpus`; T5's objectives on the ids are
`trainers.experiments.t5_objectives`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from trainers.experiments.english_corpus import corpus_hash

# T5's special ids (t5.data / seqio SentencePieceVocabulary): pad 0, eos 1, unk 2, no bos.
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
#: T5's default number of sentinels (`<extra_id_0>`..`<extra_id_99>`).
T5_NUM_EXTRA_IDS = 100


def sentinel_id(vocabulary_size: int, index: int = 0) -> int:
    """The id of `<extra_id_{index}>`: T5 counts sentinels DOWN from the last id
    (`t5.data.preprocessors.sentinel_id` is `vocabulary.vocab_size - 1`)."""
    return int(vocabulary_size) - 1 - int(index)


def check_int(name, value, minimum):
    # `splits.check_positive_int` with another lower bound (0 extra ids, length >= 2, ...).
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {name}={value!r}.")
    return int(value)


def train_sentencepiece(
    corpus: Sequence[str],
    directory: str | os.PathLike,
    vocabulary_size: int = 4000,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    normalization_rule_name: str = "nmt_nfkc",
    max_sentence_length: int = 4192,
) -> Path:
    """Trains (or reuses) a SentencePiece model with T5's conventions; returns its path.

    The model has `vocabulary_size` pieces in all: `vocabulary_size - num_extra_ids`
    trained pieces with `<pad>`=0, `</s>`=1, `<unk>`=2 and no `<s>` (T5's spiece.model),
    then `num_extra_ids` sentinels appended at the END, `<extra_id_0>` last
    (id vocabulary_size-1), `<extra_id_1>` before it, ... as seqio's
    `SentencePieceVocabulary(extra_ids=100)` numbers them. T5 keeps its sentinels outside
    the proto; keras-hub's `T5Tokenizer` has no `extra_ids` argument, so here they are
    USER_DEFINED pieces of the proto itself: `tokenizer.token_to_id("<extra_id_0>")` and
    `tokenizer.vocabulary_size()` then agree with T5's numbering, and the text
    "<extra_id_0>" encodes to that one id.

    The file is `directory/spm-<hash>.model`, the hash covering the corpus and every
    setting: an existing file is reused (training is deterministic, but takes seconds to
    minutes). `directory` must not be inside a git work tree you do not mean to dirty.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    vocabulary_size = check_int("vocabulary_size", vocabulary_size, 8)
    num_extra_ids = check_int("num_extra_ids", num_extra_ids, 0)
    if num_extra_ids > T5_NUM_EXTRA_IDS:
        raise ValueError(
            f"`num_extra_ids` must be at most {T5_NUM_EXTRA_IDS} (T5's sentinels); "
            f"got {num_extra_ids}."
        )
    if vocabulary_size - num_extra_ids < 8:
        raise ValueError(
            f"`vocabulary_size` ({vocabulary_size}) must exceed `num_extra_ids` "
            f"({num_extra_ids}) by at least 8 trained pieces."
        )
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"`model_type` must be 'unigram' or 'bpe'; got {model_type!r}.")
    if not 0.0 < float(character_coverage) <= 1.0:
        raise ValueError(f"`character_coverage` must be in (0, 1]; got {character_coverage!r}.")
    if isinstance(corpus, str) or len(corpus) == 0:
        raise ValueError("`corpus` must be a non-empty sequence of strings.")
    settings = dict(
        vocabulary_size=vocabulary_size,
        num_extra_ids=num_extra_ids,
        model_type=model_type,
        character_coverage=float(character_coverage),
        normalization_rule_name=normalization_rule_name,
        max_sentence_length=max_sentence_length,
        version=1,
    )
    key = hashlib.sha256(
        (corpus_hash(corpus) + json.dumps(settings, sort_keys=True)).encode()
    ).hexdigest()[:16]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"spm-{key}.model"
    if path.is_file():
        return path
    import io

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buffer,
        vocab_size=vocabulary_size - num_extra_ids,
        model_type=model_type,
        character_coverage=character_coverage,
        normalization_rule_name=normalization_rule_name,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        max_sentence_length=max_sentence_length,
        num_threads=1,
        # A small corpus cannot always fill the requested vocabulary: fail loudly instead.
        hard_vocab_limit=True,
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    for index in reversed(range(num_extra_ids)):
        piece = proto.pieces.add()
        piece.piece = f"<extra_id_{index}>"
        piece.score = 0.0
        piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(proto.SerializeToString())
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a model
    return path


def t5_tokenizer(model_path: str | os.PathLike):
    """`keras_hub.models.T5Tokenizer` on a model from `train_sentencepiece`."""
    import keras_hub

    return keras_hub.models.T5Tokenizer(proto=str(model_path))


def normalize_text(text: str, normalization_rule_name: str = "nmt_nfkc") -> str:
    """`text` as SentencePiece's normalizer sees it (NFKC + whitespace collapsed and
    stripped): what `detokenize(tokenize(text))` returns when no piece is `<unk>`."""
    import sentencepiece as spm

    normalizer = spm.SentencePieceNormalizer(rule_name=normalization_rule_name)
    return normalizer.normalize(text).replace("\u2581", " ").strip()


def tokenize_texts(texts: Sequence[str], tokenizer, batch_size: int = 4096) -> list[np.ndarray]:
    """Each text -> an int32 numpy array of ids (no EOS), batched through the tokenizer."""
    out: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        rows = tokenizer(list(texts[start : start + batch_size]))
        # keras-hub returns python lists for python-list input, a RaggedTensor otherwise.
        rows = rows.to_list() if hasattr(rows, "to_list") else rows
        out.extend(np.asarray(row, np.int32) for row in rows)
    return out
