#!/usr/bin/env python3
"""Writes crates/axiom/tests/fixtures/hf/<arch>/: tiny randomly initialised models of each
architecture axiom runs from Hugging Face directories, saved with `save_pretrained` (safetensors,
config.json, tokenizer.json with a real BPE trained on the Apache license text, tokenizer_config.json
with a ChatML template, generation_config.json), and transformers' float32 logits for a few token
sequences (`logits.json`: ids and shapes; `logits.bin`: little-endian f32).

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
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
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


def main():
    byte_level, spm = tokenizer(), sentencepiece_tokenizer()
    every = models_to_make()
    unknown = [n for n in sys.argv[1:] if n not in every]
    if unknown:
        sys.exit(f"unknown fixtures {unknown}; known: {list(every)}")
    for name in sys.argv[1:] or every:
        cls, config = every[name]
        tok = spm if name.endswith("_spm") else byte_level
        torch.manual_seed(0)
        config.initializer_range = 0.2  # larger weights than the default 0.02, so logits differ clearly
        model = cls(config).float().eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms not all ones
                if n.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        # The llama fixture is sharded, to test sharded checkpoints.
        model.save_pretrained(d, safe_serialization=True, max_shard_size="200KB" if name == "llama" else "100MB")
        tok.save_pretrained(d)
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
        model.generation_config.save_pretrained(d)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
        chunks = []
        with torch.no_grad():
            for seq in ids:
                chunks.append(model(torch.tensor([seq])).logits[0].float().numpy())
        (d / "logits.bin").write_bytes(np.concatenate([c.reshape(-1) for c in chunks]).astype("<f4").tobytes())
        (d / "logits.json").write_text(json.dumps({"texts": TEXTS, "ids": ids, "vocab": config.vocab_size,
                                                   "source": "transformers float32, CPU"}, indent=1))
        print(name, sum(p.numel() for p in model.parameters()), "params", [len(s) for s in ids])
        os.system(f"du -sh {d}")


if __name__ == "__main__":
    main()
