//! The one path from `--model` to a loaded session, taken by every command that runs a model:
//! the model is resolved and opened once (its configuration and weight size read there), the
//! memory it needs checked once, and the opened files handed to the load.

use crate::{BackendKind, ModelArgs, Output};
use anyhow::{bail, Context, Result};
use axiom::backend::cpu::{physical_cores, CpuBackend};
use axiom::backend::cuda::{CudaBackend, Nccl, Paths};
use axiom::backend::{Kernels, KvType};
use axiom::engine::Session;
use axiom::model::llama::LoadOptions;
use axiom::model::ModelFiles;
use axiom::parallel::{Rank, Tcp};
use axiom::source::resolve_model;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// A model opened for a command, and the backend it will run on: what the command sizes its
/// KV cache from, before the load takes it.
pub struct OpenModel {
    pub files: ModelFiles,
    pub backend: Chosen,
}

/// Resolves the model `args` names (fetching it if need be) and opens it.
pub fn open_model(args: &ModelArgs) -> Result<OpenModel> {
    // A bad --backend or group of processes is named before the model is fetched or read.
    let backend = choose_backend(args)?;
    process_group(args)?;
    let path = resolve_model(args.model.as_deref())?;
    let files = ModelFiles::open(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(OpenModel { files, backend })
}

/// A loaded model on whichever backend was chosen (boxed: sessions differ in size by backend).
pub enum Loaded {
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
            $crate::load::Loaded::Cpu(boxed) => {
                let $session = &**boxed;
                $body
            }
            $crate::load::Loaded::Cuda(boxed) => {
                let $session = &**boxed;
                $body
            }
            #[cfg(any(target_vendor = "apple", axiom_metal_check))]
            $crate::load::Loaded::Metal(boxed) => {
                let $session = &**boxed;
                $body
            }
        }
    };
    ($loaded:expr, $session:ident => $body:block) => {
        match $loaded {
            $crate::load::Loaded::Cpu(boxed) => {
                #[allow(unused_mut)]
                let mut $session = *boxed;
                $body
            }
            $crate::load::Loaded::Cuda(boxed) => {
                #[allow(unused_mut)]
                let mut $session = *boxed;
                $body
            }
            #[cfg(any(target_vendor = "apple", axiom_metal_check))]
            $crate::load::Loaded::Metal(boxed) => {
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
    Ok(CpuBackend::new(cpu_threads(args)?).with_kv_type(kv_type(args)))
}

fn cpu_threads(args: &ModelArgs) -> Result<usize> {
    let threads = args.threads.unwrap_or_else(physical_cores);
    if !(1..=MAX_THREADS).contains(&threads) {
        bail!("--threads must be between 1 and {MAX_THREADS}, got {threads}");
    }
    Ok(threads)
}

/// The CPU backends of `--tensor-parallel` ranks, sharing the threads.
fn cpu_ranks(args: &ModelArgs) -> Result<Vec<CpuBackend>> {
    let threads = (cpu_threads(args)? / args.tensor_parallel).max(1);
    Ok((0..args.tensor_parallel)
        .map(|_| CpuBackend::new(threads).with_kv_type(kv_type(args)))
        .collect())
}

fn cuda_backend(args: &ModelArgs, ordinal: usize) -> Result<CudaBackend> {
    Ok(CudaBackend::new(ordinal)
        .with_context(|| format!("starting the CUDA backend on GPU {ordinal}"))?
        .with_kv_type(kv_type(args))
        .with_paths(paths(args)))
}

/// This process's place in a group of processes (`--tp-size`).
struct ProcessGroup<'a> {
    size: usize,
    rank: usize,
    address: &'a str,
}

/// How long the ranks of a group of processes wait for each other to start.
const RENDEZVOUS: Duration = Duration::from_secs(300);

/// `--tp-size`, `--tp-rank` and `--tp-addr`, checked: all or none.
fn process_group(args: &ModelArgs) -> Result<Option<ProcessGroup<'_>>> {
    let Some(size) = args.tp_size else {
        if args.tp_rank.is_some() || args.tp_addr.is_some() {
            bail!("--tp-rank and --tp-addr go with --tp-size");
        }
        return Ok(None);
    };
    if args.tensor_parallel != 1 {
        bail!(
            "--tensor-parallel splits the model over ranks in this process, --tp-size over processes: give one of them"
        );
    }
    if size == 0 {
        bail!("--tp-size must be at least 1");
    }
    let Some(rank) = args.tp_rank else {
        bail!("--tp-size needs --tp-rank, this process's rank (0 to {})", size - 1);
    };
    if rank >= size {
        bail!("--tp-rank {rank} is not below --tp-size {size}");
    }
    let Some(address) = args.tp_addr.as_deref() else {
        bail!("--tp-size needs --tp-addr HOST:PORT, where rank 0 listens for the others");
    };
    Ok(Some(ProcessGroup { size, rank, address }))
}

