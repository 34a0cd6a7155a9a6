"""The demo's data: Python's own standard library, a byte-level BPE trained on it, token windows.

For a given Python everything is deterministic: files in sorted order, the first
``corpus_mb`` MB of them. The tokenizer and the token stream are cached under
``~/.cache/sparta/demo/<key>`` where the key hashes the corpus, the vocabulary size and the
tokenizer version, so a second run only loads them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor

import sparta
from sparta.errors import ConfigError

CACHE_ROOT = Path.home() / ".cache" / "sparta" / "demo"
END_OF_TEXT = "<|endoftext|>"
# Installed third-party packages live inside the stdlib folder and differ between machines.
_NOT_STDLIB = ("site-packages", "dist-packages")


def stdlib_corpus(megabytes: float) -> list[str]:
    """The first ``megabytes`` MB of the standard library's .py files (sorted by path), one
    string per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not any(part in _NOT_STDLIB for part in p.relative_to(root).parts))
    budget = int(megabytes * 1e6)
    texts: list[str] = []
    for path in files:
        if budget <= 0:
            break
        raw = path.read_bytes()[:budget]
        budget -= len(raw)
        # A few test files are deliberately not UTF-8; replacing their bad bytes keeps them.
        texts.append(raw.decode("utf-8", errors="replace"))
    return texts


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    # Two runs may fill the same cache at once (make demo beside make test): a reader must
    # never see a half-written file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _build(texts: list[str], vocab_size: int, folder: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)  # files are documents: the model learns where one ends
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(folder / "tokenizer.json", lambda p: tokenizer.save(str(p)))
    _write_atomically(folder / "tokens.pt", lambda p: torch.save(torch.tensor(ids, dtype=torch.int32), p))


def load_tokens(world: sparta.World, corpus_mb: float, vocab_size: int, log: Callable[[str], object]) -> Tensor:
    """The corpus as a flat int64 token tensor, the same on every rank.

    Only rank 0 reads the corpus and, when the cache misses, trains the tokenizer and
    tokenises; it then broadcasts the tokens, so the other ranks need neither the files nor
    a home folder shared with rank 0 (on several nodes).
    """
    tokens = torch.empty(0, dtype=torch.int32)
    if world.rank == 0:
        texts = stdlib_corpus(corpus_mb)
        digest = hashlib.sha256("\0".join(texts).encode())  # \0: file boundaries change the tokens too
        folder = CACHE_ROOT / f"{digest.hexdigest()[:16]}-v{vocab_size}-tok{tokenizers.__version__}"
        if not (folder / "tokens.pt").exists():
            log(f"training a {vocab_size}-token BPE on {len(texts)} stdlib files ({corpus_mb:g} MB) -> {folder}")
            _build(texts, vocab_size, folder)
        tokens = torch.load(folder / "tokens.pt")
        log(f"{len(tokens):,} tokens from {len(texts)} stdlib files, cached in {folder}")
    count = int(world.comm.broadcast(torch.tensor([len(tokens)]), src=0))
    if world.rank != 0:
        tokens = torch.empty(count, dtype=torch.int32)
    return world.comm.broadcast(tokens, src=0).long()


class Batches:
    """Random training windows for one rank, fixed validation windows shared out over ranks.

    ``tokens`` is cut into 100 contiguous pieces and every 10th piece validates. Interleaving
    matters: the files come in name order, so a plain tail split would validate on other
    modules than the model trained on. Each rank draws its own training windows from a
    generator seeded by ``(seed, rank)``, so ranks see different data and a rerun sees the same.
    """

    def __init__(self, tokens: Tensor, seq_len: int, rank: int, size: int, seed: int) -> None:
        pieces = tokens.chunk(100)
        self.train = torch.cat([p for i, p in enumerate(pieces) if i % 10 != 9])
        self.val = torch.cat([p for i, p in enumerate(pieces) if i % 10 == 9])
        if len(self.val) <= seq_len + 1:
            raise ConfigError(
                f"the validation split has {len(self.val)} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                "raise --corpus-mb or lower --seq-len"
            )
        self.seq_len, self.rank, self.size = seq_len, rank, size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def _windows(self, source: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        rows = torch.stack([source[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, batch: int) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch,), generator=self.generator)
        return self._windows(self.train, starts)

    def val_batch(self, batch: int) -> tuple[Tensor, Tensor]:
        """This rank's share of ``batch * size`` windows spread evenly over the validation split."""
        total = batch * self.size
        starts = torch.linspace(0, len(self.val) - self.seq_len - 1, total).long()
        return self._windows(self.val, starts[self.rank :: self.size])
