//! `axiom serve`: the OpenAI-compatible server. The model lives on an engine thread (a GPU
//! context stays on the thread that made it); HTTP runs on a tokio runtime.

use crate::load::{available_memory, kv_type, load_session, open_model, Chosen};
use crate::{ModelArgs, Output};
use anyhow::{bail, Context, Result};
use axiom::backend::Backend;
use axiom::engine::scheduler::{Scheduler, SchedulerConfig};
use axiom::engine::Session;
use axiom::model::llama::LoadOptions;
use axiom::tool_calls::ToolFormat;
use axiom_server::callers::CallerPolicy;
use axiom_server::connections::ConnectionLimits;
use axiom_server::metrics::ServerMetrics;
use axiom_server::{AppState, ServerOptions};
use clap::Args;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// KV cache memory: a size (2GiB, 512MiB) or a fraction of the memory left after the
    /// weights (0.5). Default: 2GiB on the CPU, 0.9 on a GPU.
    #[arg(long)]
    kv_memory: Option<String>,
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 64)]
    max_seqs: usize,
    /// Most tokens one step runs (decode tokens plus prompt chunks), vLLM's
    /// --max-num-batched-tokens, llama.cpp's --ubatch-size: a prompt on an idle server is
    /// prefilled in chunks of this size. The activation buffers are sized for it (an 8B model:
    /// about 300 KB a token). Default: 2048 on CUDA, 512 on the CPU and Metal.
    #[arg(long, visible_alias = "max-num-batched-tokens")]
    max_batch_tokens: Option<usize>,
    /// Most tokens one step runs while any stream is decoding: its next tokens, then prompt
    /// chunks in what is left. A step's time is every stream's gap between tokens, so this
    /// bounds that gap while a long prompt is admitted. At most --max-batch-tokens; more than
    /// --max-seqs, so that a prompt makes progress beside a full set of streams.
    #[arg(long, default_value_t = 512)]
    decode_batch_tokens: usize,
    /// Requests that may wait before new ones get 503.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Seconds a client may take to send its request body before it gets 408.
    #[arg(long, default_value_t = 30.0)]
    read_timeout: f64,
    /// Seconds a connection may take to send a request's headers before it is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a connection may stay open with no request in flight.
    #[arg(long, default_value_t = 5.0)]
    keep_alive_timeout: f64,
    /// Most connections open at once; past it a connection gets 503 and is closed. The default
    /// leaves room under the common limit of 1024 open files.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds open requests may take to finish after SIGTERM or Ctrl-C; then every connection
    /// is closed.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Every route but /health needs `Authorization: Bearer KEY`.
    #[arg(long, env = "AXIOM_API_KEY", hide_env_values = true, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from the first line of this file (keeps it out of `ps`).
    #[arg(long)]
    api_key_file: Option<std::path::PathBuf>,
    /// Serve /metrics without the API key.
    #[arg(long)]
    metrics_public: bool,
    /// An origin whose web pages may call the server (repeatable; `*` for any). CORS is off
    /// without it.
    #[arg(long)]
    cors_origin: Vec<String>,
    /// A host name clients may use besides localhost, 127.0.0.1 and [::1] while the server
    /// listens on loopback (repeatable); other Host headers get 403.
    #[arg(long)]
    allowed_host: Vec<String>,
    /// How the model writes tool calls: hermes, llama3_json or mistral (default: read from the
    /// chat template).
    #[arg(long, value_parser = tool_parser)]
    tool_parser: Option<ToolFormat>,
    /// Most tokens (prompt and completion) per request (default: the model's context).
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// The model name clients see (default: the file name, or the hf: source without "hf:").
    #[arg(long)]
    model_id: Option<String>,
}

/// `2GiB`, `512MiB`, `1.5G`, `1000000` (bytes), or a fraction below 1.
enum KvMemory {
    Bytes(usize),
    Fraction(f64),
}

