//! `axiom`: run Llama-family models from the command line.

use anyhow::{bail, Context, Result};
use axiom::backend::cpu::{physical_cores, CpuBackend};
use axiom::backend::{Backend, KvType};
use axiom::chat::Message;
use axiom::engine::perplexity::perplexity;
use axiom::engine::{generate, GenerateOptions, Sampler, SamplerConfig, Session};
use axiom::format::gguf::GgufFile;
use axiom::model::llama::LoadOptions;
use axiom::model::ModelConfig;
use axiom::source::resolve_model;
use axiom::tokenizer::Tokenizer;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "axiom", version, about = "Run Llama-family language models")]
struct Cli {
    /// Log what the engine is doing (to stderr).
    #[arg(long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(RunArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity does.
    Perplexity(PerplexityArgs),
    /// Describe a model file.
    Info(InfoArgs),
    /// Measure prompt processing and generation speed, like llama-bench.
    Bench(BenchArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendKind {
    /// The best backend this machine has.
    Auto,
    Cpu,
    Cuda,
    Metal,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched into the cache).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// CPU threads (default: physical cores).
    #[arg(short, long)]
    threads: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendKind,
    /// Keep the KV cache in f32 instead of f16.
    #[arg(long)]
    kv_f32: bool,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
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
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    /// Context size in tokens (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// No timing summary on stderr.
    #[arg(short, long)]
    quiet: bool,
}

#[derive(Args)]
struct TokenizeArgs {
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Match special-token text (e.g. <|im_start|>) to its token.
    #[arg(long)]
    special: bool,
    text: String,
}

#[derive(Args)]
struct PerplexityArgs {
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
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to test (comma-separated; 0 skips).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 skips).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    generate: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
    /// Print one JSON object per test instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct InfoArgs {
    /// GGUF model file (default: the default model).
    model: Option<PathBuf>,
    /// Also list every metadata key and tensor.
    #[arg(long)]
    all: bool,
}

fn main() {
    let cli = Cli::parse();
    let filter = if cli.verbose { "axiom=debug,info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("AXIOM_LOG").unwrap_or_else(|_| filter.into()))
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Tokenize(args) => tokenize(args),
        Command::Perplexity(args) => perplexity_cmd(args),
        Command::Info(args) => info(args),
        Command::Bench(args) => bench(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn cpu_backend(args: &ModelArgs) -> Result<CpuBackend> {
    match args.backend {
        BackendKind::Auto | BackendKind::Cpu => {}
        BackendKind::Cuda => bail!("the CUDA backend is not available in this build"),
        BackendKind::Metal => bail!("the Metal backend is not available in this build"),
    }
    let threads = args.threads.unwrap_or_else(physical_cores);
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let kv_type = if args.kv_f32 { KvType::F32 } else { KvType::F16 };
    Ok(CpuBackend::new(threads).with_kv_type(kv_type))
}

fn load_session(args: &ModelArgs, options: LoadOptions) -> Result<(PathBuf, Session<CpuBackend>)> {
    let path = resolve_model(args.model.as_deref())?;
    let session =
        Session::load(&path, cpu_backend(args)?, options).with_context(|| format!("loading {}", path.display()))?;
    Ok((path, session))
}

fn run(args: RunArgs) -> Result<()> {
    let text = args
        .prompt
        .clone()
        .or(args.prompt_text.clone())
        .context("no prompt: give one as an argument or with -p")?;
    let ctx = args.ctx_size.unwrap_or(4096);
    let (_, mut session) = load_session(
        &args.model,
        LoadOptions {
            kv_tokens: ctx,
            ..LoadOptions::default()
        },
    )?;
    let ctx = ctx.min(session.model.config.context_length);
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
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        penalty_last_n: args.repeat_last_n,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed,
    });
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
    };
    let mut kv = session.model.new_kv_cache(ctx)?;
    let mut stdout = std::io::stdout().lock();
    let json_mode = args.json;
    let generation = generate(
        &mut session.model,
        &session.tokenizer,
        &mut kv,
        &prompt,
        &mut sampler,
        &options,
        |piece| {
            if !json_mode {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        },
    )?;
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
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(stdout)?;
        if !args.quiet {
            eprintln!(
                "prompt: {} tokens, {prompt_tps:.1} tok/s | generation: {} tokens, {gen_tps:.1} tok/s | stop: {:?}",
                prompt.len(),
                generation.tokens.len(),
                generation.stop_reason
            );
        }
    }
    Ok(())
}

