//! The one-shot commands: run, tokenize, perplexity, info, bench.

use crate::load::{load_session, open_model};
use crate::{context_tokens, outln, print_out, with_session, ModelArgs, Output, SamplingArgs, DEFAULT_CONTEXT};
use anyhow::{bail, Context, Result};
use axiom::backend::{Activation, Kernels};
use axiom::chat::Message;
use axiom::engine::bench::{run_test, Test};
use axiom::engine::{generate, ConstraintSpec, GenerateOptions, Sampler};
use axiom::format::gguf::GgufFile;
use axiom::model::llama::LoadOptions;
use axiom::model::ModelConfig;
use axiom::source::resolve_model;
use axiom::tokenizer::Tokenizer;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// The prompt (or give it as the positional argument).
    #[arg(short, long)]
    prompt: Option<String>,
    #[arg(conflicts_with = "prompt")]
    prompt_text: Option<String>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// Context size in tokens (default 4096); at most the model's.
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Hold the output to the JSON schema in this file.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    json_schema: Option<PathBuf>,
    /// Hold the output to the grammar in this file: GBNF (llama.cpp's) when the name ends in
    /// `.gbnf`, llguidance's Lark otherwise.
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
}

impl RunArgs {
    fn constraint(&self) -> Result<Option<ConstraintSpec>> {
        let read =
            |path: &PathBuf| std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()));
        if let Some(path) = &self.json_schema {
            let schema =
                serde_json::from_str(&read(path)?).with_context(|| format!("{} is not JSON", path.display()))?;
            return Ok(Some(ConstraintSpec::JsonSchema { schema, strict: true }));
        }
        let Some(path) = &self.grammar else { return Ok(None) };
        let grammar = read(path)?;
        Ok(Some(if path.extension().is_some_and(|e| e == "gbnf") {
            ConstraintSpec::Gbnf(grammar)
        } else {
            ConstraintSpec::Lark(grammar)
        }))
    }
}

#[derive(Args)]
pub struct TokenizeArgs {
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Match special-token text (e.g. <|im_start|>) to its token.
    #[arg(long)]
    special: bool,
    text: String,
}

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(short, long)]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(short = 'c', long, default_value_t = 512)]
    ctx_size: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct InfoArgs {
    /// The model, as `-m` takes it (default: the default model).
    model: Option<PathBuf>,
    /// Also list every metadata key and tensor.
    #[arg(long)]
    all: bool,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer.json).
    model: PathBuf,
    /// The GGUF file to write, or the directory for fp8.
    #[arg(short, long)]
    output: PathBuf,
    /// Type of the weight matrices: f32, f16, bf16, q8_0, q4_0, q5_0 or q4_k (a GGUF file), or
    /// fp8 (a Hugging Face FP8 directory, a scale per block of weights).
    #[arg(long = "type", default_value = "f16")]
    ty: String,
    /// With --type fp8: the rows and columns of a scale's block, a power of two from 32 [default:
    /// 128]. Smaller blocks fit narrower models and round more finely, at 4 bytes a block.
    #[arg(long, value_name = "N")]
    fp8_block: Option<usize>,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to test (comma-separated; 0 skips).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 skips).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    generate: Vec<usize>,
    /// Tokens of context each test runs after (comma-separated), as llama-bench's -d.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// Sequences that decode together in each generation test (comma-separated), as
    /// llama-batched-bench's -npl: each step decodes one token of every sequence, as a server
    /// serving that many streams does, and t/s counts them all. Prompt tests run one sequence.
    #[arg(long = "parallel", visible_alias = "npl", value_delimiter = ',', default_value = "1")]
    parallel: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
    /// Most prompt tokens in one forward step (as llama-bench's --ubatch-size): longer prompts are
    /// processed in steps of this many.
    #[arg(long = "ubatch-size", visible_alias = "ub", default_value_t = 512)]
    ubatch: usize,
    /// Print one JSON object per test instead of the table.
    #[arg(long)]
    json: bool,
    /// Collect the device profiler's records during each test's last repetition only (CUDA:
    /// `ncu --profile-from-start off axiom bench --profile ...` sees those kernels alone).
    #[arg(long)]
    profile: bool,
}

/// A progress bar on stderr; indicatif draws nothing when stderr is not a terminal.
fn progress(len: u64, what: &str, out: Output) -> ProgressBar {
    if out.quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{msg} {wide_bar} {pos}/{len} {elapsed}");
    bar.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(what.to_string());
    bar
}