fn parse_kv_memory(text: &str) -> Result<KvMemory> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .with_context(|| format!("--kv-memory {text:?}: not a size"))?;
    if value.is_nan() || value <= 0.0 {
        bail!("--kv-memory must be positive");
    }
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" if value < 1.0 => return Ok(KvMemory::Fraction(value)),
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("--kv-memory {text:?}: unknown unit {other:?}"),
    };
    Ok(KvMemory::Bytes((value * scale) as usize))
}

/// A duration flag: a positive, finite number of seconds.
fn seconds(value: f64, flag: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|t| !t.is_zero())
        .with_context(|| format!("{flag} must be a positive number of seconds, not {value}"))
}

fn positive(value: usize, flag: &str) -> Result<usize> {
    if value == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(value)
}

/// --decode-batch-tokens, checked against the step's size and the streams it holds; a budget
/// above --max-batch-tokens is lowered to it (the default of 512 with a smaller step).
fn decode_batch_tokens(value: usize, max_batch: usize, max_seqs: usize) -> Result<usize> {
    if value <= max_seqs && value < max_batch {
        bail!(
            "--decode-batch-tokens {value} leaves no room for a prompt beside {max_seqs} decoding streams \
             (--max-seqs); give more than {max_seqs}"
        );
    }
    Ok(value.min(max_batch))
}

/// The key from --api-key (or AXIOM_API_KEY) or the first line of --api-key-file.
fn api_key(args: &ServeArgs) -> Result<Option<String>> {
    let key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => key.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("reading --api-key-file {}", path.display()))?
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_owned(),
        (None, None) => return Ok(None),
    };
    if key.is_empty() {
        bail!("the API key is empty");
    }
    Ok(Some(key))
}

/// The name clients see unless `--model-id` gives one: an `hf:` source as given, without the
/// prefix (its files sit in a directory named by a commit), else the model's file name.
fn default_model_id(source: Option<&Path>, path: &Path) -> String {
    match source.and_then(|s| s.to_str()?.strip_prefix("hf:")) {
        Some(repo) => repo.to_string(),
        None => path
            .file_name()
            .map_or("axiom".into(), |n| n.to_string_lossy().into_owned()),
    }
}

fn tool_parser(name: &str) -> std::result::Result<ToolFormat, String> {
    ToolFormat::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = ToolFormat::ALL.iter().map(|f| f.name()).collect();
        format!("unknown tool parser {name:?}; known: {}", names.join(", "))
    })
}

