"""Wire encoding of tensors: what the daemon decodes must be what torch computed."""
import numpy as np
import pytest
import torch

from foreshock import encoding
from foreshock.v1 import ingest_pb2 as pb


def test_bf16_bytes_decode_to_torch_bfloat16_values():
    torch.manual_seed(0)
    t = torch.randn(3, 5, 7) * torch.logspace(-6, 6, 7)  # wide range of exponents
    msg = encoding.encode_tensor(t, "bf16")
    assert msg.dtype == pb.BFLOAT16
    assert list(msg.shape) == [3, 5, 7]
    assert len(msg.data) == t.numel() * 2
    decoded = encoding.decode_tensor(msg)
    expected = t.to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(decoded, expected)
    # bf16 keeps 8 significant bits: the roundtrip is close to, not equal to, fp32.
    np.testing.assert_allclose(decoded, t.numpy(), rtol=2 ** -8)
    assert not np.array_equal(decoded, t.numpy())


def test_bf16_bytes_are_little_endian_row_major():
    t = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    data = encoding.encode_tensor(t, "bf16").data
    # bf16 of 1.0 is 0x3F80, of -2.0 0xC000, of 0.5 0x3F00, of 3.0 0x4040.
    assert data == bytes([0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x40, 0x40])


def test_fp32_and_fp16_roundtrip():
    t = torch.randn(4, 6, dtype=torch.float64)
    fp32 = encoding.encode_tensor(t, "fp32")
    assert fp32.dtype == pb.FLOAT32 and len(fp32.data) == 4 * 24
    np.testing.assert_array_equal(encoding.decode_tensor(fp32), t.float().numpy())
    fp16 = encoding.encode_tensor(t, "fp16")
    assert fp16.dtype == pb.FLOAT16 and len(fp16.data) == 2 * 24
    np.testing.assert_array_equal(encoding.decode_tensor(fp16), t.half().float().numpy())


def test_non_contiguous_and_special_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # a transposed view
    t[0, 0] = float("inf")
    t[1, 1] = float("nan")
    decoded = encoding.decode_tensor(encoding.encode_tensor(t, "bf16"))
    assert decoded.shape == (4, 3)
    assert np.isinf(decoded[0, 0]) and np.isnan(decoded[1, 1])
    np.testing.assert_array_equal(decoded[2], t[2].numpy())


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError):
        encoding.encode_tensor(torch.zeros(2), "int8")