pub fn run(args: RunArgs, out: Output) -> Result<()> {
    let constraint = args.constraint()?;
    let text = args
        .prompt
        .or(args.prompt_text)
        .context("no prompt: give one as an argument or with -p")?;
    let config = args.sampling.sampler()?;
    let model = open_model(&args.model)?;
    let ctx = context_tokens(args.ctx_size, DEFAULT_CONTEXT, &model.files.config);
    let loaded = load_session(
        &args.model,
        model,
        LoadOptions {
            kv_tokens: ctx,
            ..LoadOptions::default()
        },
        out,
    )?;
    with_session!(loaded, session => {
        let prompt = if args.chat || args.system.is_some() {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(Message::new("system", system));
            }
            messages.push(Message::new("user", &text));
            session.chat_prompt(&messages)?
        } else {
            session.raw_prompt(&text)?
        };
        let seed = config.seed;
        let mut sampler = Sampler::new(config);
        let options = GenerateOptions {
            constraint,
            ..args.sampling.generate_options()
        };
        let mut kv = session.model.new_kv_cache(ctx);
        let json_mode = args.json;
        let mut written = Ok(());
        let generation = generate(
            &mut session,
            &mut kv,
            &prompt,
            &mut sampler,
            &options,
            |piece| {
                if !json_mode && written.is_ok() {
                    written = print_out(piece.as_bytes());
                }
            },
        )?;
        written?;
        let prompt_tps = prompt.len() as f64 / generation.prompt_time.as_secs_f64();
        let gen_tps = generation.tokens.len() as f64 / generation.generation_time.as_secs_f64().max(1e-9);
        if json_mode {
            let out = json!({
                "prompt_tokens": prompt,
                "tokens": generation.tokens,
                "text": generation.text,
                "stop_reason": generation.stop_reason,
                "seed": seed,
                "timings": {
                    "prompt_n": prompt.len(),
                    "prompt_ms": generation.prompt_time.as_secs_f64() * 1e3,
                    "prompt_tokens_per_second": prompt_tps,
                    "generated_n": generation.tokens.len(),
                    "generation_ms": generation.generation_time.as_secs_f64() * 1e3,
                    "generation_tokens_per_second": gen_tps,
                },
            });
            outln!("{out}")?;
        } else {
            outln!()?;
            if !out.quiet {
                eprintln!(
                    "prompt: {} tokens, {prompt_tps:.1} tok/s | generation: {} tokens, {gen_tps:.1} tok/s | stop: {:?}",
                    prompt.len(),
                    generation.tokens.len(),
                    generation.stop_reason
                );
            }
        }
        Ok(())
    })
}

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let path = resolve_model(args.model.as_deref())?;
    // Only the tokenizer is read: a model this engine cannot run still tokenizes.
    let tokenizer = if path.is_dir() {
        Tokenizer::from_hf_dir(&path)?
    } else {
        Tokenizer::from_gguf(&GgufFile::open(&path)?)?
    };
    let ids = tokenizer.encode(&args.text, args.special, true)?;
    outln!("{}", serde_json::to_string(&ids)?)?;
    Ok(())
}

pub fn perplexity(args: PerplexityArgs, out: Output) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let model = open_model(&args.model)?;
    let context_length = model.files.config.context_length;
    if args.ctx_size > context_length {
        bail!(
            "--ctx-size {} exceeds the model's context of {context_length} tokens",
            args.ctx_size
        );
    }
    let options = LoadOptions {
        kv_tokens: args.ctx_size,
        max_batch: args.ctx_size.min(512),
        max_seqs: 1,
    };
    let loaded = load_session(&args.model, model, options, out)?;
    with_session!(loaded, session => {
        // As llama-perplexity: the text starts with BOS where the model adds one, and each chunk's
        // first token is overwritten with it.
        let tokens = session.tokenizer.encode(&text, false, true)?;
        let bos = if session.tokenizer.add_bos {
            session.tokenizer.bos
        } else {
            None
        };
        let bar = progress((tokens.len() / args.ctx_size.max(1)) as u64, "perplexity", out);
        let result =
            axiom::engine::perplexity::perplexity(
                &mut session.model,
                &mut session.pages,
                &tokens,
                args.ctx_size,
                bos,
                |done, _, ppl| {
                    bar.set_position(done as u64);
                    bar.set_message(format!("perplexity {ppl:.4}"));
                },
            )?;
        bar.finish_and_clear();
        if args.json {
            outln!(
                "{}",
                json!({"file": args.file, "tokens": tokens.len(), "result": result})
            )?;
        } else {
            outln!(
                "perplexity: {:.4} ({} chunks of {}, {} tokens scored)",
                result.perplexity, result.chunks, result.n_ctx, result.scored_tokens
            )?;
        }
        Ok(())
    })
}

