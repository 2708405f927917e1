//! `axiom chat` driven through a pseudo-terminal, as a person would use it, and through a pipe.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use expectrl::{ControlCode, Eof, Regex, Session};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn model() -> PathBuf {
    axiom::source::default_model().expect("the default model can be fetched")
}

/// The terminal tests are about timing (a reply interrupted mid-way), and the pseudo-terminal
/// reader polls busily: run them one at a time, each model on one thread.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn chat(extra: &[&str]) -> Session {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_axiom"));
    cmd.args(["chat", "-m", model().to_str().unwrap(), "--temp", "0", "-t", "1"])
        .args(extra);
    let mut session = Session::spawn(cmd).expect("spawn axiom chat in a pty");
    session.set_expect_timeout(Some(Duration::from_secs(120)));
    session.expect(">>> ").expect("the first prompt");
    session
}

#[test]
fn two_turns_stats_save_reset_load_and_exit() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("axiom-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let saved = dir.join("conversation.json");
    let mut p = chat(&["-n", "48"]);
    p.send_line("What is 2+2?").unwrap();
    p.expect(Regex(r"\b4\b")).unwrap();
    p.expect(">>> ").unwrap();
    p.send_line("And 3+3?").unwrap();
    p.expect(">>> ").unwrap();
    p.send_line("/stats").unwrap();
    p.expect(Regex(r"context: \d+ of 4096 tokens, 4 messages")).unwrap();
    p.expect(Regex(r"last reply: \d+ new prompt tokens")).unwrap();
    p.send_line(format!("/save {}", saved.display())).unwrap();
    p.expect("(saved 4 messages").unwrap();
    p.send_line("/reset").unwrap();
    p.expect("(new conversation)").unwrap();
    p.send_line("/stats").unwrap();
    p.expect("0 messages").unwrap();
    p.send_line(format!("/load {}", saved.display())).unwrap();
    p.expect("(loaded 4 messages").unwrap();
    p.send_line("/nonsense").unwrap();
    p.expect("unknown command /nonsense").unwrap();
    p.send_line("/exit").unwrap();
    p.expect(Eof).unwrap();

    let transcript: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let messages = transcript["messages"].as_array().unwrap();
    assert_eq!(messages[0]["content"], "What is 2+2?");
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[2]["content"], "And 3+3?");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ctrl_c_stops_a_reply_and_ctrl_d_exits() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Long enough a reply to interrupt, short enough that an uninterrupted one ends in time.
    let mut p = chat(&["-n", "400"]);
    p.send_line("Write a very long story about a dragon who learns to cook.")
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    p.send(ControlCode::EndOfText).unwrap();
    p.expect("(stopped)").unwrap();
    p.expect(">>> ").unwrap();
    // The conversation goes on after an interrupted reply.
    p.send_line("What is 2+2?").unwrap();
    p.expect("What is 2+2?").unwrap();
    p.expect(">>> ").unwrap();
    p.send(ControlCode::EndOfTransmission).unwrap();
    p.expect(Eof).unwrap();
}

#[test]
fn a_full_context_drops_old_turns_with_a_notice() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut p = chat(&["-n", "24", "-c", "120"]);
    for question in ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city."] {
        p.send_line(question).unwrap();
        p.expect(">>> ").unwrap();
    }
    p.send_line("Name a river.").unwrap();
    p.expect("context full: dropped").unwrap();
    p.send_line("/exit").unwrap();
    p.expect(Eof).unwrap();
}

#[test]
fn piped_chat_prints_exactly_the_greedy_reply_of_run_chat() {
    let m = model();
    let m = m.to_str().unwrap();
    let question = "What is the tallest mountain in the world?";
    let mut child = Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args(["chat", "-m", m, "--temp", "0", "-n", "64"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{question}\n").as_bytes())
        .unwrap();
    let piped = child.wait_with_output().unwrap();
    assert!(piped.status.success(), "{}", String::from_utf8_lossy(&piped.stderr));
    let run = Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args(["run", "-m", m, "--chat", "--temp", "0", "-n", "64", "-q", question])
        .output()
        .unwrap();
    assert!(run.status.success());
    assert!(!piped.stdout.is_empty());
    assert_eq!(
        String::from_utf8(piped.stdout).unwrap(),
        String::from_utf8(run.stdout).unwrap()
    );
}
