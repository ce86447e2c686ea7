"""Tensor <-> wire encoding (docs/DESIGN.md §3.1: little-endian, row-major).

bf16 is the default for Q/K: it halves the bytes of fp32, and the daemon
computes increments from exactly the values sent. The decoder is pure numpy
so that tests and tools can read what went over the wire without torch.
"""
import sys

import numpy as np
import torch

from foreshock.v1 import ingest_pb2 as pb

# name -> (wire enum, torch dtype, little-endian numpy dtype of the raw bits)
_DTYPES = {
    "bf16": (pb.BFLOAT16, torch.bfloat16, np.dtype("<u2")),
    "fp16": (pb.FLOAT16, torch.float16, np.dtype("<f2")),
    "fp32": (pb.FLOAT32, torch.float32, np.dtype("<f4")),
}
_BY_ENUM = {wire: name for name, (wire, _, _) in _DTYPES.items()}
DTYPE_NAMES = tuple(_DTYPES)


def check_dtype(name):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, not {name!r}")
    return name


def itemsize(dtype):
    """Bytes per element on the wire."""
    return _DTYPES[check_dtype(dtype)][2].itemsize


def tensor_bytes(t, dtype="bf16"):
    """Raw little-endian row-major bytes of `t` converted to `dtype`."""
    torch_dtype = _DTYPES[check_dtype(dtype)][1]
    # Convert on the tensor's device first: a GPU tensor then crosses to the
    # host at the wire width.
    t = t.detach().to(torch_dtype).cpu().contiguous()
    if torch_dtype is torch.bfloat16:
        # numpy has no bfloat16: reinterpret the 16 bits as an integer.
        arr = t.view(torch.int16).numpy()
    else:
        arr = t.numpy()
    if sys.byteorder != "little":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.tobytes()


def wire_dtype(dtype):
    """The wire enum of a dtype name or torch dtype; DTYPE_UNSPECIFIED for
    others (float64 counts as fp32: it is at least as precise)."""
    if isinstance(dtype, str):
        return _DTYPES[check_dtype(dtype)][0]
    if dtype == torch.float64:
        return pb.FLOAT32
    for wire, torch_dtype, _ in _DTYPES.values():
        if dtype == torch_dtype:
            return wire
    return pb.DTYPE_UNSPECIFIED


def encode_tensor(t, dtype="bf16"):
    """A foreshock.v1.Tensor holding `t` as `dtype` ("bf16", "fp16" or "fp32")."""
    return pb.Tensor(dtype=_DTYPES[check_dtype(dtype)][0], shape=list(t.shape),
                     data=tensor_bytes(t, dtype))


def decode_tensor(msg):
    """A float32 numpy array with the values of a foreshock.v1.Tensor."""
    if msg.dtype not in _BY_ENUM:
        raise ValueError(f"unsupported wire dtype {msg.dtype}")
    name = _BY_ENUM[msg.dtype]
    bits = np.frombuffer(msg.data, dtype=_DTYPES[name][2])
    if name == "bf16":
        # A bf16 value is the upper half of the float32 with the same bits.
        values = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        values = bits.astype(np.float32)
    return values.reshape(tuple(msg.shape))
