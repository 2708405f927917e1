//! `axiom`: run Llama-family models from the command line.

mod chat;
mod commands;
mod serve;

use anyhow::{anyhow, bail, Context, Result};
use axiom::backend::cpu::{physical_cores, CpuBackend};
use axiom::backend::cuda::CudaBackend;
use axiom::backend::{Backend, KvType};
use axiom::engine::{GenerateOptions, SamplerConfig, SamplingField, Session};
use axiom::model::llama::LoadOptions;
use axiom::model::ModelConfig;
use axiom::source::resolve_model;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("AXIOM_GIT_REVISION"), ")");

#[derive(Parser)]
#[command(name = "axiom", version = VERSION, about = "Run Llama-family language models")]
struct Cli {
    /// Log what the engine is doing (to stderr).
    #[arg(long, global = true)]
    verbose: bool,
    /// No load summary or timings on stderr.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(commands::RunArgs),
    /// Talk with a model, turn by turn.
    Chat(chat::ChatArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(commands::TokenizeArgs),
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity does.
    Perplexity(commands::PerplexityArgs),
    /// Describe a model file.
    Info(commands::InfoArgs),
    /// Measure prompt processing and generation speed, like llama-bench.
    Bench(commands::BenchArgs),
    /// Write a Hugging Face model directory as a GGUF file, optionally quantized.
    Convert(commands::ConvertArgs),
    /// Serve the model over an OpenAI-compatible HTTP API, batching concurrent requests.
    Serve(serve::ServeArgs),
    /// Print a shell completion script.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendKind {
    /// The best backend this machine has.
    Auto,
    Cpu,
    Cuda,
    Metal,
}

#[derive(Args, Clone)]
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

/// Sampling and stopping, shared by `run` and `chat`.
#[derive(Args)]
struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    /// Temperature, from 0 (greedy) to 2.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.8)]
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
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

impl SamplingArgs {
    /// The sampler settings, refused (naming the flag) outside the ranges the server allows too.
    fn sampler(&self) -> Result<SamplerConfig> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        let config = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            penalty_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed,
        };
        config.validate().map_err(|e| {
            let flag = match e.field {
                SamplingField::Temperature => "--temp",
                SamplingField::TopP => "--top-p",
                SamplingField::MinP => "--min-p",
                SamplingField::RepeatPenalty => "--repeat-penalty",
                SamplingField::PresencePenalty => "--presence-penalty",
                SamplingField::FrequencyPenalty => "--frequency-penalty",
            };
            anyhow!(e.describe(flag))
        })?;
        Ok(config)
    }

    fn generate_options(&self) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            ..Default::default()
        }
    }
}

/// Exit status of a process killed by SIGPIPE: the shell's sign that the reader left early.
const BROKEN_PIPE_EXIT: i32 = 141;

/// Writes command output to stdout. When its reader has gone (`axiom info | head -1`) the process
/// exits quietly with 141, as SIGPIPE would have ended it: the signal stays ignored so that the
/// server survives clients that hang up, and this write error stands in for it.
fn print_out(bytes: &[u8]) -> Result<()> {
    let written = {
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(bytes).and_then(|()| stdout.flush())
    };
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(BROKEN_PIPE_EXIT),
        written => written.context("writing to stdout"),
    }
}

/// `println!` through [`print_out`], so that a closed stdout ends the command instead of a panic.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::print_out(b"\n")
    };
    ($($arg:tt)*) => {
        $crate::print_out(format!("{}\n", format_args!($($arg)*)).as_bytes())
    };
}

/// What every command that loads a model needs to know about the user's wishes for output.
#[derive(Clone, Copy)]
struct Output {
    quiet: bool,
}

