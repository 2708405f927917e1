#!/usr/bin/env python3
"""Writes crates/axiom/tests/fixtures/quants.gguf: for each tensor type axiom supports, a small
tensor of random blocks (`<TYPE>.raw`, stored in that type) and its dequantization by the `gguf`
PyPI package (`<TYPE>.expected`, F32). The metadata holds one value of every GGUF value type,
including nested arrays, so the same file also tests the reader.

    pip install gguf==0.19.0 numpy && python3 scripts/make_quant_fixtures.py
"""
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import GGUFWriter, quants

# Byte offsets of the f16 scale fields inside one block: random bytes there could be NaN or inf.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
ROWS = 3


def random_blocks(rng, ty, n_blocks):
    block_len, block_bytes = quants.GGML_QUANT_SIZES[ty]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[ty]:
        scale = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw


def main():
    rng = np.random.default_rng(20261130)
    out = Path(__file__).resolve().parent.parent / "crates/axiom/tests/fixtures/quants.gguf"
    w = GGUFWriter(out, arch="fixture")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 1.5)
    w.add_float64("test.f64", -2.25)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo ✓")
    w.add_array("test.array_i32", [1, -2, 3])
    w.add_array("test.array_str", ["a", "bc", ""])
    w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)

    for ty in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        block_len, _ = quants.GGML_QUANT_SIZES[ty]
        per_row = 2 if block_len == 256 else 3
        raw = random_blocks(rng, ty, ROWS * per_row).reshape(ROWS, -1)
        expected = quants.dequantize(raw, ty).astype(np.float32)
        assert expected.shape == (ROWS, per_row * block_len) and np.isfinite(expected).all()
        w.add_tensor(f"{ty.name}.raw", raw, raw_dtype=ty)
        w.add_tensor(f"{ty.name}.expected", expected)

    floats = rng.standard_normal((ROWS, 40)).astype(np.float32)
    for ty, data in [(T.F32, floats), (T.F16, floats.astype(np.float16))]:
        w.add_tensor(f"{ty.name}.raw", data)
        w.add_tensor(f"{ty.name}.expected", data.astype(np.float32))
    bf16_bits = (floats.view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("BF16.raw", bf16_bits.view(np.uint8).reshape(ROWS, -1), raw_dtype=T.BF16)
    w.add_tensor("BF16.expected", quants.dequantize(bf16_bits.view(np.uint8), T.BF16).astype(np.float32).reshape(ROWS, -1))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
