#!/usr/bin/env python3
"""Perplexity of SmolLM2-135M-Instruct in FP8 against the same model in bf16 (issue 49: FP8 within
1% of bf16).

The only copy of the model at hand is the packaged GGUF (Q4_1 matrices, Q8_0 tied embedding), so
this script first writes it out as a Hugging Face Llama directory: every tensor dequantized and
stored in bf16 under transformers' names, with the Q and K rows put back from GGUF's adjacent
rotary pairs into Hugging Face's halves, config.json from the GGUF metadata, and tokenizer.json
built as the model's true tokenizer (Digits then ByteLevel over the GGUF's BPE vocabulary and
merges, ids 0..16 special). `axiom convert --type fp8 --fp8-block B` makes the FP8 directory from
it, as a user would: B is 32 by default, the largest block that keeps the model within 1% (576,
SmolLM2's width, is not whole blocks of the default 128; in blocks of 64 it is 1.7% above).
`axiom perplexity -c 512` then runs on the GGUF and both directories over the Apache 2.0 licence.
The bf16 directory must score as the GGUF does (it is the same model); the FP8 one must stay
within 1% of the bf16 one, else the script exits 1. Needs numpy, gguf and tokenizers (installed
from PyPI if missing), not torch.

    python3 scripts/smollm2_fp8_perplexity.py --axiom target/release/axiom
        [--backend cpu|cuda] [--fp8-block 32] [--dir DIR] [--gguf FILE] [--text FILE]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys


def ensure(module, package):
    """Imports `module`, installing `package` from PyPI first if it is missing."""
    try:
        return __import__(module)
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", package],
                       check=True)
        return __import__(module)


np = ensure("numpy", "numpy")
gguf = ensure("gguf", "gguf")
ensure("tokenizers", "tokenizers")
import gguf.quants  # noqa: E402  (after the install above)

GGUF_DEFAULT = os.path.expanduser("~/.cache/axiom/SmolLM2-135M-Instruct.Q4_1.gguf")
TEXT_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates/axiom/tests/refs/smollm2/apache-2.0.txt")
# The special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...) are the vocabulary's first ids.
N_SPECIAL = 17
MAX_RATIO = 1.01
# GGUF tensor name (of a layer, after `blk.N.`) -> transformers' name (after `model.layers.N.`).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        sys.exit(f"{key} missing from the GGUF")
    return f.contents()


def hf_name(name):
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if not m or m.group(2) not in LAYER_NAMES:
        sys.exit(f"unexpected GGUF tensor {name} (an untied output.weight or a non-Llama model?)")
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def unpermute(w, heads):
    """llama.cpp's converter puts row h*d + k*d/2 + j of a Hugging Face Q/K matrix at h*d + 2j + k
    (rotary pairs adjacent, GGUF's "normal" rope); this puts it back (rotate-half order)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def to_bf16(w):
    """float32 -> bf16 (round to nearest even): its bits as uint16 (numpy has no bf16 type)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


SAFETENSORS_DTYPES = {np.dtype("<u2"): "BF16"}


def write_safetensors(path, tensors):
    """A safetensors file of `tensors` (name -> array; uint16 arrays hold bf16)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())


def write_tokenizer(reader, out):
    """tokenizer.json as the README of the references describes the model's true tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if field(reader, "tokenizer.ggml.model") != "gpt2":
        sys.exit("the GGUF's tokenizer is not byte-level BPE")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:N_SPECIAL]])
    tok.save(os.path.join(out, "tokenizer.json"))
    bos, eos = (tokens[field(reader, f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token"))},
                  f, indent=2)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(field(reader, "tokenizer.chat_template"))


def export_hf(gguf_path, out):
    """Writes the GGUF at `gguf_path` as the bf16 Hugging Face directory `out`."""
    reader = gguf.GGUFReader(gguf_path)
    if field(reader, "general.architecture") != "llama":
        sys.exit("the GGUF is not a Llama model")
    meta = lambda k: field(reader, f"llama.{k}")  # noqa: E731
    heads, kv_heads, dim = meta("attention.head_count"), meta("attention.head_count_kv"), meta("embedding_length")
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # numpy's shape is GGUF's dims reversed: (out, in), as Hugging Face stores a matrix.
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv_heads)
        tensors[hf_name(t.name)] = to_bf16(w)
    os.makedirs(out)
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": dim // heads,
        "hidden_act": "silu",
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base")),
        "vocab_size": len(field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    write_tokenizer(reader, out)


def convert_fp8(axiom, bf16_dir, out, block):
    """`axiom convert --type fp8 --fp8-block block` of the directory `bf16_dir` into `out`."""
    cmd = [axiom, "convert", bf16_dir, "-o", out, "--type", "fp8", "--fp8-block", str(block), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")


def perplexity(axiom, backend, model, text):
    """`axiom perplexity -c 512` of `model` over `text`: the final estimate it prints."""
    cmd = [axiom, "perplexity", "-m", model, "-f", text, "-c", "512", "--backend", backend]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    m = re.search(r"perplexity: ([0-9.]+)", r.stdout + r.stderr)
    if not m:
        sys.exit(f"no perplexity in the output of {' '.join(cmd)}:\n{r.stdout}{r.stderr}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--axiom", required=True, help="the axiom binary")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fp8-block", type=int, default=32, help="the FP8 scales' block (axiom convert --fp8-block)")
    ap.add_argument("--dir", default="/tmp/smollm2_fp8", help="where the bf16 and FP8 directories go (replaced)")
    ap.add_argument("--gguf", default=GGUF_DEFAULT, help="the Q4_1 GGUF (axiom's packaged smollm2-135m)")
    ap.add_argument("--text", default=TEXT_DEFAULT, help="the text scored (the Apache 2.0 licence)")
    args = ap.parse_args()
    for path in (args.gguf, args.text):
        if not os.path.isfile(path):
            sys.exit(f"{path} not found")

    bf16_dir, fp8_dir = os.path.join(args.dir, "bf16"), os.path.join(args.dir, "fp8")
    shutil.rmtree(args.dir, ignore_errors=True)
    export_hf(args.gguf, bf16_dir)
    convert_fp8(args.axiom, bf16_dir, fp8_dir, args.fp8_block)

    results = {name: perplexity(args.axiom, args.backend, model, args.text)
               for name, model in (("gguf", args.gguf), ("bf16", bf16_dir), ("fp8", fp8_dir))}
    for name, ppl in results.items():
        print(f"{name:5} PPL {ppl:.4f}")
    ratio = results["fp8"] / results["bf16"]
    print(f"FP8 ({args.fp8_block}x{args.fp8_block} blocks)/bf16 {ratio:.4f}; bf16/GGUF {results['bf16'] / results['gguf']:.4f}")
    if ratio > MAX_RATIO:
        sys.exit(f"FP8 perplexity {(ratio - 1) * 100:.2f}% above bf16 (limit {(MAX_RATIO - 1) * 100:.0f}%)")


if __name__ == "__main__":
    main()
