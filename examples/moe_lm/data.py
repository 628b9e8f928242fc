"""The byte corpus: default stdlib text or a `--data` file, the train/validation split and batches.

Batches are numpy (host) arrays chosen by a seeded generator, so every process and every resumed
run sees the same windows for the same `(seed, step)`.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np

# Standard-library modules that make up the default corpus (about 1 MB of Python). Paths are
# relative to the stdlib directory; files a given Python version lacks are skipped.
DEFAULT_CORPUS_FILES = tuple(
    sorted(
        (
            "argparse.py",
            "ast.py",
            "calendar.py",
            "collections/__init__.py",
            "dataclasses.py",
            "difflib.py",
            "enum.py",
            "fractions.py",
            "functools.py",
            "heapq.py",
            "inspect.py",
            "json/decoder.py",
            "json/encoder.py",
            "random.py",
            "shutil.py",
            "statistics.py",
            "string.py",
            "textwrap.py",
            "threading.py",
            "typing.py",
        )
    )
)


def default_corpus_files() -> list[Path]:
    """The stdlib sources of the default corpus that exist for the running interpreter, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in DEFAULT_CORPUS_FILES if (stdlib / name).is_file()]


def load_corpus(path: Path | None) -> np.ndarray:
    """Bytes of `path` (or of the default stdlib corpus) as a uint8 array."""
    if path is not None:
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    files = default_corpus_files()
    if not files:
        raise FileNotFoundError(
            f"none of the default corpus files were found under {sysconfig.get_paths()['stdlib']}; "
            "pass --data PATH to train on your own text."
        )
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


class Split(NamedTuple):
    train: np.ndarray  # uint8 [N_train]
    val: np.ndarray  # uint8 [N_val]


def split_corpus(data: np.ndarray, val_fraction: float, seq: int) -> Split:
    """Hold out the tail of `data`; both parts must fit at least one sequence of `seq + 1` bytes."""
    n_val = int(len(data) * val_fraction)
    split = Split(data[: len(data) - n_val], data[len(data) - n_val :])
    if min(len(split.train), len(split.val)) < seq + 1:
        raise ValueError(
            f"corpus of {len(data)} bytes split {len(split.train)}/{len(split.val)} (train/val) is too "
            f"small for --seq {seq}: each part needs >= {seq + 1} bytes; use a larger --data or a "
            "smaller --seq."
        )
    return split


def sample_batch(tokens: np.ndarray, batch: int, seq: int, key: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`batch` random windows of `tokens`, chosen by `np.random.default_rng(key)`.

    Returns `(inputs_BS, targets_BS)` int32, targets shifted by one byte. The windows depend only
    on `key`, so a resumed run sees the same batches as an uninterrupted one.
    """
    rng = np.random.default_rng(key)
    starts_B = rng.integers(0, len(tokens) - seq, size=batch)
    windows = tokens[starts_B[:, None] + np.arange(seq + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def train_batch(tokens, args, step: int):
    return sample_batch(tokens, args.batch, args.seq, (args.seed, 0, step))


def val_batches(tokens, args):
    return [sample_batch(tokens, args.batch, args.seq, (args.seed, 1, i)) for i in range(args.eval_batches)]
