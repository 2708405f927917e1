//! `axiom chat`: an interactive conversation in the terminal, or one reply to piped input.

use crate::load::{load_session, open_model};
use crate::{context_tokens, outln, print_out, with_session, ModelArgs, Output, SamplingArgs, DEFAULT_CONTEXT};
use anyhow::{Context, Result};
use axiom::backend::Backend;
use axiom::engine::conversation::{Conversation, Transcript, Turn};
use axiom::engine::{Sampler, Session};
use axiom::model::llama::LoadOptions;
use clap::Args;
use rustyline::error::ReadlineError;
use std::io::{IsTerminal, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Context size in tokens (default 4096); at most the model's.
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
}

const HELP: &str = "\
/help            this text
/reset           start a new conversation (the system message stays)
/system TEXT     set the system message and start a new conversation
/save FILE       write the conversation as JSON
/load FILE       read a conversation written by /save
/stats           tokens, speed and context used
/exit            leave (or Ctrl-D)
End a line with \\ to continue on the next one. Ctrl-C stops a reply.";

pub fn chat(args: ChatArgs, out: Output) -> Result<()> {
    let sampler_config = args.sampling.sampler()?;
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
        let mut conversation = Conversation::new(&mut session, ctx, args.system.clone())?;
        let mut sampler = Sampler::new(sampler_config);
        if !std::io::stdin().is_terminal() {
            // Scripted use: the whole input is one message; only the reply is printed.
            let mut message = String::new();
            std::io::stdin()
                .read_to_string(&mut message)
                .context("reading standard input")?;
            let turn = say(
                &mut session,
                &mut conversation,
                message.trim_end_matches('\n'),
                &mut sampler,
                &args.sampling,
                None,
            )?;
            report_dropped(&turn);
            return Ok(());
        }
        interactive(&mut session, &mut conversation, &mut sampler, &args, out)
    })
}

