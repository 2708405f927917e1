#!/usr/bin/env python3
"""Writes crates/axiom/tests/fixtures/hf/<arch>/: tiny randomly initialised models of each
architecture axiom runs from Hugging Face directories, saved with `save_pretrained` (safetensors,
config.json, tokenizer.json with a real BPE trained on the Apache license text, tokenizer_config.json
with a ChatML template, generation_config.json), and transformers' float32 logits for a few token
sequences (`logits.json`: ids and shapes; `logits.bin`: little-endian f32).

FP8 fixtures (FP8_FIXTURES) are written as Hugging Face publishes them, from a float model quantized
here: `qwen3_fp8` block-wise (`quant_method: fp8`, a `weight_scale_inv` per 128x128 block, beside its
bf16 source `qwen3_fp8_source` for `axiom convert --type fp8`) and `llama_fp8_channel` per channel
(compressed-tensors, `weight_scale` per row). Their logits are transformers float32 on the dequantized
weights, the exact reference for the format. `fp8_e4m3.json` holds torch's float8_e4m3fn values of
all 256 codes and its encodings of values around each.

Run where torch and transformers are, naming the fixtures to write (all of them when none is named;
a newer transformers may initialise differently, so name only the ones to add):

    python3 scripts/make_hf_fixtures.py llama_bias qwen3_bias
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from safetensors.torch import load_file, save_file
from transformers import (FineGrainedFP8Config, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/axiom/tests/fixtures/hf"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = ["The license applies to every contribution.", "Copyright 2004, all rights reserved: 1 2 3 4 5.",
         "<|im_start|>user\nWhat is a derivative work?<|im_end|>\n<|im_start|>assistant\n"]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1000, max_position_embeddings=256)
# Mixtures of experts: six or eight experts of width 48, two a token.
MOE = dict(SHAPE, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2)
# FP8: matrices of one to three 128x128 blocks each way (transformers reads whole blocks only).
FP8_SHAPE = dict(SHAPE, hidden_size=256, intermediate_size=384, head_dim=64)
FP8_BLOCK = 128


def tokenizer():
    text = (ROOT / "crates/axiom/tests/refs/smollm2/apache-2.0.txt").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token=None, chat_template=CHATML)


def sentencepiece_tokenizer():
    """A tokenizer laid out like Llama 2's and Mistral's: SentencePiece BPE with byte fallback (ids
    0-2 <unk> <s> </s>, then the 256 byte pieces <0x00>..<0xFF>, then merged pieces), spaces as
    "▁" with one prepended."""
    text = (ROOT / "crates/axiom/tests/refs/smollm2/apache-2.0.txt").read_text()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=1000 - 256, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([text], trainer)
    trained = json.loads(tok.to_str())
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for piece, _ in sorted(trained["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    trained["model"]["vocab"] = vocab
    # Merges as transformers derives them from a SentencePiece model: every split of each merged
    # piece into two pieces, the piece ranked by its id (SentencePiece's score order).
    merged = {a + b for a, b in trained["model"]["merges"]}
    merges = []
    for piece in sorted(merged, key=vocab.get):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]])))
    trained["model"]["merges"] = [list(m) for m in merges]
    trained["added_tokens"] = [dict(t, id=vocab[t["content"]]) for t in trained["added_tokens"]]
    trained["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(trained))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHATML, add_bos_token=True)


def longrope(pairs):
    """LongRoPE factor lists of `pairs` entries, unlike each other and unlike 1."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.07 * i for i in range(pairs)],
            "long_factor": [1.5 + 0.9 * i for i in range(pairs)]}


