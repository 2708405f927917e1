#!/usr/bin/env python3
"""Writes the transformers half of crates/axiom/tests/refs/gemma3/: hf_greedy.json, transformers' perplexity in
perplexity.json, and the check of transformers' GGUF tokenizer against llama.cpp's in tokenization.json.

    python3 scripts/gemma3_refs.py MODEL.gguf

Run scripts/gemma3_refs_llamacpp.py first: this script takes its prompt and text token ids from llama.cpp (the
truth for a GGUF) and records where transformers' own tokenizer disagrees. The model is transformers' Gemma 3 in
float32, eager attention, on the weights transformers dequantizes from the GGUF (it subtracts the 1 that the
GGUF's norm weights carry, since its RMSNorm multiplies by 1 + weight).
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/axiom/tests/refs/gemma3"
EOG = [1, 106, 212]  # <eos>, <end_of_turn>, </s>: llama.cpp's end-of-generation set for this model
N_NEW = 64


def load(model_path):
    path = Path(model_path).resolve()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def tokenizer_check(tok):
    path = OUT / "tokenization.json"
    doc = json.loads(path.read_text())
    disagreements = []
    for case in doc["cases"]:
        # transformers always matches special-token text, so only the parse_special columns compare.
        for key, add in [("parse_special", True), ("parse_special_no_bos", False)]:
            got = tok(case["text"], add_special_tokens=add).input_ids
            want = case[key]["ids"]
            if got != want:
                disagreements.append({"name": case["name"], "llama_cpp": key, "transformers": got,
                                      "transformers_vocab_strings": tok.convert_ids_to_tokens(got)})
    doc["transformers_gguf_tokenizer_check"] = {
        "tool": f"transformers {transformers.__version__} AutoTokenizer.from_pretrained(dir, gguf_file=...) "
                f"({type(tok).__name__}), tok(text, add_special_tokens=True/False) against parse_special / "
                "parse_special_no_bos",
        "cases_checked": len(doc["cases"]),
        "disagreements": disagreements,
    }
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return disagreements


@torch.no_grad()
def greedy_case(model, tok, case):
    ids = case["prompt_ids"]
    x = torch.tensor([ids])
    logits = model(x).logits[0]
    last = logits[-1]
    top = torch.topk(last, 20)
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                         eos_token_id=EOG, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    new = out[0, len(ids):].tolist()
    return {
        "name": case["name"], "kind": case["kind"], "messages": case["messages"], "text": case["prompt_text"],
        "transformers_tokenizer_agrees": tok(case["prompt_text"]).input_ids == ids,
        "ids": ids,
        "argmax_per_position": logits.argmax(-1).tolist(),
        "top20_last": [[i, v] for v, i in zip(top.values.tolist(), top.indices.tolist())],
        "greedy64_ids": new,
        "greedy64_text": tok.decode(new),
    }


@torch.no_grad()
def perplexity(model, ids, n_ctx):
    """llama-perplexity's method: each chunk from an empty cache with its first token replaced by BOS,
    positions n_ctx/2 .. n_ctx-2 scored."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for c in range(len(ids) // n_ctx):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        target = torch.tensor(chunk[first + 1:])
        chunk[0] = 2
        hidden = model.model(torch.tensor([chunk])).last_hidden_state[0, first:n_ctx - 1]
        logp = torch.log_softmax(model.lm_head(hidden).double(), -1)
        nll -= logp[torch.arange(len(target)), target].sum().item()
        count += len(target)
    return float(torch.exp(torch.tensor(nll / count))), count


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.manual_seed(0)
    model, tok = load(sys.argv[1])
    disagreements = tokenizer_check(tok)
    print(f"tokenizer disagreements: {len(disagreements)}")

    greedy = json.loads((OUT / "llamacpp_greedy.json").read_text())
    cases = [greedy_case(model, tok, c) for c in greedy["cases"]]
    (OUT / "hf_greedy.json").write_text(json.dumps({
        "source": f"Hugging Face transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32, "
                  "eager attention, weights dequantized from the GGUF by transformers (norm weights minus 1, as "
                  "Gemma's RMSNorm scales by 1 + weight); prompt ids are llama.cpp's (llamacpp_greedy.json: BOS "
                  "first, chat prompts in Gemma's turn format written by hand); greedy (do_sample=False) up to 64 "
                  "new tokens, stopping after an end-of-generation id (1 <eos>, 106 <end_of_turn>, 212 </s>: llama.cpp's "
                  "set), which is then the last id",
        "cases": cases,
    }, indent=1, ensure_ascii=False) + "\n")

    path = OUT / "perplexity.json"
    doc = json.loads(path.read_text())
    ids = doc["llama_cpp_token_ids"]
    text = (ROOT / "crates/axiom/tests/refs/smollm2/apache-2.0.txt").read_text()
    result = {"transformers_tokenizer_agrees": tok(text).input_ids == ids}
    for n_ctx in (512, 1024):
        ppl, scored = perplexity(model, ids, n_ctx)
        result[f"n_ctx_{n_ctx}"] = round(ppl, 4)
        result[f"n_ctx_{n_ctx}_scored_tokens"] = scored
        print(f"transformers perplexity n_ctx={n_ctx}: {ppl:.4f} over {scored} tokens")
    doc["hf_transformers_fp32"] = result
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
