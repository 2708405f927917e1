#!/usr/bin/env python3
"""axiom on CUDA with a Qwen3-30B-A3B-shaped mixture of experts of random weights (48 layers,
hidden 2048, 128 experts of FFN 768, 8 a token, 32 query heads of 128 over 4 KV heads, vocab
151936), beside the device's copy bandwidth and, with --llama-bench, llama.cpp on the same files.

Writes GGUF files (`qwen3moe`, stacked expert tensors as llama.cpp writes them) in bf16, Q8_0,
Q4_K, or `q4_k_m`: llama-quantize's Q4_K_M mix for this architecture (Q6_K for the output head and
for attn_v and the down experts of half the layers, Q4_K elsewhere; routers and norms in f32),
runs `axiom bench --backend cuda` on each, and reports decode
against the roofline of the bytes a token reads: the dense matrices, 8 of 128 experts' and one row
of the embedding table. Needs torch on a CUDA machine (the weights are drawn there) and the disk
for each file in turn (bf16: 61 GB, Q8_0: 32 GB, Q4_K: 17 GB, Q4_K_M: 18.6 GB).

    python3 scripts/bench_cuda_moe.py --axiom target/release/axiom [--types q8_0,q4_k,q4_k_m] [--dir /root]
        [--llama-bench llama-bench] [--llama-quantize llama-quantize] [--prompt 512,2048] [--keep]
        [--layers 48]

--layers takes fewer layers (a smaller file, the same per-layer shapes) for quick A/B runs.
With --llama-quantize, `q4_k_m` is written by llama.cpp's llama-quantize from a Q8_0 file of the
same weights (its own choice of types; the file's size must match the mix above within 1%, as the
roofline counts its bytes by that mix).
"""
import argparse
import json
import os
import subprocess
import time

import numpy as np
import torch

import bench_cuda_8b as dense
from bench_cuda_8b import kv_f32, kv_string, kv_strings, kv_u32

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2048, 48, 32, 4, 128
EXPERTS, USED, EXPERT_FFN, VOCAB = 128, 8, 768, 151936
ARCH = "qwen3moe"


def tensors(ty):
    """(name, dims in GGUF order, type name) of every tensor."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [("token_embd.weight", (HIDDEN, VOCAB), dense.tensor_type(ty, "token_embd.weight", None, LAYERS)),
           ("output_norm.weight", (HIDDEN,), "f32"),
           ("output.weight", (HIDDEN, VOCAB), dense.tensor_type(ty, "output.weight", None, LAYERS))]
    for i in range(LAYERS):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (HIDDEN,), "f32"), (p + "ffn_norm.weight", (HIDDEN,), "f32"),
                (p + "attn_q_norm.weight", (HEAD_DIM,), "f32"), (p + "attn_k_norm.weight", (HEAD_DIM,), "f32")]
        for name, dims in [("attn_q.weight", (HIDDEN, q)), ("attn_k.weight", (HIDDEN, kv)),
                           ("attn_v.weight", (HIDDEN, kv)), ("attn_output.weight", (q, HIDDEN)),
                           ("ffn_gate_inp.weight", (HIDDEN, EXPERTS)),
                           ("ffn_gate_exps.weight", (HIDDEN, EXPERT_FFN, EXPERTS)),
                           ("ffn_up_exps.weight", (HIDDEN, EXPERT_FFN, EXPERTS)),
                           ("ffn_down_exps.weight", (EXPERT_FFN, HIDDEN, EXPERTS))]:
            router = name == "ffn_gate_inp.weight"
            out.append((p + name, dims, "f32" if router else dense.tensor_type(ty, name, i, LAYERS)))
    return out


def random_bytes(dims, ty, gen):
    """As the dense script's, with router rows drawn at random so that routing varies by token."""
    if ty == "f32" and len(dims) == 2:
        n = int(np.prod(dims))
        # Scaled as trained routers are, so that a token's logits spread over a few units.
        return (torch.randn(n, device="cuda", generator=gen) * 0.02).cpu().numpy().tobytes()
    return dense.random_bytes(dims, ty, gen)