/// The backend a command runs on, `auto` resolved.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    Cpu,
    Cuda,
    #[cfg(any(target_vendor = "apple", axiom_metal_check))]
    Metal,
}

/// `auto` is CUDA when a GPU is present, else the CPU. Metal is used only when asked for: it has
/// been type-checked and its kernels run on the CPU, but not yet run on a Mac (docs/metal.md).
fn choose_backend(args: &ModelArgs) -> Result<Chosen> {
    let chosen = match args.backend {
        BackendKind::Cuda => Chosen::Cuda,
        BackendKind::Auto if axiom::backend::cuda::device::available() => Chosen::Cuda,
        BackendKind::Auto | BackendKind::Cpu => Chosen::Cpu,
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        BackendKind::Metal if args.deterministic => {
            bail!("--deterministic is not implemented on Metal: its prompts take other kernels than its decode steps")
        }
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        BackendKind::Metal => Chosen::Metal,
        #[cfg(not(any(target_vendor = "apple", axiom_metal_check)))]
        BackendKind::Metal => bail!("the Metal backend is only built on macOS"),
    };
    match (args.tensor_parallel, chosen) {
        (0, _) => bail!("--tensor-parallel must be at least 1"),
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        (n, Chosen::Metal) if n > 1 || args.tp_size.is_some() => {
            bail!("--tensor-parallel and --tp-size are not built for Metal (--backend cpu runs them)")
        }
        _ => Ok(chosen),
    }
}

pub fn kv_type(args: &ModelArgs) -> KvType {
    if args.kv_f32 {
        KvType::F32
    } else {
        KvType::F16
    }
}

/// The CUDA kernels `--deterministic` asks for. (The CPU backend takes one path for every
/// step whatever it is told: tests/reproducible.rs.)
fn paths(args: &ModelArgs) -> Paths {
    match args.deterministic {
        true => Paths::BatchInvariant,
        false => Paths::Fastest,
    }
}