pub fn bench(args: BenchArgs, out: Output) -> Result<()> {
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if args.ubatch == 0 {
        bail!("--ubatch-size must be at least 1");
    }
    if args.parallel.contains(&0) {
        bail!("--parallel must be at least 1");
    }
    let tests: Vec<Test> = args
        .prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Test::Prompt(n))
        .chain(args.generate.iter().filter(|&&n| n > 0).map(|&n| Test::Generation(n)))
        .collect();
    let longest = tests.iter().map(|t| t.tokens()).max().unwrap_or(1);
    let deepest = args.depth.iter().copied().max().unwrap_or(0);
    let model = open_model(&args.model)?;
    let context_length = model.files.config.context_length;
    let needed = longest.saturating_add(deepest);
    if needed > context_length {
        bail!(
            "a test of {longest} tokens after {deepest} of context exceeds the model's context of \
             {context_length} tokens"
        );
    }
    // Parallel sequences each hold a test's tokens, and a step takes one token of each.
    let widest = match tests.iter().any(|t| matches!(t, Test::Generation(_))) {
        true => args.parallel.iter().copied().max().unwrap_or(1),
        false => 1,
    };
    let options = LoadOptions {
        max_batch: needed.min(args.ubatch).max(widest),
        kv_tokens: needed.next_multiple_of(axiom::model::PAGE_SIZE).saturating_mul(widest),
        max_seqs: widest,
    };
    let loaded = load_session(&args.model, model, options, out)?;
    with_session!(loaded, session => {
        if args.profile {
            // Stopping a profiler that has not started changes nothing, and a backend without
            // one refuses here, before any test runs.
            session.model.backend.profile(false)?;
        }
        let threads = session.model.backend.threads();
        let info = session.info.clone();
        let backend = session.model.backend.device_name();
        let size = format!("{:.2} MiB", info.file_bytes as f64 / (1 << 20) as f64);
        let params = format!("{:.2} M", info.parameters as f64 / 1e6);
        let mut rows = Vec::new();
        let mut runs = Vec::new();
        for &test in &tests {
            let widths = match test {
                Test::Prompt(_) => &[1][..],
                Test::Generation(_) => &args.parallel[..],
            };
            for &width in widths {
                runs.extend(args.depth.iter().map(|&depth| (test, width, depth)));
            }
        }
        let bar = progress(runs.len() as u64, "bench", out);
        for (test, width, depth) in runs {
            bar.set_message(format!("bench {}", test.name()));
            let r = run_test(&mut session.model, &mut session.pages, test, depth, width, args.repetitions, args.profile)?;
            bar.inc(1);
            // One sequence's tokens each read the weights once; steps of several share them (and a
            // mixture's read more experts), so theirs go unreported.
            let gbps = (matches!(test, Test::Generation(_)) && width == 1)
                .then(|| r.mean * info.weight_bytes_per_token as f64 / 1e9);
            rows.push((r, gbps));
        }
        bar.finish_and_clear();
        if args.json {
            for (r, gbps) in rows {
                let out = json!({
                    "model": info.description, "size_bytes": info.file_bytes, "params": info.parameters,
                    "backend": backend, "threads": threads, "test": r.test, "n_tokens": r.n_tokens,
                    "n_depth": r.depth, "n_parallel": r.parallel,
                    "samples_ts": r.samples, "avg_ts": r.mean, "stddev_ts": r.stddev,
                    "weight_bandwidth_gbps": gbps,
                });
                outln!("{out}")?;
            }
            return Ok(());
        }
        outln!("| model | size | params | backend | threads | test | t/s |")?;
        outln!("| --- | ---: | ---: | --- | ---: | ---: | ---: |")?;
        for (r, _) in &rows {
            outln!(
                "| {} | {size} | {params} | {backend} | {threads} | {} | {:.2} ± {:.2} |",
                info.description, r.test, r.mean, r.stddev
            )?;
        }
        // A mixture's token reads only the experts it chose: their expected share.
        let active = match &session.model.config.experts {
            Some(e) => format!(", {} of {} experts a token", e.used, e.count),
            None => String::new(),
        };
        for (r, gbps) in &rows {
            if let Some(g) = gbps {
                outln!(
                    "\n{}: {:.1} GB/s of weights ({:.1} MB per token{active})",
                    r.test,
                    g,
                    info.weight_bytes_per_token as f64 / 1e6
                )?;
            }
        }
        Ok(())
    })
}