fn interactive<B: Backend>(
    session: &mut Session<B>,
    conversation: &mut Conversation,
    sampler: &mut Sampler,
    args: &ChatArgs,
    out: Output,
) -> Result<()> {
    // Ctrl-C during a reply stops the reply; at the prompt the line editor sees it as a key.
    let cancel = Arc::new(AtomicBool::new(false));
    let replying = Arc::new(AtomicBool::new(false));
    {
        let (cancel, replying) = (cancel.clone(), replying.clone());
        ctrlc::set_handler(move || {
            if replying.load(Ordering::SeqCst) {
                cancel.store(true, Ordering::SeqCst);
            } else {
                std::process::exit(130);
            }
        })
        .context("installing the Ctrl-C handler")?;
    }
    if !out.quiet {
        eprintln!("Chatting. /help for commands, Ctrl-D to leave.");
    }
    let mut editor = rustyline::DefaultEditor::new().context("starting the line editor")?;
    // History survives between sessions, beside the model cache.
    let history = axiom::cache::dir().ok().map(|d| d.join("chat_history.txt"));
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    let mut last: Option<Turn> = None;
    loop {
        let line = match read_message(&mut editor) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => return Err(e),
        };
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(command) = trimmed.strip_prefix('/') {
            let (name, rest) = command.split_once(' ').map_or((command, ""), |(n, r)| (n, r.trim()));
            match name {
                "help" => outln!("{HELP}")?,
                "exit" | "quit" => break,
                "reset" => {
                    let system = conversation.transcript.system.clone();
                    conversation.replace(
                        session,
                        Transcript {
                            system,
                            messages: Vec::new(),
                        },
                    );
                    outln!("(new conversation)")?;
                }
                "system" => {
                    let system = (!rest.is_empty()).then(|| rest.to_string());
                    conversation.replace(
                        session,
                        Transcript {
                            system,
                            messages: Vec::new(),
                        },
                    );
                    outln!("(system message set; new conversation)")?;
                }
                "save" if !rest.is_empty() => match save(conversation, rest) {
                    Ok(()) => outln!("(saved {} messages to {rest})", conversation.transcript.messages.len())?,
                    Err(e) => eprintln!("error: {e:#}"),
                },
                "load" if !rest.is_empty() => match load(rest) {
                    Ok(transcript) => {
                        let n = transcript.messages.len();
                        conversation.replace(session, transcript);
                        outln!("(loaded {n} messages from {rest})")?;
                    }
                    Err(e) => eprintln!("error: {e:#}"),
                },
                "stats" => print_stats(conversation, last.as_ref())?,
                _ => eprintln!("unknown command /{name}; /help lists them"),
            }
            continue;
        }
        cancel.store(false, Ordering::SeqCst);
        replying.store(true, Ordering::SeqCst);
        let result = say(
            session,
            conversation,
            &line,
            sampler,
            &args.sampling,
            Some(cancel.clone()),
        );
        replying.store(false, Ordering::SeqCst);
        match result {
            Ok(turn) => {
                report_dropped(&turn);
                if cancel.load(Ordering::SeqCst) {
                    eprintln!("(stopped)");
                }
                last = Some(turn);
            }
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
    if let Some(path) = &history {
        let _ = path.parent().map(std::fs::create_dir_all);
        let _ = editor.save_history(path);
    }
    Ok(())
}

/// Reads one message: lines ending in `\` continue on the next. `None` at end of input.
fn read_message(editor: &mut rustyline::DefaultEditor) -> Result<Option<String>> {
    let mut message = String::new();
    let mut prompt = ">>> ";
    loop {
        match editor.readline(prompt) {
            Ok(line) => {
                if let Some(head) = line.strip_suffix('\\') {
                    message.push_str(head);
                    message.push('\n');
                    prompt = "... ";
                    continue;
                }
                message.push_str(&line);
                if !message.trim().is_empty() {
                    let _ = editor.add_history_entry(message.as_str());
                }
                return Ok(Some(message));
            }
            // Ctrl-C at the prompt drops the line being typed.
            Err(ReadlineError::Interrupted) => {
                message.clear();
                prompt = ">>> ";
            }
            Err(ReadlineError::Eof) => return Ok(None),
            Err(e) => return Err(e).context("reading input"),
        }
    }
}

/// One turn, the reply streamed to stdout.
fn say<B: Backend>(
    session: &mut Session<B>,
    conversation: &mut Conversation,
    message: &str,
    sampler: &mut Sampler,
    sampling: &SamplingArgs,
    cancel: Option<Arc<AtomicBool>>,
) -> Result<Turn> {
    let mut options = sampling.generate_options();
    options.cancel = cancel;
    let mut written = Ok(());
    let turn = conversation.reply(session, message, sampler, &options, |piece| {
        if written.is_ok() {
            written = print_out(piece.as_bytes());
        }
    })?;
    written?;
    outln!()?;
    Ok(turn)
}

fn report_dropped(turn: &Turn) {
    if turn.dropped_turns > 0 {
        eprintln!(
            "(context full: dropped the {} oldest turn(s) of the conversation)",
            turn.dropped_turns
        );
    }
}

fn print_stats(conversation: &Conversation, last: Option<&Turn>) -> Result<()> {
    let (used, capacity) = conversation.context_used();
    outln!(
        "context: {used} of {capacity} tokens, {} messages",
        conversation.transcript.messages.len()
    )?;
    if let Some(turn) = last {
        let g = &turn.generation;
        outln!(
            "last reply: {} new prompt tokens at {:.1} tok/s, {} tokens generated at {:.1} tok/s",
            turn.prompt_tokens_run,
            turn.prompt_tokens_run as f64 / g.prompt_time.as_secs_f64().max(1e-9),
            g.tokens.len(),
            g.tokens.len() as f64 / g.generation_time.as_secs_f64().max(1e-9)
        )?;
    }
    Ok(())
}

fn save(conversation: &Conversation, path: &str) -> Result<()> {
    let json = serde_json::to_string_pretty(&conversation.transcript)?;
    std::fs::write(path, json + "\n").with_context(|| format!("writing {path}"))
}

fn load(path: &str) -> Result<Transcript> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    serde_json::from_str(&text).with_context(|| format!("{path} is not a conversation saved by /save"))
}
