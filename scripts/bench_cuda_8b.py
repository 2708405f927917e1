#!/usr/bin/env python3
"""axiom on CUDA with a Llama-3-8B-shaped model of random weights, against the device's copy
roofline and Hugging Face transformers, measured in the same run.

Writes GGUF files (hidden 4096, 32 layers, 32 heads over 8 KV heads, FFN 14336, vocab 128256,
untied output) of random weights in bf16, Q8_0, Q4_K, Q6_K, or `q4_k_m`: llama-quantize's Q4_K_M
mix, Q6_K for the output head and for attn_v and ffn_down of the layers its rule picks, Q4_K
elsewhere (random blocks with sane scales move the same bytes and do the same arithmetic as real
ones), and for `fp8` a Hugging Face FP8 directory of the same shapes (E4M3 matrices with a scale
per 128 x 128 block, as Qwen3-FP8; the embedding and output in bf16, as published FP8
checkpoints keep them), runs `axiom bench --backend cuda` on each, and reports decode tok/s
against two rooflines, the copy bandwidth over: the bytes a token reads (every matrix but the
embedding table, of which it reads one row, each in its own type), and the whole file (the bound
the CUDA issue states). Needs torch (and transformers for --hf) and an axiom binary built with
the CUDA backend.

    python3 scripts/bench_cuda_8b.py --axiom target/release/axiom
        [--types bf16,q8_0,q4_k,q6_k,q4_k_m,fp8] [--hf] [--dir /tmp] [--ubatch 512]
        [--llama-quantize llama-quantize]

With --llama-quantize, `q4_k_m` is written by llama.cpp's llama-quantize from a Q8_0 file of the
same weights (its own choice of types, which must come to the mix's size within 1%).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import time

import numpy as np
import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 4096, 32, 32, 8, 14336, 128256
# id, block elems, block bytes
TYPES = {"bf16": (30, 1, 2), "q8_0": (8, 32, 34), "q4_k": (12, 256, 144), "q6_k": (14, 256, 210)}
MIXES = {"q4_k_m"}


def more_bits(i, n):
    """llama-quantize's rule for Q4_K_M's attn_v and ffn_down: layer i of n takes Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(ty, name, layer, n_layers):
    """The type of tensor `name` (of layer `layer` of `n_layers`, or None) in a file of `ty`. For
    `q4_k_m`, llama-quantize's rule for models of more than 8 experts or none (both scripts'):
    Q6_K for the output head and for attn_v and the down projections (ffn_down, ffn_down_exps) of
    the layers `more_bits` picks, Q4_K elsewhere."""
    if ty not in MIXES:
        return ty
    more = (name == "attn_v.weight" or name.startswith("ffn_down")) and more_bits(layer, n_layers)
    return "q6_k" if name == "output.weight" or more else "q4_k"


def kv_string(key, value):
    k = key.encode()
    v = value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


def kv_u32(key, value):
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)


def kv_f32(key, value):
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<If", 6, value)


def kv_strings(key, values):
    k = key.encode()
    out = [struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, 8, len(values))]
    for v in values:
        b = v.encode()
        out.append(struct.pack("<Q", len(b)) + b)
    return b"".join(out)


def tensors(ty):
    """(name, dims in GGUF order, type name) of every tensor."""
    out = [("token_embd.weight", (HIDDEN, VOCAB), tensor_type(ty, "token_embd.weight", None, LAYERS)),
           ("output_norm.weight", (HIDDEN,), "f32"),
           ("output.weight", (HIDDEN, VOCAB), tensor_type(ty, "output.weight", None, LAYERS))]
    for i in range(LAYERS):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (HIDDEN,), "f32"), (p + "ffn_norm.weight", (HIDDEN,), "f32")]
        for name, dims in [("attn_q.weight", (HIDDEN, HIDDEN)), ("attn_k.weight", (HIDDEN, 1024)),
                           ("attn_v.weight", (HIDDEN, 1024)), ("attn_output.weight", (HIDDEN, HIDDEN)),
                           ("ffn_gate.weight", (HIDDEN, FFN)), ("ffn_up.weight", (HIDDEN, FFN)),
                           ("ffn_down.weight", (FFN, HIDDEN))]:
            out.append((p + name, dims, tensor_type(ty, name, i, LAYERS)))
    return out


def nbytes(dims, ty):
    n = int(np.prod(dims))
    if ty == "f32":
        return 4 * n
    _, elems, size = TYPES[ty]
    return n // elems * size