pub fn convert(args: ConvertArgs, out: Output) -> Result<()> {
    use axiom::format::quant::GgmlType;
    let fp8 = args.ty.eq_ignore_ascii_case("fp8");
    if args.fp8_block.is_some() && !fp8 {
        bail!("--fp8-block applies to --type fp8 only, not {}", args.ty);
    }
    let ty = match fp8 {
        true => GgmlType::Fp8,
        false => GgmlType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(&args.ty))
            .with_context(|| format!("unknown type {:?}", args.ty))?,
    };
    let bar = progress(1, "convert", out);
    let follow = |done: usize, total: usize, name: &str| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(name.to_string());
    };
    let written = match fp8 {
        true => {
            let block = args.fp8_block.unwrap_or(axiom::convert_fp8::DEFAULT_BLOCK);
            axiom::convert_fp8::convert_to_fp8(&args.model, &args.output, block, follow)?
        }
        false => axiom::convert::convert_hf_dir(&args.model, &args.output, ty, follow)?,
    };
    bar.finish_and_clear();
    if !out.quiet {
        let file = match fp8 {
            true => args.output.join("model.safetensors"),
            false => args.output.clone(),
        };
        let size = std::fs::metadata(&file).map_or(0, |m| m.len());
        let matrices: Vec<String> = written
            .matrices
            .iter()
            .map(|(t, n)| format!("{n} matrices {t}"))
            .collect();
        eprintln!(
            "wrote {} ({:.1} MiB): {}, {} vectors {}",
            args.output.display(),
            size as f64 / (1 << 20) as f64,
            matrices.join(", "),
            written.vectors,
            if fp8 { "as stored" } else { "F32" }
        );
        // Rows that do not fit the type's blocks fall back, which the type name alone would hide
        // (FP8 keeps the embeddings and LM head as stored, as published FP8 checkpoints do).
        let fell_back: usize = written.matrices.iter().filter(|(t, _)| *t != ty).map(|(_, n)| n).sum();
        if fell_back > 0 && !fp8 {
            eprintln!(
                "note: {fell_back} matrices have rows that are not a multiple of {ty}'s blocks of {} \
                 values; they were written as shown above, not as {ty}",
                ty.block_len()
            );
        }
    }
    Ok(())
}

pub fn info(args: InfoArgs) -> Result<()> {
    use axiom::format::safetensors::SafetensorsModel;
    use axiom::model::quantization::Fp8Quantization;
    use axiom::model::weights::TensorSource;
    let path = resolve_model(args.model.as_deref())?;
    if path.is_dir() {
        let json = std::fs::read_to_string(path.join("config.json")).context("reading config.json")?;
        let json: serde_json::Value = serde_json::from_str(&json).context("parsing config.json")?;
        let quantization = Fp8Quantization::from_hf(&json);
        let checkpoint = SafetensorsModel::open_dir(&path, quantization.as_ref().ok().and_then(Option::as_ref))?;
        outln!("directory:     {} (Hugging Face, safetensors)", path.display())?;
        print_config(ModelConfig::from_hf(&json))?;
        match quantization {
            Ok(Some(q)) => outln!("quantization:  {q}")?,
            Ok(None) => {}
            Err(e) => outln!("quantization:  cannot run this model: {e}")?,
        }
        print_tokenizer(Tokenizer::from_hf_dir(&path))?;
        print_tensors(&checkpoint.all())?;
        return Ok(());
    }
    let file = GgufFile::open(&path)?;
    let name = file.get("general.name").and_then(|v| v.as_str()).unwrap_or("(unnamed)");
    outln!(
        "file:          {} (GGUF v{}, {:.1} MiB)",
        path.display(),
        file.version,
        file.file_size() as f64 / (1 << 20) as f64
    )?;
    outln!("name:          {name}")?;
    print_config(ModelConfig::from_gguf(&file))?;
    print_tokenizer(Tokenizer::from_gguf(&file))?;
    print_tensors(&TensorSource::all(&file))?;
    let architecture = file.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
    outln!(
        "chat template: {}",
        match file.get("tokenizer.chat_template") {
            Some(_) => "yes",
            None if axiom::chat::builtin_template(architecture).is_some() =>
                "none in the file: axiom's built-in one for the family",
            None => "no",
        }
    )?;
    if args.all {
        outln!("\nmetadata:")?;
        for (k, v) in &file.metadata {
            outln!("  {k} = {}", v.summary())?;
        }
        outln!("\ntensors:")?;
        for t in &file.tensors {
            outln!("  {} {} {:?}", t.name, t.ty, t.dims)?;
        }
    }
    Ok(())
}

