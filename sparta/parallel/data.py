"""The trainer's data: token streams and the batch of every step.

Two sources (``DataConfig.source``):

- ``"stdlib"``: Python's own standard library, tokenised by a byte-level BPE trained on it.
  For a given Python everything is deterministic: files in sorted order, the first
  ``corpus_mb`` MB of them. The tokenizer and the token stream are cached under
  ``<cache_dir>/<key>`` (default ``~/.cache/sparta/demo``) where the key hashes the corpus, the
  vocabulary size and the tokenizer version, so a second run only loads them. Needs the
  ``tokenizers`` package (``pip install sparta[demo]``).
- ``"random"``: uniform random tokens from a seeded generator, made on every rank alike with
  no communication; for throughput runs (a model cannot beat ln(vocab_size) on them).

The batch of step ``s`` is a pure function of ``(seed, s)``: the global batch's windows are
drawn from a generator seeded by both, and data-parallel rank ``d`` of ``dp`` takes rows
``[d * B / dp, (d + 1) * B / dp)``. So the data position of a checkpoint is its step alone, a
resumed run sees exactly the batches the uninterrupted one saw, and every layout (any dp)
trains on the same global batches.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from sparta.comm import Communicator
from sparta.errors import BackendUnavailableError, ConfigError, SpartaError

DEFAULT_CACHE = Path.home() / ".cache" / "sparta" / "demo"
END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_ID = 0  # its id: the BPE's one special token comes first; it closes every file
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


def _tokenizers():  # noqa: ANN202 - the module, imported only where the stdlib source is used
    try:
        import tokenizers
    except ImportError as e:
        raise BackendUnavailableError(
            "data.source = 'stdlib' trains a BPE tokenizer and needs the tokenizers package: "
            "pip install 'sparta[demo]' (or tokenizers), or use data.source = 'random'"
        ) from e
    return tokenizers


def _build(texts: list[str], vocab_size: int, folder: Path) -> None:
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot != END_OF_TEXT_ID:  # documents (documents.py) end at this id
        raise ConfigError(
            f"the tokenizer gave {END_OF_TEXT} id {eot}, not {END_OF_TEXT_ID}: this tokenizers version numbers "
            "special tokens otherwise; install one that gives the first special token id 0, or use "
            "data.source = 'random'"
        )
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)  # files are documents: the model learns where one ends
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(folder / "tokenizer.json", lambda p: tokenizer.save(str(p)))
    _write_atomically(folder / "tokens.pt", lambda p: torch.save(torch.tensor(ids, dtype=torch.int32), p))


def _rank0_tokens(corpus_mb: float, vocab_size: int, cache: Path, log: Callable[[str], object]) -> Tensor:
    texts = stdlib_corpus(corpus_mb)
    digest = hashlib.sha256("\0".join(texts).encode())  # \0: file boundaries change the tokens too
    version = _tokenizers().__version__
    folder = cache / f"{digest.hexdigest()[:16]}-v{vocab_size}-tok{version}"
    if not (folder / "tokens.pt").exists():
        log(f"training a {vocab_size}-token BPE on {len(texts)} stdlib files ({corpus_mb:g} MB) -> {folder}")
        _build(texts, vocab_size, folder)
    tokens = torch.load(folder / "tokens.pt")
    log(f"{len(tokens):,} tokens from {len(texts)} stdlib files, cached in {folder}")
    return tokens


def stdlib_tokens(
    comm: Communicator, corpus_mb: float, vocab_size: int, cache_dir: Path | None, log: Callable[[str], object]
) -> Tensor:
    """The stdlib corpus as a flat int64 token tensor [N], the same on every rank of ``comm``.

    Collective over ``comm``. Only its rank 0 reads the corpus and, when the cache misses,
    trains the tokenizer and tokenises; it then broadcasts the tokens, so the other ranks need
    neither the files nor a home folder shared with rank 0 (on several nodes).
    """
    tokens = torch.empty(0, dtype=torch.int32)
    problem: SpartaError | None = None
    if comm.rank == 0:
        try:
            tokens = _rank0_tokens(corpus_mb, vocab_size, cache_dir or DEFAULT_CACHE, log)
        except SpartaError as exc:
            problem = exc
        except OSError as exc:  # an unwritable cache_dir, a full disk
            problem = ConfigError(f"the token cache: {exc}; point data.cache_dir at a writable folder")
        except Exception as exc:  # noqa: BLE001 - a damaged cache file, the tokenizer: rank 0's alone
            where = traceback.extract_tb(exc.__traceback__)[-1]
            problem = ConfigError(
                f"building the tokens failed: {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno}); if "
                "the cache under data.cache_dir is damaged, delete it to rebuild"
            )
    comm.agree(problem, "stdlib_tokens")  # else the other ranks would wait in the broadcast
    count = int(comm.broadcast(torch.tensor([len(tokens)]), src=0))
    if comm.rank != 0:
        tokens = torch.empty(count, dtype=torch.int32)
    return comm.broadcast(tokens, src=0).long()


def random_tokens(count: int, vocab_size: int, seed: int) -> Tensor:
    """``count`` uniform random token ids [count] (int64), equal on every rank for one seed."""
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(seed))


class TokenBatches:
    """The windows of every step, for one data-parallel rank.

    ``tokens`` is cut into 100 contiguous pieces and every 10th piece validates. Interleaving
    matters: the stdlib files come in name order, so a plain tail split would validate on
    other modules than the model trained on.

    Args:
        tokens: the flat token stream [N] (int64), the same on every rank.
        seq_len: tokens per window (the model's input length); a window holds seq_len + 1
            tokens, its inputs and its shifted targets.
        seed: the run's seed; with the step it fixes the step's global batch.
    """

    def __init__(self, tokens: Tensor, seq_len: int, seed: int) -> None:
        pieces = tokens.chunk(100)
        self.train = torch.cat([p for i, p in enumerate(pieces) if i % 10 != 9])
        self.val = torch.cat([p for i, p in enumerate(pieces) if i % 10 == 9])
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) < seq_len + 1:
                raise ConfigError(
                    f"the {name} split has {len(split)} tokens, fewer than model.seq_len + 1 = {seq_len + 1}: "
                    "raise data.corpus_mb (or data.random_tokens) or lower model.seq_len"
                )
        self.seq_len, self.seed = seq_len, seed

    def _windows(self, source: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        rows = torch.stack([source[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    @staticmethod
    def _mine(starts: Tensor, dp_rank: int, dp: int) -> Tensor:
        local = len(starts) // dp
        return starts[dp_rank * local : (dp_rank + 1) * local]

    def train_batch(self, step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
        """This dp rank's share of step ``step``'s global batch: (ids, targets), each
        [global_batch / dp, seq_len] int64."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        # a window is seq_len + 1 tokens: starts 0 .. len - seq_len - 1, all of them drawable
        starts = torch.randint(0, len(self.train) - self.seq_len, (global_batch,), generator=generator)
        return self._windows(self.train, self._mine(starts, dp_rank, dp))

    def val_batch(self, index: int, batches: int, global_batch: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
        """Batch ``index`` of ``batches`` fixed validation batches of ``global_batch`` windows,
        spread evenly over the validation split; this dp rank's share, as train_batch's."""
        starts = torch.linspace(0, len(self.val) - self.seq_len - 1, batches * global_batch).long()
        return self._windows(self.val, self._mine(starts.chunk(batches)[index], dp_rank, dp))