/// Refuses, before loading, a model whose weights and KV cache do not fit the memory the
/// system says is available (or whose size does not even fit a `u64`).
fn check_host_memory(files: &ModelFiles, options: &LoadOptions, kv_type: KvType) -> Result<()> {
    let Some(available) = available_memory() else {
        return Ok(());
    };
    let weights = files.weight_bytes() as u64;
    let kv = (options.kv_tokens as u64)
        .checked_mul(files.config.kv_bytes_per_token(kv_type) as u64)
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

/// Bytes of memory available to the process (MemAvailable), if the system says.
pub fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Loads the opened model on its backend; prints a one-line summary on a terminal unless `--quiet`.
pub fn load_session(args: &ModelArgs, model: OpenModel, options: LoadOptions, out: Output) -> Result<Loaded> {
    let start = Instant::now();
    if let Some(group) = process_group(args)? {
        let loaded = load_rank(args, model, options, &group)?;
        if group.rank > 0 {
            follow(loaded)?;
            // This process has done its part of rank 0's command; rank 0 reports it.
            std::process::exit(0);
        }
        summarize(&loaded, options, out, start);
        return Ok(loaded);
    }
    let OpenModel { files, backend } = model;
    // The CPU and Metal (unified memory) hold the weights in host memory; a CUDA device has its own.
    if backend != Chosen::Cuda {
        check_host_memory(&files, &options, kv_type(args))?;
    }
    let path = files.path.clone();
    let context = || format!("loading {}", path.display());
    let loaded = match backend {
        Chosen::Cuda if args.tensor_parallel > 1 => {
            // The ranks share the one GPU, each on a thread with its own stream and handles.
            let backends = (0..args.tensor_parallel)
                .map(|_| cuda_backend(args, 0))
                .collect::<Result<Vec<_>>>()?;
            Loaded::Cuda(Box::new(
                Session::from_files_sharded(files, Rank::in_process(backends)?, options).with_context(context)?,
            ))
        }
        Chosen::Cuda => Loaded::Cuda(Box::new(
            Session::from_files(files, cuda_backend(args, 0)?, options).with_context(context)?,
        )),
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        Chosen::Metal => {
            let backend = axiom::backend::metal::MetalBackend::new()
                .context("starting the Metal backend")?
                .with_kv_type(kv_type(args));
            Loaded::Metal(Box::new(
                Session::from_files(files, backend, options).with_context(context)?,
            ))
        }
        Chosen::Cpu if args.tensor_parallel > 1 => Loaded::Cpu(Box::new(
            Session::from_files_sharded(files, Rank::in_process(cpu_ranks(args)?)?, options).with_context(context)?,
        )),
        Chosen::Cpu => Loaded::Cpu(Box::new(
            Session::from_files(files, cpu_backend(args)?, options).with_context(context)?,
        )),
    };
    summarize(&loaded, options, out, start);
    Ok(loaded)
}

/// This process's rank of a group of processes: it meets the others, takes rank 0's load
/// options (so that every rank's cache and batches match whatever each was told), and loads its
/// share. On CUDA the collectives go through NCCL, one GPU a rank: the rank's, modulo the GPUs
/// this process sees (so `CUDA_VISIBLE_DEVICES` may give each process its own).
fn load_rank(args: &ModelArgs, model: OpenModel, options: LoadOptions, group: &ProcessGroup) -> Result<Loaded> {
    let OpenModel { files, backend } = model;
    let path = files.path.clone();
    let context = || format!("loading {} as rank {} of {}", path.display(), group.rank, group.size);
    let tcp = Tcp::join(group.address, group.rank, group.size, RENDEZVOUS)
        .with_context(|| format!("joining the tensor-parallel group at {}", group.address))?;
    let options = shared_options(&tcp, options)?;
    if backend != Chosen::Cuda {
        check_host_memory(&files, &options, kv_type(args))?;
    }
    Ok(match backend {
        Chosen::Cuda => {
            let gpus = axiom::backend::cuda::device::count().context("counting the GPUs")?;
            let backend = cuda_backend(args, group.rank % gpus.max(1))?;
            let comm = Nccl::join(tcp, &backend).context("starting NCCL")?;
            let rank = Rank {
                backend,
                comm: Box::new(comm),
            };
            Loaded::Cuda(Box::new(
                Session::from_files_rank(files, rank, options).with_context(context)?,
            ))
        }
        Chosen::Cpu => {
            let rank = Rank {
                backend: cpu_backend(args)?,
                comm: Box::new(tcp),
            };
            Loaded::Cpu(Box::new(
                Session::from_files_rank(files, rank, options).with_context(context)?,
            ))
        }
        #[cfg(any(target_vendor = "apple", axiom_metal_check))]
        Chosen::Metal => bail!("--tp-size is not built for Metal (--backend cpu runs it)"),
    })
}

/// Rank 0's load options, handed to every rank.
fn shared_options(tcp: &Tcp, options: LoadOptions) -> Result<LoadOptions> {
    if tcp.rank() == 0 {
        let kv = options.kv_tokens as u64;
        let words = [
            options.max_batch as u32,
            options.max_seqs as u32,
            kv as u32,
            (kv >> 32) as u32,
        ];
        tcp.send_words(&words)?;
        return Ok(options);
    }
    match tcp.receive_words()?.as_deref() {
        Some(&[max_batch, max_seqs, low, high]) => Ok(LoadOptions {
            max_batch: max_batch as usize,
            max_seqs: max_seqs as usize,
            kv_tokens: (u64::from(high) << 32 | u64::from(low)) as usize,
        }),
        _ => bail!("rank 0 did not send its load options"),
    }
}

/// A rank other than 0: runs rank 0's steps until rank 0 is done.
fn follow(loaded: Loaded) -> Result<()> {
    with_session!(loaded, session => {
        session.model.follow().context("following rank 0")
    })
}

/// The one-line load summary, on a terminal unless `--quiet`.
fn summarize(loaded: &Loaded, options: LoadOptions, out: Output, start: Instant) {
    if !out.quiet && std::io::stderr().is_terminal() {
        let (description, bytes, mut device, context_length, ranks) = with_session!(&loaded, session => {
            let info = &session.info;
            let model = &session.model;
            (info.description.clone(), info.file_bytes, model.backend.device_name(), model.config.context_length, model.ranks())
        });
        if ranks > 1 {
            device = format!("{ranks} ranks of {device}");
        }
        eprintln!(
            "axiom: {description} ({:.1} MiB) on {device}, context {} tokens, loaded in {:.2} s",
            bytes as f64 / (1 << 20) as f64,
            options.kv_tokens.min(context_length),
            start.elapsed().as_secs_f64()
        );
    }
}
