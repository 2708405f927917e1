// Greedy generation against libllama that records, for every step, the chosen token and the runner-up
// with their raw logits, so another engine can tell real divergences from near-ties.
//
// Usage: llamacpp_greedy MODEL PROMPT_FILE N_PREDICT N_THREADS  (prints one JSON object on stdout)
// The prompt file's bytes are the prompt, verbatim. Built and run by scripts/gemma3_refs_llamacpp.sh.
#include "llama.h"

#include <algorithm>
#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

static std::string piece_hex(const llama_vocab * vocab, llama_token id) {
    char buf[256];
    const int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
    std::string out;
    char hex[3];
    for (int i = 0; i < n; ++i) {
        snprintf(hex, sizeof(hex), "%02x", (unsigned char) buf[i]);
        out += hex;
    }
    return out;
}

// Ids of the k largest logits, best first (ties broken by the lower id, as argmax does).
static std::vector<int> top_k(const float * logits, int n_vocab, int k) {
    std::vector<int> ids(n_vocab);
    for (int i = 0; i < n_vocab; ++i) {
        ids[i] = i;
    }
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ids.resize(k);
    return ids;
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL PROMPT_FILE N_PREDICT N_THREADS\n", argv[0]);
        return 2;
    }
    const std::string model_path = argv[1];
    std::ifstream file(argv[2], std::ios::binary);
    if (!file) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        return 2;
    }
    std::stringstream ss;
    ss << file.rdbuf();
    const std::string prompt = ss.str();
    const int n_predict = atoi(argv[3]);
    const int n_threads = atoi(argv[4]);

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> tokens(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), prompt.size(), tokens.data(), tokens.size(), true, true) < 0) {
        fprintf(stderr, "tokenization failed\n");
        return 1;
    }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 512;
    cparams.n_batch = n_prompt;
    cparams.n_ubatch = n_prompt;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "cannot create the context\n");
        return 1;
    }
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    printf("{\"prompt_ids\": [");
    for (int i = 0; i < n_prompt; ++i) {
        printf("%s%d", i ? ", " : "", tokens[i]);
    }
    printf("], \"flash_attn\": \"%s\"", llama_flash_attn_type_name(cparams.flash_attn_type));

    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    set_tokens(batch, tokens.data(), n_prompt, 0);
    llama_pos n_pos = 0;
    int n_batch = n_prompt;
    for (int step = 0; step < n_predict; ++step) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
            fprintf(stderr, "decode failed at step %d\n", step);
            return 1;
        }
        n_pos += n_batch;
        const float * logits = llama_get_logits_ith(ctx, -1);
        const std::vector<int> best = top_k(logits, n_vocab, 10);
        if (step == 0) {
            printf(", \"top10_logits_last_prompt_pos\": [");
            for (size_t i = 0; i < best.size(); ++i) {
                printf("%s[%d, %.6f]", i ? ", " : "", best[i], logits[best[i]]);
            }
            printf("], \"steps\": [");
        }
        const llama_token id = llama_sampler_sample(smpl, ctx, -1);
        if (id != best[0]) {
            fprintf(stderr, "step %d: sampler chose %d, argmax is %d\n", step, id, best[0]);
            return 1;
        }
        printf("%s{\"step\": %d, \"id\": %d, \"logit\": %.6f, \"runner_up_id\": %d, \"runner_up_logit\": %.6f, "
               "\"is_eog\": %s, \"piece_hex\": \"%s\"}",
               step ? ", " : "", step, id, logits[id], best[1], logits[best[1]],
               llama_vocab_is_eog(vocab, id) ? "true" : "false", piece_hex(vocab, id).c_str());
        set_tokens(batch, &id, 1, n_pos);
        n_batch = 1;
    }
    printf("]}\n");

    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