def write_gguf(path, ty):
    """Writes the file; returns the bytes of weights a decoded token reads."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = lambda key: f"{ARCH}.{key}"
    meta = [kv_string("general.architecture", ARCH), kv_string("general.name", f"qwen3-30b-a3b-shaped-random-{ty}"),
            kv_u32(a("block_count"), LAYERS), kv_u32(a("context_length"), 8192),
            kv_u32(a("embedding_length"), HIDDEN), kv_u32(a("feed_forward_length"), 6144),
            kv_u32(a("expert_feed_forward_length"), EXPERT_FFN), kv_u32(a("expert_count"), EXPERTS),
            kv_u32(a("expert_used_count"), USED), kv_u32(a("attention.head_count"), HEADS),
            kv_u32(a("attention.head_count_kv"), KV_HEADS), kv_u32(a("attention.key_length"), HEAD_DIM),
            kv_u32(a("attention.value_length"), HEAD_DIM), kv_f32(a("rope.freq_base"), 1000000.0),
            kv_f32(a("attention.layer_norm_rms_epsilon"), 1e-6), kv_u32(a("vocab_size"), VOCAB),
            kv_string("tokenizer.ggml.model", "gpt2"), kv_string("tokenizer.ggml.pre", "default"),
            kv_strings("tokenizer.ggml.tokens", dense.vocabulary(VOCAB)), kv_strings("tokenizer.ggml.merges", []),
            kv_u32("tokenizer.ggml.eos_token_id", 0)]
    dense.write_file(path, meta, tensors(ty), lambda dims, t: random_bytes(dims, t, gen))
    return reads(ty)


def reads(ty):
    """The bytes of weights a decoded token reads in a file of `ty`."""
    read = 0
    for name, dims, t in tensors(ty):
        if name == "token_embd.weight":
            read += dense.nbytes(dims, t) // VOCAB
        elif len(dims) == 3:
            read += dense.nbytes(dims, t) * USED // EXPERTS
        elif len(dims) == 2:
            read += dense.nbytes(dims, t)
    return read


def bench(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, flush=True)
        return []
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main():
    global LAYERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--axiom", required=True)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (a CUDA build), run on the same files")
    ap.add_argument("--llama-quantize", help="llama.cpp's llama-quantize, to write q4_k_m from a Q8_0 file")
    ap.add_argument("--types", default="bf16,q8_0,q4_k")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--prompt", default="512,2048")
    ap.add_argument("--keep", action="store_true", help="keep the files (named qwen3moe-<type>.gguf)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of the model (48 as Qwen3-30B-A3B)")
    args = ap.parse_args()
    LAYERS = args.layers
    bandwidth = dense.copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for ty in args.types.split(","):
        path = os.path.join(args.dir, f"qwen3moe-{ty}.gguf")
        t = time.time()
        if ty in dense.MIXES and args.llama_quantize:
            dense.quantize_with(args.llama_quantize, path, lambda source: write_gguf(source, "q8_0"), ty, tensors(ty))
            read = reads(ty)
        else:
            read = write_gguf(path, ty)
        print(f"{ty}: wrote {os.path.getsize(path) / 1e9:.2f} GB in {time.time() - t:.0f} s; "
              f"{read / 1e9:.2f} GB read a token", flush=True)
        roofline = bandwidth / read
        runs = [("axiom", [args.axiom, "bench", "--backend", "cuda", "-m", path, "-p", args.prompt, "-n", "128",
                           "-r", "3", "--ubatch-size", "2048", "--json"])]
        if args.llama_bench:
            runs.append(("llama.cpp", [args.llama_bench, "-m", path, "-p", args.prompt, "-n", "128", "-r", "3",
                                       "-ngl", "99", "-ub", "2048", "-fa", "1", "-o", "jsonl"]))
        for engine, cmd in runs:
            for r in bench(cmd):
                test = r.get("test") or (f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}")
                extra = f"  {100 * r['avg_ts'] / roofline:.0f}% of {roofline:.0f} tok/s" if test.startswith("tg") else ""
                rows.append(f"{ty:5} {engine:9} {test:7} {r['avg_ts']:9.1f} tok/s{extra}")
                print(rows[-1], flush=True)
        if not args.keep:
            os.remove(path)
    print("\n".join(["", "summary:"] + rows))


if __name__ == "__main__":
    main()