def models_to_make():
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False)),
        "llama3": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
        "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, rope_theta=1000000.0, sliding_window=None,
                                                      tie_word_embeddings=False)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)),
        # Every bias the architectures allow: Q, K, V and the output projection.
        "llama_bias": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False,
                                                     attention_bias=True)),
        "qwen3_bias": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=32, rope_theta=1000000.0,
                                                     tie_word_embeddings=True, attention_bias=True)),
        # A SentencePiece-style tokenizer (Llama 2, Mistral v0.1-0.3), for `convert`.
        "llama_spm": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False)),
        # Sliding windows shorter than the test sequences: Mistral's on every layer, Qwen2's from
        # `max_window_layers` on.
        "mistral_window": (MistralForCausalLM, MistralConfig(**SHAPE, rope_theta=10000.0, sliding_window=4,
                                                             tie_word_embeddings=False)),
        "qwen2_window": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, rope_theta=10000.0, tie_word_embeddings=True,
                                                       use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        # Gemma 2: GeGLU, four norms a layer, scaled embeddings, soft caps small enough to bite, a
        # query scale of its own, alternating windows.
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SHAPE, head_dim=32, query_pre_attn_scalar=24,
                                                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                                   sliding_window=4, rope_theta=10000.0)),
        # Gemma 3: Q/K norms, a local and a global rope (linear scaling on the global one only).
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**SHAPE, head_dim=32, query_pre_attn_scalar=32,
                                                       sliding_window=4,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       rope_parameters={
                                                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                              "rope_theta": 1000000.0},
                                                           "sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": 10000.0}})),
        # YaRN as Qwen2.5's long-context configs set it: the attention factor follows from the factor.
        "qwen2_yarn": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, rope_theta=10000.0, tie_word_embeddings=True, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
        # Phi-3-mini-128k's shape: LongRoPE over every dimension, an original context (8) below every
        # text, so transformers takes the long factors, as axiom does for a context beyond it.
        "phi3": (Phi3ForCausalLM, Phi3Config(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False,
                                             original_max_position_embeddings=8, rope_scaling=longrope(8), pad_token_id=0,
                                             bos_token_id=0, eos_token_id=2)),
        # Phi-4-mini's: three quarters of each head rotated, tied embeddings, an original context of
        # 64 (the tests' whole cache), so both take the short factors.
        "phi4_mini": (Phi3ForCausalLM, Phi3Config(**SHAPE, rope_theta=10000.0, tie_word_embeddings=True,
                                                  partial_rotary_factor=0.75, original_max_position_embeddings=64,
                                                  rope_scaling=longrope(6), pad_token_id=0, bos_token_id=0,
                                                  eos_token_id=2)),
        # Qwen3-MoE: renormalized top-2 of 6 experts; the middle of three layers dense
        # (`mlp_only_layers`).
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**dict(MOE, num_hidden_layers=3), head_dim=32,
                                                          rope_theta=1000000.0, tie_word_embeddings=False,
                                                          norm_topk_prob=True, mlp_only_layers=[1])),
        # Mixtral: top-2 of 8 experts in every layer.
        "mixtral": (MixtralForCausalLM, MixtralConfig(**dict(SHAPE, intermediate_size=48), num_local_experts=8,
                                                      num_experts_per_tok=2, rope_theta=1000000.0,
                                                      tie_word_embeddings=False)),
        # Qwen2-MoE: top-2 of 6 experts, not renormalized, and a gated shared expert.
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**MOE, shared_expert_intermediate_size=96,
                                                          rope_theta=1000000.0, tie_word_embeddings=True)),
    }


def fp8_models_to_make():
    """FP8 fixtures: the class, config and scale layout of each."""
    return {
        "qwen3_fp8": (Qwen3ForCausalLM, Qwen3Config(**FP8_SHAPE, rope_theta=1000000.0, tie_word_embeddings=True),
                      "blocks"),
        "llama_fp8_channel": (LlamaForCausalLM, LlamaConfig(**FP8_SHAPE, rope_theta=10000.0,
                                                            tie_word_embeddings=False), "channel"),
    }


