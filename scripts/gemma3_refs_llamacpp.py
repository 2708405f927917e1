#!/usr/bin/env python3
"""Writes the llama.cpp half of crates/axiom/tests/refs/gemma3/: tokenization.json, llamacpp_greedy.json and
the llama.cpp entry of perplexity.json, by running a CPU build of llama.cpp on Gemma 3 270M (Q4_K_M GGUF).

    python3 scripts/gemma3_refs_llamacpp.py MODEL.gguf LLAMA_BUILD_DIR

LLAMA_BUILD_DIR holds bin/llama-tokenize, bin/llama-perplexity and bin/llamacpp_greedy (scripts/llamacpp_greedy.cpp
compiled against that build's libllama); crates/axiom/tests/refs/gemma3/README.md gives the build commands.
Run scripts/gemma3_refs.py afterwards: it adds transformers' figures to these files.
"""
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/axiom/tests/refs/gemma3"
TEXT = ROOT / "crates/axiom/tests/refs/smollm2/apache-2.0.txt"
LLAMA_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
THREADS = 2
N_PREDICT = 64
NEAR_TIE = 0.1  # top-1 minus top-2 logit below this marks a step where another engine may pick differently

# Gemma's chat turn format, written by hand: the GGUF carries no chat template. Gemma has no system role: its
# template puts a system prompt at the start of the first user turn, followed by a blank line.
def chat(messages):
    system = "".join(m["content"] + "\n\n" for m in messages if m["role"] == "system")
    user = next(m["content"] for m in messages if m["role"] == "user")
    return f"<start_of_turn>user\n{system}{user}<end_of_turn>\n<start_of_turn>model\n"