def random_bytes(dims, ty, gen):
    """Random weights of the type, built on the GPU (fast) and brought back as bytes."""
    n = int(np.prod(dims))
    if ty == "f32":
        return torch.ones(n, dtype=torch.float32).numpy().tobytes()
    if ty == "bf16":
        w = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        return w.view(torch.int16).cpu().numpy().tobytes()
    _, elems, size = TYPES[ty]
    blocks = torch.randint(0, 256, (n // elems, size), device="cuda", dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n // elems, device="cuda", generator=gen) * 0.002 + 0.0005).half().view(torch.uint8).view(-1, 2)
    if ty == "q8_0":
        blocks[:, 0:2] = scale
    elif ty == "q4_k":  # d and dmin, then every sub-block's scale 8 and min 60 (its 6-bit packing)
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
        # A value is then d * (8q - 60) for q in 0..15: centred on 0, as trained weights are. Random
        # scale bytes gave weights of mean ~0.3, whose products grew layer by layer past f16's range
        # (prompt steps then filled with NaN, and a mixture's routing with it).
        blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16] = 8, 252, 200
    else:  # q6_k: signed 8-bit scales times d, so d is a sixteenth of the others'
        blocks[:, 208:210] = (scale.view(torch.float16) / 16).view(torch.uint8).view(-1, 2)
    return blocks.cpu().numpy().tobytes()


def vocabulary(size=None):
    """GPT-2's 256 byte pieces, so that any text (JSON under a constraint, say) has tokens, then
    made-up pieces up to `size`."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    pieces = [chr(b) for b in printable]
    pieces += [chr(256 + i) for i in range(256 - len(pieces))]
    return pieces + [f"t{i}" for i in range(len(pieces), size or VOCAB)]


def write_gguf(path, ty):
    """Writes the file; returns the bytes of the matrices a token reads (all but the embedding)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = [kv_string("general.architecture", "llama"), kv_string("general.name", f"llama3-8b-shaped-random-{ty}"),
            kv_u32("llama.block_count", LAYERS), kv_u32("llama.context_length", 8192),
            kv_u32("llama.embedding_length", HIDDEN), kv_u32("llama.feed_forward_length", FFN),
            kv_u32("llama.attention.head_count", HEADS), kv_u32("llama.attention.head_count_kv", KV_HEADS),
            kv_f32("llama.rope.freq_base", 500000.0), kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
            kv_u32("llama.vocab_size", VOCAB), kv_string("tokenizer.ggml.model", "gpt2"),
            kv_string("tokenizer.ggml.pre", "default"), kv_strings("tokenizer.ggml.tokens", vocabulary()),
            kv_strings("tokenizer.ggml.merges", []), kv_u32("tokenizer.ggml.eos_token_id", 0)]
    write_file(path, meta, tensors(ty), lambda dims, t: random_bytes(dims, t, gen))
    return reads(ty)


def reads(ty):
    """The bytes of the matrices a token reads in a file of `ty` (all but the embedding)."""
    return sum(nbytes(d, t) for n, d, t in tensors(ty) if len(d) == 2 and n != "token_embd.weight")


def quantize_with(llama_quantize, path, write_source, mix, tensor_list):
    """Writes `path` in llama.cpp's `mix` (q4_k_m) by `llama_quantize` from the Q8_0 file that
    `write_source(source)` writes beside it, and refuses the result unless its size is that of
    `tensor_list` (the mix as these scripts lay it out) within 1%: the rooflines count its bytes so."""
    source = path + ".q8_0-source"
    write_source(source)
    subprocess.run([llama_quantize, "--allow-requantize", source, path, mix.upper()], check=True,
                   stdout=subprocess.DEVNULL)
    os.remove(source)
    expected = sum(nbytes(d, t) for _, d, t in tensor_list)
    if abs(os.path.getsize(path) / expected - 1) > 0.01:
        raise SystemExit(f"llama-quantize wrote {os.path.getsize(path)} bytes, the {mix} mix is {expected}")


def write_file(path, meta, tensor_list, draw):
    """A GGUF of `meta` (encoded key-values) and the tensors of `tensor_list` ((name, dims in GGUF
    order, type name)), each one's bytes from `draw(dims, type name)`."""
    infos, offset = [], 0
    for name, dims, t in tensor_list:
        tid = 0 if t == "f32" else TYPES[t][0]
        b = name.encode()
        infos.append(struct.pack("<Q", len(b)) + b + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", tid, offset))
        offset += (nbytes(dims, t) + 31) // 32 * 32
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(meta)))
        f.write(b"".join(meta) + b"".join(infos))
        f.write(b"\0" * ((32 - f.tell() % 32) % 32))
        for name, dims, t in tensor_list:
            data = draw(dims, t)
            f.write(data + b"\0" * ((32 - len(data) % 32) % 32))


