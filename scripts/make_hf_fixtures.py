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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/axiom/tests/fixtures/hf"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = ["The license applies to every contribution.", "Copyright 2004, all rights reserved: 1 2 3 4 5.",
         "<|im_start|>user\nWhat is a derivative work?<|im_end|>\n<|im_start|>assistant\n"]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1000, max_position_embeddings=256)


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
    }


def main():
    tok = tokenizer()
    every = models_to_make()
    unknown = [n for n in sys.argv[1:] if n not in every]
    if unknown:
        sys.exit(f"unknown fixtures {unknown}; known: {list(every)}")
    for name in sys.argv[1:] or every:
        cls, config = every[name]
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