CHATS = [
    ("chat_capital_france", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_haiku", [{"role": "user", "content": "Write a haiku about the ocean."}]),
    ("chat_sys_cpu_cache", [{"role": "system", "content": "You are a concise assistant."},
                            {"role": "user", "content": "Explain what a CPU cache is in two sentences."}]),
]
PROMPTS = [
    ("raw_capital_france", "The capital of France is", None),
    ("raw_story", "Once upon a time, there was a little", None),
    ("raw_code_fib", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', None),
] + [(name, chat(messages), messages) for name, messages in CHATS]

TOKENIZATION = [
    ("english", "Hello, world!"),
    ("code_python", "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n"),
    ("chinese", "你好，世界！今天天气很好。"),
    ("leading_trailing_spaces", "   leading and trailing spaces   "),
    ("space_runs", "a  b   c    d\t\te"),
    ("newlines", "line one\nline two\n\n\nline five\r\n"),
    ("numbers", "12345 3.14159 1,000,000 2024-01-01 007 -42"),
    ("emoji", "I love 🦀 and 🚀! 👩‍💻"),
    ("accents", "Café naïve façade Ærøskøbing"),
    ("byte_fallback", "\x01\x07 \U000f0000 \u2fd6 \U0001fbff"),
    ("special_chat", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    ("special_bos_eos_text", "<bos>text<eos>"),
    ("html_like", "<div><start_of_turn></div>"),
    ("long_whitespace_runs", "x" + " " * 33 + "y" + "\n" * 35 + "z"),
    ("single_space", " "),
    ("single_newline", "\n"),
    ("empty", ""),
]


def vocab_pieces(model):
    from gguf import GGUFReader

    field = GGUFReader(model).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def tokenize(build, model, text, *flags):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        out = subprocess.run([f"{build}/bin/llama-tokenize", "-m", model, "-f", f.name, "--no-escape", "--ids",
                              "--log-disable", *flags], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tokenization(build, model, pieces):
    cases = []
    for name, text in TOKENIZATION:
        case = {"name": name, "text": text, "utf8_bytes": len(text.encode("utf-8"))}
        for key, flags in [("parse_special", []), ("no_parse_special", ["--no-parse-special"]),
                           ("parse_special_no_bos", ["--no-bos"]),
                           ("no_parse_special_no_bos", ["--no-parse-special", "--no-bos"])]:
            ids = tokenize(build, model, text, *flags)
            case[key] = {"ids": ids, "n_tokens": len(ids), "vocab_strings": [pieces[i] for i in ids]}
        case["special_parse_makes_difference"] = case["parse_special"]["ids"] != case["no_parse_special"]["ids"]
        cases.append(case)
    return {
        "model": Path(model).name,
        "model_sha256": sha256(model),
        "tool": f"llama-tokenize (llama.cpp {LLAMA_COMMIT[:9]})",
        "command_template": "llama-tokenize -m MODEL -f <file holding the exact UTF-8 bytes of text> --no-escape --ids "
                            "--log-disable [--no-parse-special] [--no-bos]",
        "notes": [
            "parse_special: default of llama-tokenize (special-token text such as <start_of_turn> is matched to its "
            "control token id); no_parse_special: --no-parse-special, such text is tokenized as ordinary text.",
            "BOS: the GGUF has tokenizer.ggml.add_bos_token=true, so parse_special and no_parse_special start with "
            "<bos> (id 2); the *_no_bos variants pass --no-bos. No EOS is added (add_eos_token=false).",
            "The tokenizer is SentencePiece-style (tokenizer.ggml.model 'llama', add_space_prefix=false): vocab "
            "strings use U+2581 for a space and <0xNN> byte tokens for bytes no piece covers (byte fallback).",
            "--no-escape: text bytes are passed verbatim; files were written without trailing newline unless the "
            "text itself ends with one.",
        ],
        "cases": cases,
    }


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def greedy(build, model, pieces):
    cases = []
    for name, text, messages in PROMPTS:
        with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            run = subprocess.run([f"{build}/bin/llamacpp_greedy", model, f.name, str(N_PREDICT), str(THREADS)],
                                 check=True, capture_output=True, text=True)
        got = json.loads(run.stdout)
        steps = got["steps"]
        ids = [s["id"] for s in steps]
        eog = next((s["step"] for s in steps if s["is_eog"]), None)
        until = ids if eog is None else ids[:eog]
        margins = [s["logit"] - s["runner_up_logit"] for s in steps]
        low = min(range(len(margins)), key=margins.__getitem__)
        text_of = lambda toks: b"".join(bytes.fromhex(steps[i]["piece_hex"]) for i in toks).decode("utf-8", "replace")
        cases.append({
            "name": name, "kind": "chat" if messages else "raw", "messages": messages, "prompt_text": text, "prompt_ids": got["prompt_ids"],
            "n_prompt": len(got["prompt_ids"]), "prompt_vocab_strings": [pieces[i] for i in got["prompt_ids"]],
            "generated_ids_64": ids, "generated_text_64": text_of(range(len(ids))),
            "first_eog_step": eog, "generated_ids_until_eog": until, "generated_text_until_eog": text_of(range(len(until))),
            "top10_logits_last_prompt_pos": got["top10_logits_last_prompt_pos"],
            "min_top1_top2_margin": round(margins[low], 6), "min_margin_step": low,
            "near_tie_steps": [i for i, m in enumerate(margins) if m < NEAR_TIE],
            "steps": steps,
        })
    return {
        "model": Path(model).name,
        "model_sha256": sha256(model),
        "llama_cpp_commit": LLAMA_COMMIT,
        "method": f"scripts/llamacpp_greedy.cpp against libllama (llama.cpp {LLAMA_COMMIT[:9]}): the prompt "
                  "tokenized with llama_tokenize(add_special=true, parse_special=true), so BOS (id 2) is added "
                  "(add_bos_token=true) and <start_of_turn>/<end_of_turn> become control tokens; the whole prompt "
                  "decoded in one batch, logits only for the last position; then 64 greedy steps with "
                  "llama_sampler_init_greedy() (pure argmax, no penalties), each new token fed back one at a time. "
                  "EOG tokens are NOT a stop, so all 64 steps are recorded; first_eog_step marks where a normal run "
                  "would stop (EOG set, from llama.cpp's load log: 1 <eos>, 106 <end_of_turn>, 212 </s>). The program checks that the sampler's pick is "
                  "the argmax of the logits at every step. Chat prompts use Gemma's turn format written by hand "
                  "(the GGUF has no chat template); a system prompt goes at the start of the user turn, as "
                  "Gemma's own template does.",
        "settings": {"n_ctx": 512, "n_threads": THREADS, "n_threads_batch": THREADS, "n_gpu_layers": 0,
                     "flash_attn": "auto (resolved: enabled, CPU FLASH_ATTN_EXT)", "kv_cache_type": "f16 K and V (default)",
                     "backend": "CPU only (ggml-cpu, -march=native)"},
        "per_step_fields": "steps[i]: id = greedy token, logit = its raw logit, runner_up_id/runner_up_logit = 2nd "
                           "best, piece_hex = UTF-8 bytes of llama_token_to_piece(special=true). near_tie_steps: "
                           f"steps whose top1-top2 margin is below {NEAR_TIE}, where another engine may diverge.",
        "cases": cases,
    }


def perplexity(build, model, n_ctx):
    command = ["llama-perplexity", "-m", "MODEL", "-f", "apache-2.0.txt", "-c", str(n_ctx), "-b", str(n_ctx),
               "-t", str(THREADS), "-ngl", "0"]
    run = subprocess.run([f"{build}/bin/{command[0]}", "-m", model, "-f", str(TEXT), *command[5:]], check=True,
                         capture_output=True, text=True)
    final = [l for l in (run.stdout + run.stderr).splitlines() if "Final estimate: PPL" in l]
    if len(final) != 1:
        sys.exit(f"llama-perplexity printed no final estimate:\n{run.stderr}")
    return float(final[0].split("PPL =")[1].split()[0]), " ".join(command)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model, build = sys.argv[1], sys.argv[2]
    OUT.mkdir(parents=True, exist_ok=True)
    pieces = vocab_pieces(model)
    tok = tokenization(build, model, pieces)
    text_ids = tokenize(build, model, TEXT.read_text())
    (OUT / "tokenization.json").write_text(json.dumps(tok, indent=1, ensure_ascii=False) + "\n")
    (OUT / "llamacpp_greedy.json").write_text(json.dumps(greedy(build, model, pieces), indent=1, ensure_ascii=False) + "\n")
    path = OUT / "perplexity.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["text"] = (f"apache-2.0.txt (../smollm2/apache-2.0.txt, Debian's common-licenses/Apache-2.0, 11358 bytes), "
                   f"{len(text_ids)} tokens with llama.cpp's tokenizer including the leading BOS")
    doc["method"] = ("llama.cpp llama-perplexity: tokenize the whole text with BOS (add_bos_token=true), cut into "
                     "chunks of n_ctx tokens (a partial last chunk is dropped), overwrite each chunk's first token "
                     "with BOS, evaluate each chunk from an empty cache; the logits at positions n_ctx/2 .. n_ctx-2 "
                     "predict the next token; PPL = exp(mean negative log-likelihood over all scored tokens)")
    result = {}
    for n_ctx in (512, 1024):
        ppl, command = perplexity(build, model, n_ctx)
        result[f"n_ctx_{n_ctx}"] = ppl
        result[f"n_ctx_{n_ctx}_scored_tokens"] = (len(text_ids) // n_ctx) * (n_ctx // 2 - 1)
        result[f"n_ctx_{n_ctx}_command"] = command
        print(f"llama.cpp perplexity n_ctx={n_ctx}: {ppl}")
    doc[f"llama_cpp_{LLAMA_COMMIT[:9]}_cpu"] = result
    doc["llama_cpp_token_ids"] = text_ids
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