def random_model(cls, config):
    torch.manual_seed(0)
    config.initializer_range = 0.2  # larger weights than the default 0.02, so logits differ clearly
    model = cls(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms not all ones
            if n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tokenizer(model, tok, d):
    tok.save_pretrained(d)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.save_pretrained(d)


def save_logits(model, tok, d, source):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    chunks = []
    with torch.no_grad():
        for seq in ids:
            chunks.append(model(torch.tensor([seq])).logits[0].float().numpy())
    (d / "logits.bin").write_bytes(np.concatenate([c.reshape(-1) for c in chunks]).astype("<f4").tobytes())
    (d / "logits.json").write_text(json.dumps({"texts": TEXTS, "ids": ids, "vocab": model.config.vocab_size,
                                               "source": source}, indent=1))
    print(d.name, sum(p.numel() for p in model.parameters()), "params", [len(s) for s in ids])
    os.system(f"du -sh {d}")


def fp8_codes(x):
    """x (float32) as float8_e4m3fn, round to nearest even, saturating at 448."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_blocks(w):
    """Block-wise FP8: codes and a scale per 128x128 block, the block's largest magnitude over 448
    (1 for a block of zeros): DeepSeek's recipe, and axiom convert's."""
    rows, cols = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
    amax = torch.zeros(rows, cols)
    for r in range(rows):
        for c in range(cols):
            amax[r, c] = w[r * FP8_BLOCK:(r + 1) * FP8_BLOCK, c * FP8_BLOCK:(c + 1) * FP8_BLOCK].abs().max()
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = scales.repeat_interleave(FP8_BLOCK, 0)[:w.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, :w.shape[1]]
    return fp8_codes(w / full), scales


def quantize_channels(w):
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return fp8_codes(w / scales), scales


def is_layer_matrix(name, p):
    return name.startswith("model.layers.") and name.endswith(".weight") and p.dim() == 2


def make_fp8(name, cls, config, layout, tok):
    model = random_model(cls, config)
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    save_tokenizer(model, tok, d)
    if layout == "blocks":
        # The float source in bf16, as FP8 checkpoints are made from; the FP8 one from its values.
        source = OUT / f"{name}_source"
        model = model.to(torch.bfloat16)
        model.save_pretrained(source, safe_serialization=True)
        save_tokenizer(model, tok, source)
        tensors = {}
        for n, p in load_file(source / "model.safetensors").items():
            if is_layer_matrix(n, p):
                tensors[n], tensors[f"{n}_scale_inv"] = quantize_blocks(p.float())
            else:
                tensors[n] = p
        not_converted = ["lm_head"] if "lm_head.weight" in tensors else []
        quantization = {"quant_method": "fp8", "activation_scheme": "dynamic",
                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": not_converted}
        config_json = json.loads((source / "config.json").read_text())
    else:
        # The other tensors in bf16, as published FP8 checkpoints keep them.
        tensors = {}
        for n, p in model.state_dict().items():
            if is_layer_matrix(n, p):
                tensors[n], tensors[f"{n}_scale"] = quantize_channels(p)
            else:
                tensors[n] = p.to(torch.bfloat16).contiguous()
        group = {"targets": ["Linear"], "output_activations": None,
                 "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                             "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                       "dynamic": True, "group_size": None, "block_structure": None,
                                       "observer": None}}
        quantization = {"quant_method": "compressed-tensors", "format": "float-quantized",
                        "quantization_status": "compressed", "config_groups": {"group_0": group},
                        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
                        "global_compression_ratio": None, "version": "0.9.0"}
        model.config.save_pretrained(d)
        config_json = json.loads((d / "config.json").read_text())
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config_json["quantization_config"] = quantization
    (d / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    # The reference: float32 on the dequantized weights. transformers reads the block-wise
    # layout itself (dequantizing on the CPU); compressed-tensors needs its own package, so those
    # weights are dequantized here.
    if layout == "blocks":
        reference = cls.from_pretrained(d, quantization_config=FineGrainedFP8Config(dequantize=True),
                                        dtype=torch.float32).eval()
    else:
        reference = model
        with torch.no_grad():
            for n, p in reference.named_parameters():
                scale = tensors.get(f"{n}_scale")
                p.copy_(tensors[n].float() * scale if scale is not None else tensors[n].float())
    save_logits(reference, tok, d, "transformers float32 on the dequantized FP8 weights, CPU")


def e4m3_table():
    """torch's value of every float8_e4m3fn code, and its encodings of values around each code: the
    code itself, halfway to the next (ties), just either side of halfway, and beyond 448."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = sorted({v for v in codes.tolist() if v == v and v >= 0})
    probes = []
    for a, b in zip(finite, finite[1:]):
        mid = (a + b) / 2
        probes += [a, mid, np.nextafter(np.float32(mid), np.float32(0)), np.nextafter(np.float32(mid), np.float32(1e9))]
    probes += [448.0, 460.0, 464.0, 500.0, 1e30]
    probes = torch.tensor(probes, dtype=torch.float32)
    probes = torch.cat([probes, -probes])
    encoded = fp8_codes(probes).view(torch.uint8)
    (OUT.parent / "fp8_e4m3.json").write_text(json.dumps({
        "source": f"torch {torch.__version__} float8_e4m3fn",
        "value_bits": codes.view(torch.int32).tolist(),
        "encode": [[int(x), int(c)] for x, c in zip(probes.view(torch.int32).tolist(), encoded.tolist())]}) + "\n")


def main():
    byte_level, spm = tokenizer(), sentencepiece_tokenizer()
    every, fp8 = models_to_make(), fp8_models_to_make()
    known = list(every) + list(fp8) + ["fp8_e4m3"]
    unknown = [n for n in sys.argv[1:] if n not in known]
    if unknown:
        sys.exit(f"unknown fixtures {unknown}; known: {known}")
    for name in sys.argv[1:] or known:
        if name == "fp8_e4m3":
            e4m3_table()
            continue
        if name in fp8:
            make_fp8(name, *fp8[name], byte_level)
            continue
        cls, config = every[name]
        tok = spm if name.endswith("_spm") else byte_level
        model = random_model(cls, config)
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        # The llama fixture is sharded, to test sharded checkpoints.
        model.save_pretrained(d, safe_serialization=True, max_shard_size="200KB" if name == "llama" else "100MB")
        save_tokenizer(model, tok, d)
        save_logits(model, tok, d, "transformers float32, CPU")


if __name__ == "__main__":
    main()