fn main() {
    let cli = Cli::parse();
    // The server's access log (target axiom::access) is on unless AXIOM_LOG says otherwise.
    let filter = if cli.verbose {
        "axiom=debug,info"
    } else {
        "warn,axiom::access=info"
    };
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("AXIOM_LOG").unwrap_or_else(|_| filter.into()))
        .with_writer(std::io::stderr)
        .init();
    let out = Output { quiet: cli.quiet };
    let result = match cli.command {
        Command::Run(args) => commands::run(args, out),
        Command::Chat(args) => chat::chat(args, out),
        Command::Tokenize(args) => commands::tokenize(args),
        Command::Perplexity(args) => commands::perplexity(args, out),
        Command::Info(args) => commands::info(args),
        Command::Bench(args) => commands::bench(args, out),
        Command::Convert(args) => commands::convert(args, out),
        Command::Serve(args) => serve::serve(args, out),
        Command::Completions { shell } => {
            // Written through `print_out`: clap_complete panics when its writer fails.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "axiom", &mut script);
            print_out(&script)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// A loaded model on whichever backend was chosen (boxed: sessions differ in size by backend).
enum Loaded {
    Cpu(Box<Session<CpuBackend>>),
    Cuda(Box<Session<CudaBackend>>),
    #[cfg(any(target_vendor = "apple", axiom_metal_check))]
    Metal(Box<Session<axiom::backend::metal::MetalBackend>>),
}

/// Runs `$body` with `$session` bound to the loaded session (`&loaded`: a reference to it),
/// whatever its backend: the body is written once and compiled for each.
#[macro_export]
macro_rules! with_session {
    (&$loaded:expr, $session:ident => $body:block) => {
        match &$loaded {
            $crate::Loaded::Cpu(boxed) => {
                let $session = &**boxed;
                $body
            }
            $crate::Loaded::Cuda(boxed) => {
                let $session = &**boxed;
                $body
            }
            #[cfg(any(target_vendor = "apple", axiom_metal_check))]
            $crate::Loaded::Metal(boxed) => {
                let $session = &**boxed;
                $body
            }
        }
    };
    ($loaded:expr, $session:ident => $body:block) => {
        match $loaded {
            $crate::Loaded::Cpu(boxed) => {
                #[allow(unused_mut)]
                let mut $session = *boxed;
                $body
            }
            $crate::Loaded::Cuda(boxed) => {
                #[allow(unused_mut)]
                let mut $session = *boxed;
                $body
            }
            #[cfg(any(target_vendor = "apple", axiom_metal_check))]
            $crate::Loaded::Metal(boxed) => {
                #[allow(unused_mut)]
                let mut $session = *boxed;
                $body
            }
        }
    };
}

/// Most `--threads`: beyond any machine's cores, and a typo's million threads are refused.
const MAX_THREADS: usize = 1024;

fn cpu_backend(args: &ModelArgs) -> Result<CpuBackend> {
    let threads = args.threads.unwrap_or_else(physical_cores);
    if !(1..=MAX_THREADS).contains(&threads) {
        bail!("--threads must be between 1 and {MAX_THREADS}, got {threads}");
    }
    Ok(CpuBackend::new(threads).with_kv_type(kv_type(args)))
}

/// The backend a command runs on, `auto` resolved.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Chosen {
    Cpu,
    Cuda,
    #[cfg(any(target_vendor = "apple", axiom_metal_check))]
    Metal,
}

/// `auto` is CUDA when a GPU is present, else the CPU. Metal is used only when asked for: it has
/// been type-checked and its kernels run on the CPU, but not yet run on a Mac (docs/metal.md).
fn choose_backend(args: &ModelArgs) -> Result<Chosen> {
    Ok(match args.backend {
        BackendKind::Cuda => Chosen::Cuda,
        BackendKind::Auto if axiom::backend::cuda::device::available() => Chosen::Cuda,
        BackendKind::Auto | BackendKind::Cpu => Chosen::Cpu,
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        BackendKind::Metal => Chosen::Metal,
        #[cfg(not(any(target_vendor = "apple", axiom_metal_check)))]
        BackendKind::Metal => bail!("the Metal backend is only built on macOS"),
    })
}

fn kv_type(args: &ModelArgs) -> KvType {
    if args.kv_f32 {
        KvType::F32
    } else {
        KvType::F16
    }
}

/// Context for `run` and `chat` when no `--ctx-size` is given (the model's, if smaller).
const DEFAULT_CONTEXT: usize = 4096;

/// The configuration of the model `args` names, read without loading it, so that sizes from
/// flags can be checked against it first.
fn model_config(args: &ModelArgs) -> Result<ModelConfig> {
    // A bad --backend is named before the file is read, as loading does.
    choose_backend(args)?;
    let path = resolve_model(args.model.as_deref())?;
    axiom::engine::session::read_config(&path).with_context(|| format!("reading {}", path.display()))
}

/// Tokens of context for one sequence: `requested` (else `default`), at most the model's
/// context, so that a huge `--ctx-size` never sizes a cache.
pub fn context_tokens(requested: Option<usize>, default: usize, config: &ModelConfig) -> usize {
    requested.unwrap_or(default).min(config.context_length)
}

/// Refuses, before loading, a model whose weights and KV cache do not fit the memory the
/// system says is available (or whose size does not even fit a `u64`).
pub fn check_host_memory(path: &std::path::Path, options: &LoadOptions, kv_type: KvType) -> Result<()> {
    let Some(available) = serve::available_memory() else {
        return Ok(());
    };
    let config = axiom::engine::session::read_config(path)?;
    let weights: u64 = if path.is_dir() {
        std::fs::read_dir(path)?
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum()
    } else {
        std::fs::metadata(path)?.len()
    };
    let kv = (options.kv_tokens as u64)
        .checked_mul(config.kv_bytes_per_token(kv_type) as u64)
        .filter(|kv| kv.checked_add(weights).is_some())
        .with_context(|| format!("a KV cache of {} tokens is too large to address", options.kv_tokens))?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if weights + kv > available as u64 {
        bail!(
            "the model needs {:.2} GiB ({:.2} GiB of weights, {:.2} GiB of KV cache) but only {:.2} GiB of memory is available; \
             use a smaller model, a smaller --ctx-size or --kv-memory",
            gib(weights + kv),
            gib(weights),
            gib(kv),
            gib(available as u64)
        );
    }
    Ok(())
}

/// Loads the model on the chosen backend; prints a one-line summary on a terminal unless `--quiet`.
fn load_session(args: &ModelArgs, options: LoadOptions, out: Output) -> Result<Loaded> {
    let path = resolve_model(args.model.as_deref())?;
    let start = Instant::now();
    let backend = choose_backend(args)?;
    let context = || format!("loading {}", path.display());
    let loaded = match backend {
        Chosen::Cuda => {
            let backend = CudaBackend::new(0)
                .context("starting the CUDA backend")?
                .with_kv_type(kv_type(args));
            Loaded::Cuda(Box::new(Session::load(&path, backend, options).with_context(context)?))
        }
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        Chosen::Metal => {
            check_host_memory(&path, &options, kv_type(args))?;
            let backend = axiom::backend::metal::MetalBackend::new()
                .context("starting the Metal backend")?
                .with_kv_type(kv_type(args));
            Loaded::Metal(Box::new(Session::load(&path, backend, options).with_context(context)?))
        }
        Chosen::Cpu => {
            check_host_memory(&path, &options, kv_type(args))?;
            Loaded::Cpu(Box::new(
                Session::load(&path, cpu_backend(args)?, options).with_context(context)?,
            ))
        }
    };
    if !out.quiet && std::io::stderr().is_terminal() {
        let (description, bytes, device, context_length) = with_session!(&loaded, session => {
            let info = &session.info;
            (info.description.clone(), info.file_bytes, session.model.backend.device_name(), session.model.config.context_length)
        });
        eprintln!(
            "axiom: {description} ({:.1} MiB) on {device}, context {} tokens, loaded in {:.2} s",
            bytes as f64 / (1 << 20) as f64,
            options.kv_tokens.min(context_length),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(loaded)
}
