"""Dtype policy: which dtypes move as raw bytes and what each engine reduces them in.

Data movement (all-to-all, gathers, broadcast) never depends on the engine's dtype support:
every tensor travels as uint8. Only reductions need a dtype the engine understands; where it
lacks one (bfloat16 on Horovod and MPI, for instance) we reduce in a wider dtype and cast
back, which is also more accurate than reducing in the narrow one.
"""

from __future__ import annotations

import torch

from sparta.errors import InputError

# Stable small integers so ranks can compare dtypes inside an int64 metadata exchange.
DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i + 1
    for i, dt in enumerate(
        [
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ]
    )
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}

# What each dtype is summed in when the engine lacks it. Complex numbers are summed as pairs
# of reals (view_as_real), which is exact.
_WIDEN: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.bool: torch.int32,
    torch.int16: torch.int32,
    torch.int8: torch.int32,
    torch.uint8: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.float8_e4m3fn: torch.float32,
    torch.float8_e5m2: torch.float32,
}


def dtype_code(dtype: torch.dtype) -> int:
    """The integer that stands for ``dtype`` in agreement rows (0: a dtype no engine moves)."""
    return DTYPE_CODES.get(dtype, 0)


def dtype_name(code: int) -> str:
    """The dtype's name for a `dtype_code`, for error messages."""
    dt = CODE_DTYPES.get(code)
    return str(dt).replace("torch.", "") if dt is not None else f"<unknown dtype code {code}>"


def reduction_dtype(dtype: torch.dtype, native: frozenset[torch.dtype], engine: str) -> torch.dtype:
    """The dtype an engine that sums `native` dtypes should reduce a `dtype` tensor in."""
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    if dtype in native:
        return dtype
    wide = _WIDEN.get(dtype)
    if wide is not None and wide in native:
        return wide
    known = ", ".join(sorted(str(d).replace("torch.", "") for d in native | set(_WIDEN)))
    raise InputError(
        f"{engine} cannot reduce dtype {dtype}; reducible dtypes are: {known}. "
        f"Cast the tensor (e.g. x.to(torch.int64) or x.float()) before the reduction."
    )


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy of `x` (no copy when already contiguous)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Flat uint8 ``buf`` seen as ``dtype`` in ``shape`` (a view: no copy)."""
    return buf.view(dtype).view(shape)


REDUCE_OPS = ("sum", "avg")


def widened_for_reduction(
    x: torch.Tensor, op: str, problem: str | None, native: frozenset[torch.dtype], engine: str
) -> tuple[torch.Tensor, str | None]:
    """``x`` in the dtype ``engine`` sums it in (its ``native`` reduce dtypes; complex as
    real pairs), contiguous; or ``x`` and what keeps it from being reduced (``problem`` if
    one is already known, an unknown ``op``, ``avg`` of integers, a dtype no engine sums)."""
    if problem is not None:
        return x, problem
    if op not in REDUCE_OPS:
        return x, f"unknown reduction op {op!r}; use one of {REDUCE_OPS}"
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        return x, f"op='avg' needs a floating dtype, got {x.dtype}; use op='sum' and divide"
    try:
        dt = reduction_dtype(x.dtype, native, engine)
    except InputError as exc:
        return x, str(exc)
    y = torch.view_as_real(x.contiguous()) if x.is_complex() else x
    return y.to(dt).contiguous(), None


def reduction_result(y: torch.Tensor, like: torch.Tensor, op: str, size: int) -> torch.Tensor:
    """The sum ``y`` of ``size`` ranks' widened tensors back in ``like``'s dtype (the mean
    for ``avg``; bool as any-true)."""
    if op == "avg":
        y = y / size
    if like.is_complex():
        return torch.view_as_complex(y.to(torch.view_as_real(like).dtype).contiguous())
    if like.dtype == torch.bool:
        return y != 0
    return y.to(like.dtype)
