"""Argument checks for the elementwise / sampling / matmul wrappers: each raises ValueError naming the
function, the argument, what it got (shape / dtype / stride / device) and what was expected."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    where: str,
    name: str,
    tensor: object,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    dtype_from: str | None = None,
) -> torch.Tensor:
    """shape: expected sizes, None where any size goes; device: where the first argument lives;
    where: the function, prefixed to the message ("" for none); dtype_from: the argument whose dtype
    this one must share, named in the error."""
    prefix = f"{where}: " if where else ""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{prefix}{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        expected = "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"
        raise ValueError(f"{prefix}{name} has shape {list(tensor.shape)}, expected {expected}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{prefix}{name} has dtype {tensor.dtype}, expected {_expected_dtypes(dtypes, dtype_from)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{prefix}{name} is on {tensor.device}, expected {device} (where the first argument is)")
    # the kernels load whole rows / head vectors along the last dim; a strided one would gather element-wise
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{prefix}{name} has strides {list(tensor.stride())}, expected stride 1 in its last dim")
    return tensor


def output_tensor(
    where: str,
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    like: torch.Tensor,
    dtype_from: str | None = None,
) -> torch.Tensor:
    """Every wrapper's optional output: a new tensor of shape in like's dtype and device when out is
    None, else out checked for that shape, dtype and device (and a dense last dim)."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return check_tensor(where, name, out, shape, (like.dtype,), like.device, True, dtype_from)


def _expected_dtypes(dtypes: tuple[torch.dtype, ...], dtype_from: str | None) -> str:
    if dtype_from:
        return f"{dtypes[0]} ({dtype_from}'s dtype)"
    names = [str(dtype) for dtype in dtypes]
    if len(names) <= 2:
        return " or ".join(names)
    return "one of " + ", ".join(names[:-1]) + " or " + names[-1]