pub fn serve(args: ServeArgs, out: Output) -> Result<()> {
    let model = open_model(&args.model)?;
    let config = &model.files.config;
    let use_cuda = model.backend == Chosen::Cuda;
    let per_token = config.kv_bytes_per_token(kv_type(&args.model));
    let weights = model.files.weight_bytes();
    let default = if use_cuda { "0.9" } else { "2GiB" };
    let kv_bytes = match parse_kv_memory(args.kv_memory.as_deref().unwrap_or(default))? {
        KvMemory::Bytes(b) => b,
        KvMemory::Fraction(f) => {
            let free = if use_cuda {
                axiom::backend::cuda::device::CudaDevice::new(0)?.free_memory()?
            } else {
                available_memory().context("cannot read the available memory; give --kv-memory as a size")?
            };
            (free.saturating_sub(weights + (1 << 30)) as f64 * f) as usize
        }
    };
    let kv_tokens = kv_bytes / per_token.max(1);
    let context = args
        .ctx_size
        .unwrap_or(config.context_length)
        .min(config.context_length);
    if kv_tokens < axiom::model::PAGE_SIZE {
        bail!("--kv-memory of {kv_bytes} bytes holds no KV page ({per_token} bytes per token)");
    }
    let max_batch = positive(
        args.max_batch_tokens.unwrap_or(if use_cuda { 2048 } else { 512 }),
        "--max-batch-tokens",
    )?;
    // Each sequence in a step takes at least one of its tokens.
    let max_seqs = args.max_seqs.clamp(1, max_batch);
    let decode_batch_tokens = decode_batch_tokens(args.decode_batch_tokens, max_batch, max_seqs)?;
    let options = LoadOptions {
        max_batch,
        kv_tokens,
        max_seqs,
    };
    let model_id = args
        .model_id
        .clone()
        .unwrap_or_else(|| default_model_id(args.model.model.as_deref(), &model.files.path));
    let server = ServerOptions {
        max_body_bytes: args.max_body_bytes,
        connections: ConnectionLimits {
            max_connections: positive(args.max_connections, "--max-connections")?,
            header_timeout: seconds(args.header_timeout, "--header-timeout")?,
            keep_alive_timeout: seconds(args.keep_alive_timeout, "--keep-alive-timeout")?,
            shutdown_timeout: seconds(args.shutdown_timeout, "--shutdown-timeout")?,
        },
        callers: CallerPolicy {
            api_key: api_key(&args)?,
            metrics_public: args.metrics_public,
            cors_origins: args.cors_origin.clone(),
            allowed_hosts: args.allowed_host.clone(),
        },
    };
    let read_timeout = seconds(args.read_timeout, "--read-timeout")?;
    let metrics = Arc::new(ServerMetrics::new().context("registering the metrics")?);
    let scheduler_config = SchedulerConfig {
        max_queue: args.max_queue,
        max_context: context,
        decode_batch_tokens,
    };

    // The engine thread loads the model and reports back what the HTTP side needs.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let model_args = args.model.clone();
    let engine_metrics = metrics.clone();
    let engine = std::thread::Builder::new().name("axiom-engine".into()).spawn(move || {
        let loaded = match load_session(&model_args, model, options, out) {
            Ok(l) => l,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        crate::with_session!(loaded, session => {
            run_engine(session, scheduler_config, engine_metrics, ready_tx)
        })
    })?;
    let (handle, tokenizer, template, description) =
        ready_rx.recv().context("the engine thread stopped while loading")??;
    handle.prepare_constraints();

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let address = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("binding {address}"))?;
        let local = listener.local_addr()?;
        if !local.ip().is_loopback() && server.callers.api_key.is_none() {
            eprintln!(
                "axiom: warning: listening on {local} without --api-key: anyone who can reach this address can use the model"
            );
        }
        if !out.quiet {
            eprintln!(
                "axiom: serving {description} as {model_id:?} on http://{local} ({kv_tokens} KV tokens, {} per request, up to {} sequences)",
                handle.context(),
                options.max_seqs
            );
        }
        let tool_format = args
            .tool_parser
            .or_else(|| template.as_ref().and_then(|t| ToolFormat::detect(t.source())));
        let state = Arc::new(AppState::new(
            handle,
            tokenizer,
            template,
            tool_format,
            model_id,
            metrics,
            read_timeout,
        ));
        axiom_server::serve(listener, state, &server, shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok(())
}

type Ready = (
    axiom::engine::scheduler::EngineHandle,
    Arc<axiom::tokenizer::Tokenizer>,
    Option<axiom::chat::ChatTemplate>,
    String,
);

fn run_engine<B: Backend>(
    session: Session<B>,
    config: SchedulerConfig,
    metrics: Arc<ServerMetrics>,
    ready: std::sync::mpsc::Sender<Result<Ready>>,
) {
    let Session {
        model,
        pages,
        tokenizer,
        chat_template,
        info,
    } = session;
    let tokenizer = Arc::new(tokenizer);
    let (scheduler, handle) = Scheduler::new(model, pages, tokenizer.clone(), config);
    let description = format!("{} on {}", info.description, scheduler.model().backend.device_name());
    if ready.send(Ok((handle, tokenizer, chat_template, description))).is_ok() {
        scheduler.with_metrics(metrics).run();
    }
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down: finishing open requests");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_model_id_names_the_source() {
        let snapshot = Path::new("/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd");
        let source = Path::new("hf:Qwen/Qwen3-0.6B");
        assert_eq!(default_model_id(Some(source), snapshot), "Qwen/Qwen3-0.6B");
        let file = Path::new("/models/tiny.Q8_0.gguf");
        assert_eq!(default_model_id(Some(file), file), "tiny.Q8_0.gguf");
        assert_eq!(default_model_id(None, file), "tiny.Q8_0.gguf");
    }
}