fn print_config(config: axiom::Result<ModelConfig>) -> Result<()> {
    match config {
        Ok(c) => {
            outln!("architecture:  {}", c.architecture)?;
            outln!("layers:        {}", c.n_layers)?;
            outln!("hidden:        {} (FFN {})", c.dim, c.ffn_dim)?;
            outln!(
                "heads:         {} query, {} key/value, head dim {}",
                c.n_heads,
                c.n_kv_heads,
                c.head_dim
            )?;
            outln!("context:       {}", c.context_length)?;
            outln!("rope:          {}", c.rope)?;
            outln!("rms epsilon:   {:e}", c.rms_eps)?;
            outln!("vocabulary:    {}", c.vocab_size)?;
            outln!("extras:        {}", features(&c).join(", "))?;
            if let Some(e) = &c.experts {
                outln!("experts:       {}", experts(e))?;
            }
        }
        Err(e) => outln!("config:        cannot run this model: {e}")?,
    }
    Ok(())
}

/// Every feature of the model beyond the plain Llama block, by name.
fn features(c: &ModelConfig) -> Vec<String> {
    let mut out: Vec<String> = [
        (c.qkv_bias, "Q/K/V biases"),
        (c.o_bias, "output projection bias"),
        (c.qk_norm, "Q/K norms"),
        (c.post_norms, "norms after attention and feed-forward"),
        (c.activation == Activation::GeluTanh, "GeGLU (GELU, tanh approximation)"),
        (c.norm_weight_offset != 0.0, "norm weights stored minus one"),
    ]
    .into_iter()
    .filter(|&(on, _)| on)
    .map(|(_, what)| what.to_string())
    .collect();
    if let Some(scale) = c.embed_scale {
        out.push(format!("embeddings scaled by {scale}"));
    }
    if c.attention_scale != 1.0 / (c.head_dim as f32).sqrt() {
        out.push(format!(
            "attention scale {} (1/sqrt({:.0}))",
            c.attention_scale,
            c.attention_scale.powi(-2)
        ));
    }
    if let Some(cap) = c.attn_softcap {
        out.push(format!("attention scores capped at {cap}"));
    }
    if let Some(cap) = c.final_softcap {
        out.push(format!("logits capped at {cap}"));
    }
    if let Some(s) = &c.sliding {
        let sliding = s.layers.iter().filter(|&&b| b).count();
        let mut text = format!("sliding window of {} on {sliding} of {} layers", s.window, c.n_layers);
        if let Some(rope) = s.rope {
            text += &format!(" (their rope theta {}, scaling {:?})", rope.theta, rope.scaling);
        }
        out.push(text);
    }
    if out.is_empty() {
        out.push("none".into());
    }
    out
}

/// A mixture of experts: how many, how many a token runs, and where.
fn experts(e: &axiom::model::ExpertsConfig) -> String {
    let mixtures = e.layers.iter().filter(|&&m| m).count();
    let mut text = format!(
        "{} of {} a token (FFN {} each), weights {}renormalized, on {mixtures} of {} layers",
        e.used,
        e.count,
        e.ffn_dim,
        if e.renormalize { "" } else { "not " },
        e.layers.len()
    );
    if let Some(shared) = e.shared_ffn_dim {
        text += &format!(", a gated shared expert of FFN {shared}");
    }
    text
}

fn print_tokenizer(tokenizer: axiom::Result<Tokenizer>) -> Result<()> {
    match tokenizer {
        Ok(t) => outln!("tokenizer:     {}", t.describe())?,
        Err(e) => outln!("tokenizer:     {e}")?,
    }
    Ok(())
}

fn print_tensors(tensors: &[(axiom::format::quant::GgmlType, Vec<usize>, usize)]) -> Result<()> {
    let params: usize = tensors.iter().map(|(_, dims, _)| dims.iter().product::<usize>()).sum();
    let mut types: BTreeMap<String, usize> = BTreeMap::new();
    for (ty, _, _) in tensors {
        *types.entry(ty.to_string()).or_default() += 1;
    }
    let types: Vec<String> = types.iter().map(|(t, n)| format!("{t} x{n}")).collect();
    outln!(
        "parameters:    {:.2} M in {} tensors ({})",
        params as f64 / 1e6,
        tensors.len(),
        types.join(", ")
    )?;
    Ok(())
}
