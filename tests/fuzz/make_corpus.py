#!/usr/bin/python3
"""Writes the fuzzers' seed corpora under tests/fuzz/corpus/<target>/.

Small, valid inputs and a few near misses, so each fuzzer starts from the
formats' real shapes: safetensors files as WriteSafetensors lays them out,
config.json files of every supported model type, StreamRequests as the
clients send them (Open, Batch, an Open and a Batch), and StreamResponse
chunks in the encoder's canonical form and in protobuf's own. Protobuf is
encoded by hand (no generated module needed). Run it again after changing a
format: `python3 tests/fuzz/make_corpus.py`.
"""

import json
import pathlib
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = HERE / "corpus"


def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(field, wire):
    return varint(field << 3 | wire)


def vfield(field, n):
    return tag(field, 0) + varint(n)


def lfield(field, payload):
    return tag(field, 2) + varint(len(payload)) + payload


def packed(field, values):
    return lfield(field, b"".join(varint(v) for v in values))


def safetensors(tensors, metadata=None, pad_to=8):
    """tensors: list of (name, dtype, shape, raw bytes), packed in order."""
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main():
    if OUT.exists():
        shutil.rmtree(OUT)

    bf16 = struct.pack("<6H", *range(0x3F80, 0x3F86))
    f32 = struct.pack("<f", 1.5)
    two = [("a.weight", "BF16", [2, 3], bf16), ("b.bias", "F32", [1], f32)]
    write("safetensors", "two_tensors", safetensors(two, {"format": "pt"}))
    write("safetensors", "empty_tensor",
          safetensors([("e", "F16", [0, 4], b""), ("x", "I32", [1], struct.pack("<i", 7))]))
    write("safetensors", "fp8", safetensors([("w", "F8_E4M3", [2, 2], b"\x38\x40\xb8\xc0"),
                                             ("w_scale_inv", "F32", [1, 1], f32)]))
    write("safetensors", "no_tensors", safetensors([]))
    write("safetensors", "shifted_header", b"\x10" + safetensors(two)[1:])  # length off
    write("safetensors", "trailing", safetensors(two) + b"\0\0")

    models = REPO / "tests" / "data" / "models"
    for cfg in sorted(models.glob("*/config.json")):
        write("config", cfg.parent.name, cfg.read_bytes())
    write("config", "qwen3_5_text_minimal", json.dumps({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25}}).encode())
    write("config", "fp8_quantized", json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}}).encode())

    open_all = lfield(1, packed(1, [0, 1, 2, 3, -1]) + vfield(5, 8) +
                      lfield(7, b"fuzz-seed"))
    open_fp = lfield(1, packed(1, [1, -1]) + vfield(2, 1) + lfield(4, b"0123abcd"))
    batch = lfield(2, vfield(1, 7) + packed(2, [1, 2, 3, 4, 5, 6]) + packed(3, [2, 4]))
    batch_layers = lfield(2, vfield(1, 8) + packed(2, [9] * 5) + packed(3, [5]) +
                          packed(4, [3, 0]))
    batch_unpacked = lfield(2, vfield(1, 9) + vfield(2, 1) + vfield(2, 2) + vfield(3, 2))
    write("stream_request", "open", open_all)
    write("stream_request", "open_fingerprint", open_fp)
    write("stream_request", "batch", batch)
    write("stream_request", "batch_layers", batch_layers)
    write("stream_request", "batch_unpacked", batch_unpacked)
    for name, first, second in (("open_then_batch", open_all, batch),
                                ("open_then_batch_layers", open_all, batch_layers)):
        write("stream_request", name, b"\xff" + struct.pack("<H", len(first)) + first + second)

    payload = bytes(range(48))
    canonical = lfield(2, vfield(1, 3) + vfield(2, 16) + vfield(3, 4) + lfield(4, payload))
    write("chunk", "canonical_one_slice", b"\x00" + canonical)
    write("chunk", "canonical_sliced", b"\x13" + canonical)
    write("chunk", "protobuf_zero_omitted", b"\x00" + lfield(2, vfield(1, 5) + lfield(4, payload)))
    write("chunk", "unknown_field", b"\x05" + lfield(2, vfield(3, 1) + vfield(9, 77) +
                                                     vfield(1, 2) + lfield(4, payload[:8])))
    write("chunk", "done", b"\x00" + lfield(3, vfield(1, 3) + vfield(2, 16)))
    write("chunk", "error", b"\x00" + lfield(4, vfield(1, 3) + vfield(2, 3) + lfield(3, b"bad")))


if __name__ == "__main__":
    main()