fn tokenize(args: TokenizeArgs) -> Result<()> {
    let path = resolve_model(args.model.as_deref())?;
    let file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let ids = tokenizer.encode(&args.text, args.special, true)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

fn perplexity_cmd(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let options = LoadOptions {
        kv_tokens: args.ctx_size,
        max_batch: args.ctx_size.min(512),
    };
    let (_, mut session) = load_session(&args.model, options)?;
    if args.ctx_size > session.model.config.context_length {
        bail!(
            "context {} exceeds the model's {}",
            args.ctx_size,
            session.model.config.context_length
        );
    }
    let tokens = session.tokenizer.encode(&text, false, false)?;
    let bos = if session.tokenizer.add_bos {
        session.tokenizer.bos
    } else {
        None
    };
    let json_mode = args.json;
    let result = perplexity(&mut session.model, &tokens, args.ctx_size, bos, |done, total, ppl| {
        if !json_mode {
            eprintln!("[{done}/{total}] {ppl:.4}");
        }
    })?;
    if json_mode {
        println!(
            "{}",
            json!({"file": args.file, "tokens": tokens.len(), "result": result})
        );
    } else {
        println!(
            "perplexity: {:.4} ({} chunks of {}, {} tokens scored)",
            result.perplexity, result.chunks, result.n_ctx, result.scored_tokens
        );
    }
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    use axiom::engine::bench::{run_test, Test};
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let tests: Vec<Test> = args
        .prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Test::Prompt(n))
        .chain(args.generate.iter().filter(|&&n| n > 0).map(|&n| Test::Generation(n)))
        .collect();
    let longest = tests.iter().map(|t| t.tokens()).max().unwrap_or(1);
    let options = LoadOptions {
        max_batch: longest.min(512),
        kv_tokens: longest,
    };
    let (_, mut session) = load_session(&args.model, options)?;
    let threads = session.model.backend.threads();
    let info = session.info.clone();
    let backend = session.model.backend.device_name();
    let size = format!("{:.2} MiB", info.file_bytes as f64 / (1 << 20) as f64);
    let params = format!("{:.2} M", info.parameters as f64 / 1e6);
    if !args.json {
        println!("| model | size | params | backend | threads | test | t/s |");
        println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    }
    let mut bandwidth = Vec::new();
    for test in tests {
        let r = run_test(&mut session.model, test, args.repetitions)?;
        let gbps = matches!(test, Test::Generation(_)).then(|| r.mean * info.weight_bytes_per_token as f64 / 1e9);
        if args.json {
            let out = json!({
                "model": info.description, "size_bytes": info.file_bytes, "params": info.parameters,
                "backend": backend, "threads": threads, "test": r.test, "n_tokens": r.n_tokens,
                "samples_ts": r.samples, "avg_ts": r.mean, "stddev_ts": r.stddev,
                "weight_bandwidth_gbps": gbps,
            });
            println!("{out}");
        } else {
            println!(
                "| {} | {size} | {params} | {backend} | {threads} | {} | {:.2} ± {:.2} |",
                info.description, r.test, r.mean, r.stddev
            );
            if let Some(g) = gbps {
                bandwidth.push(format!(
                    "{}: {:.1} GB/s of weights ({:.1} MB per token)",
                    r.test,
                    g,
                    info.weight_bytes_per_token as f64 / 1e6
                ));
            }
        }
    }
    for line in bandwidth {
        println!("\n{line}");
    }
    Ok(())
}

fn info(args: InfoArgs) -> Result<()> {
    let path = resolve_model(args.model.as_deref())?;
    let file = GgufFile::open(&path)?;
    print_info(&path, &file, args.all)
}

fn print_info(path: &Path, file: &GgufFile, all: bool) -> Result<()> {
    let name = file.get("general.name").and_then(|v| v.as_str()).unwrap_or("(unnamed)");
    println!(
        "file:          {} (GGUF v{}, {:.1} MiB)",
        path.display(),
        file.version,
        file.file_size() as f64 / (1 << 20) as f64
    );
    println!("name:          {name}");
    match ModelConfig::from_gguf(file) {
        Ok(c) => {
            println!("architecture:  {}", c.architecture);
            println!("layers:        {}", c.n_layers);
            println!("hidden:        {} (FFN {})", c.dim, c.ffn_dim);
            println!(
                "heads:         {} query, {} key/value, head dim {}",
                c.n_heads, c.n_kv_heads, c.head_dim
            );
            println!("context:       {}", c.context_length);
            println!(
                "rope:          {:?} layout, theta {}, {} dims",
                c.rope.layout, c.rope.theta, c.rope.dims
            );
            println!("rms epsilon:   {:e}", c.rms_eps);
            println!("vocabulary:    {}", c.vocab_size);
        }
        Err(e) => println!("config:        cannot run this model: {e}"),
    }
    match Tokenizer::from_gguf(file) {
        Ok(t) => println!("tokenizer:     {}", t.describe()),
        Err(e) => println!("tokenizer:     {e}"),
    }
    let params: usize = file.tensors.iter().map(|t| t.n_elements()).sum();
    let mut types: BTreeMap<String, usize> = BTreeMap::new();
    for t in &file.tensors {
        *types.entry(t.ty.to_string()).or_default() += 1;
    }
    let types: Vec<String> = types.iter().map(|(t, n)| format!("{t} x{n}")).collect();
    println!(
        "parameters:    {:.2} M in {} tensors ({})",
        params as f64 / 1e6,
        file.tensors.len(),
        types.join(", ")
    );
    println!(
        "chat template: {}",
        if file.get("tokenizer.chat_template").is_some() {
            "yes"
        } else {
            "no"
        }
    );
    if all {
        println!("\nmetadata:");
        for (k, v) in &file.metadata {
            println!("  {k} = {}", v.summary());
        }
        println!("\ntensors:");
        for t in &file.tensors {
            println!("  {} {} {:?}", t.name, t.ty, t.dims);
        }
    }
    Ok(())
}
