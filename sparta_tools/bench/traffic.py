"""Uneven all-to-all traffic for the `alltoallv` suite: who sends how many elements to whom.

Every pattern is a matrix M[i][j] of elements rank i sends rank j, the same on every rank
(computed locally from `--seed`, a file, or the routing of an MoE router on seeded tokens):

    uniform   M[i][j] = count / n: each rank sends `count` elements, evenly
    zipf      destination j gets weight 1 / rank_j^s (rank_j: a seeded order of the ranks, the
              same for every source, as hot experts are hot for every token): receivers are
              skewed, senders even (--zipf-s, default 1.1)
    moe       rows per destination from a real top-k router (sparta.moe's TopKRouter, seeded
              gate) on each rank's seeded tokens, experts spread over the ranks as an
              expert-parallel MoE layer holds them (--moe-experts, --moe-top-k, --moe-tokens);
              `--moe-counts FILE` takes the rows per expert recorded on each rank of a real run
              instead (JSON: {"counts": [[rows of rank i for global expert e] for each rank i]});
              a row is count * n / (routed rows) elements wide, so the mean rank sends ~count
    file      `--matrix FILE`: JSON [[bytes]] n x n, used as given (one point; -b/-e ignored)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from sparta.errors import ConfigError

PATTERNS = ("uniform", "zipf", "moe", "file")


def uniform(n: int, count: int) -> list[list[int]]:
    """Every rank sends ``count / n`` elements to every rank: [sender][receiver] counts."""
    each = max(1, count // n)
    return [[each] * n for _ in range(n)]


def zipf(n: int, count: int, s: float, seed: int) -> list[list[int]]:
    """Every rank sends to receiver j in proportion to 1 / rank(j)^s, the receivers' order shuffled by ``seed``: hot
    experts' ranks take more ([sender][receiver] counts, ``count`` per sender)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    weights = [1.0 / (order[j] + 1) ** s for j in range(n)]
    total = sum(weights)
    return [[max(0, round(count * w / total)) for w in weights] for _ in range(n)]


def moe_rows(n: int, experts: int, top_k: int, tokens: int, d_model: int, seed: int) -> list[list[int]]:
    """Rows rank i sends rank j when each rank routes `tokens` seeded tokens with a seeded
    top-k router and rank j holds experts [j E/n, (j+1) E/n)."""
    from sparta.moe import MoEConfig, build_router

    if experts % n:
        raise ConfigError(f"--moe-experts {experts} cannot be spread over {n} ranks; use a multiple of {n}")
    torch.manual_seed(seed)
    router = build_router(MoEConfig(d_model, 4 * d_model, experts, top_k=top_k, router="topk")).eval()
    rows = []
    with torch.no_grad():
        for i in range(n):
            x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(seed * 7919 + i))
            out = router(x)
            assert out.expert_idx is not None
            per_expert = torch.bincount(out.expert_idx.flatten(), minlength=experts)
            rows.append(per_expert.view(n, experts // n).sum(1).tolist())
    return rows


def counts_file(path: str, n: int) -> list[list[int]]:
    """Rows per destination rank from recorded rows per global expert on each rank."""
    data = json.loads(Path(path).read_text())
    counts = data["counts"] if isinstance(data, dict) else data
    if len(counts) != n:
        raise ConfigError(
            f"--moe-counts {path}: {len(counts)} ranks recorded, the world has {n}; run with {len(counts)}"
        )
    experts = len(counts[0])
    if experts % n or any(len(c) != experts for c in counts):
        raise ConfigError(f"--moe-counts {path}: every rank needs the same number of experts, a multiple of {n}")
    per = experts // n
    return [[sum(c[j * per : (j + 1) * per]) for j in range(n)] for c in counts]


def matrix_file(path: str, n: int, elem: int) -> list[list[int]]:
    """[sender][receiver] element counts from a JSON n x n matrix of bytes (or {"matrix_bytes": ...}); ConfigError
    naming the file when it does not fit ``n`` ranks or ``elem``-byte elements."""
    data = json.loads(Path(path).read_text())
    matrix = data["matrix_bytes"] if isinstance(data, dict) else data
    if len(matrix) != n or any(len(row) != n for row in matrix):
        raise ConfigError(f"--matrix {path}: need an {n} x {n} matrix of bytes (the world has {n} ranks)")
    bad = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row) if int(v) < 0 or int(v) % elem]
    if bad:
        raise ConfigError(f"--matrix {path}: entries {bad[:4]} are negative or not whole {elem}-byte elements")
    return [[int(v) // elem for v in row] for row in matrix]


def scaled_rows(rows: list[list[int]], count: int) -> list[list[int]]:
    """Rows -> elements: rows of width count * n / (all rows), at least 1."""
    n = len(rows)
    total = sum(map(sum, rows))
    width = max(1, round(count * n / total)) if total else 1
    return [[r * width for r in row] for row in rows]