def write_fp8_dir(path):
    """Writes the FP8 directory (config.json, model.safetensors, a tokenizer); returns the bytes
    of what a token reads (every tensor but the embedding table)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "vocab_size": VOCAB,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2,
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # The tiny Llama 3 fixture's tokenizer: `axiom bench` feeds random ids, the text is never read.
    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../crates/axiom/tests/fixtures/hf/llama3")
    shutil.copy(os.path.join(fixture, "tokenizer.json"), path)
    kv = HIDDEN // HEADS * KV_HEADS
    matrices = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN), "self_attn.v_proj": (kv, HIDDEN),
                "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
                "mlp.down_proj": (HIDDEN, FFN)}
    entries = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN)), ("model.norm.weight", "BF16", (HIDDEN,)),
               ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        entries += [(p + "input_layernorm.weight", "BF16", (HIDDEN,)),
                    (p + "post_attention_layernorm.weight", "BF16", (HIDDEN,))]
        for name, (rows, cols) in matrices.items():
            entries += [(p + name + ".weight", "F8_E4M3", (rows, cols)),
                        (p + name + ".weight_scale_inv", "F32", (-(-rows // 128), -(-cols // 128)))]
    size = {"BF16": 2, "F8_E4M3": 1, "F32": 4}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        n = int(np.prod(shape)) * size[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)

    def draw(name, dtype, shape):
        if name.endswith("_scale_inv"):  # codes about N(0, 64^2): weights about N(0, 0.02^2)
            return torch.full(shape, 0.02 / 64, dtype=torch.float32).numpy().tobytes()
        if dtype == "F8_E4M3":
            codes = (torch.randn(shape, device="cuda", generator=gen) * 64).clamp(-448, 448)
            return codes.to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy().tobytes()
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        w = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        return w.view(torch.int16).cpu().numpy().tobytes()

    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in entries:
            f.write(draw(name, dtype, shape))
    return sum(int(np.prod(s)) * size[d] for n, d, s in entries if n != "model.embed_tokens.weight")


def copy_bandwidth():
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / sorted(times)[len(times) // 2]


def hf_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    out = {}
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (1, 2048), device="cuda")
        for n in (512, 2048):
            model(ids[:, :n])
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(ids[:, :n])
            torch.cuda.synchronize()
            out[f"pp{n}"] = n / (time.perf_counter() - t)
        model.generate(ids[:, :8], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids[:, :8], max_new_tokens=128, min_new_tokens=128, do_sample=False)
        torch.cuda.synchronize()
        out["tg128"] = 128 / (time.perf_counter() - t)
    del model
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--axiom", required=True)
    ap.add_argument("--types", default="bf16,q8_0,q4_k")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--prompt", default="512,2048")
    ap.add_argument("--ubatch", default="512", help="most prompt tokens in one axiom step (llama-bench's -ub)")
    ap.add_argument("--llama-quantize", help="llama.cpp's llama-quantize, to write q4_k_m from a Q8_0 file")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for ty in args.types.split(","):
        if ty not in TYPES and ty not in MIXES and ty != "fp8":
            ap.error(f"unknown type {ty!r}; known: {', '.join([*TYPES, *MIXES, 'fp8'])}")
    for ty in args.types.split(","):
        t = time.time()
        if ty == "fp8":
            path = os.path.join(args.dir, "llama3-8b-random-fp8")
            weight_bytes = write_fp8_dir(path)
            file_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        else:
            path = os.path.join(args.dir, f"llama3-8b-random-{ty}.gguf")
            if ty in MIXES and args.llama_quantize:
                quantize_with(args.llama_quantize, path, lambda source: write_gguf(source, "q8_0"), ty, tensors(ty))
                weight_bytes = reads(ty)
            else:
                weight_bytes = write_gguf(path, ty)
            file_bytes = os.path.getsize(path)
        print(f"{ty}: wrote {file_bytes / 1e9:.2f} GB in {time.time() - t:.0f} s", flush=True)
        out = subprocess.run([args.axiom, "bench", "--backend", "cuda", "-m", path, "-p", args.prompt, "-n", "128", "-r", "3",
                              "--ubatch-size", args.ubatch, "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr)
            continue
        read_roofline, file_roofline = bandwidth / weight_bytes, bandwidth / file_bytes
        for line in out.stdout.splitlines():
            r = json.loads(line)
            extra = ""
            if r["test"].startswith("tg"):
                extra = (f"  {100 * r['avg_ts'] / read_roofline:.0f}% of {read_roofline:.0f} tok/s (bytes read a token),"
                         f" {100 * r['avg_ts'] / file_roofline:.0f}% of {file_roofline:.0f} (whole file)")
            rows.append(f"{ty:5} {r['test']:7} {r['avg_ts']:9.1f} tok/s{extra}")
            print(rows[-1], flush=True)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if args.hf:
        for test, rate in hf_transformers().items():
            rows.append(f"HF transformers bf16 {test}: {rate:.1f} tok/s")
            print(rows[-1], flush=True)
    print("\n".join(["", "summary:"] + rows))


if __name__ == "__main__":
    main()
