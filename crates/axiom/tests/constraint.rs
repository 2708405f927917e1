//! Constrained decoding, logit bias and stop tokens on the real default model, through the
//! scheduler (masks computed beside the step) and the one-sequence generation loop.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::chat::Message;
use axiom::engine::scheduler::{EngineHandle, Event, FinishReason, Request, Scheduler, SchedulerConfig, SubmitError};
use axiom::engine::tool_choice::{any_tool_call, named_tool_call, ToolSchema};
use axiom::engine::{generate, ConstraintSpec, GenerateOptions, Sampler, SamplerConfig, Session, StopReason};
use axiom::model::llama::LoadOptions;
use axiom::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

const SEEDS: u64 = 20;

fn session() -> Session<CpuBackend> {
    Session::load(
        &common::smollm2(),
        CpuBackend::new(2),
        LoadOptions {
            max_batch: 256,
            kv_tokens: 8192,
            max_seqs: 32,
        },
    )
    .unwrap()
}

struct Engine {
    scheduler: Scheduler<CpuBackend>,
    handle: EngineHandle,
    tokenizer: Arc<Tokenizer>,
}

fn engine(session: Session<CpuBackend>) -> Engine {
    let Session {
        model,
        pages,
        tokenizer,
        ..
    } = session;
    let tokenizer = Arc::new(tokenizer);
    let (scheduler, handle) = Scheduler::new(model, pages, tokenizer.clone(), SchedulerConfig::default());
    Engine {
        scheduler,
        handle,
        tokenizer,
    }
}

fn chat(session: &Session<CpuBackend>, text: &str) -> Vec<u32> {
    session.chat_prompt(&[Message::new("user", text)]).unwrap()
}

fn request(
    prompt: Vec<u32>,
    sampling: SamplerConfig,
    constraint: Option<ConstraintSpec>,
) -> (Request, Receiver<Event>) {
    let (tx, rx) = channel();
    let request = Request {
        prompt,
        sampling,
        max_tokens: 120,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        constraint,
        logprobs: None,
        ignore_eos: false,
        sink: Box::new(tx),
    };
    (request, rx)
}

fn warm(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 1.0,
        seed,
        ..SamplerConfig::default()
    }
}

/// Runs until every request is done; each one's text and why it ended.
fn finish(engine: &mut Engine, receivers: Vec<Receiver<Event>>) -> Vec<(Vec<u32>, String, FinishReason)> {
    while engine.scheduler.step().unwrap() {}
    receivers
        .iter()
        .map(|rx| {
            let mut tokens = Vec::new();
            let mut text = String::new();
            for event in rx.try_iter() {
                match event {
                    Event::Token(t) => {
                        tokens.push(t.id);
                        text.push_str(&t.text);
                    }
                    Event::Done(c) => return (tokens, text, c.finish),
                    Event::Error(e) => panic!("request failed: {e}"),
                }
            }
            panic!("no Done event")
        })
        .collect()
}

/// Every seed's output under `spec`, all running together.
fn constrained(session: Session<CpuBackend>, prompt: &str, spec: ConstraintSpec) -> Vec<(String, FinishReason)> {
    let prompt = chat(&session, prompt);
    let mut engine = engine(session);
    let receivers = (0..SEEDS)
        .map(|seed| {
            let (request, rx) = request(prompt.clone(), warm(seed), Some(spec.clone()));
            engine.handle.submit(request).unwrap();
            rx
        })
        .collect();
    finish(&mut engine, receivers)
        .into_iter()
        .map(|(_, text, finish)| (text, finish))
        .collect()
}

#[test]
fn json_schema_holds_on_every_seed() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    let outputs = constrained(
        session(),
        "Describe a person as JSON with a name and an age.",
        ConstraintSpec::JsonSchema { schema, strict: true },
    );
    for (text, finish) in outputs {
        assert_eq!(finish, FinishReason::Stop, "{text:?}");
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let object = value.as_object().unwrap();
        assert_eq!(object.len(), 2, "{text}");
        assert!(object["name"].is_string(), "{text}");
        assert!(object["age"].is_i64() || object["age"].is_u64(), "{text}");
    }
}

/// Greedy constrained requests take their choice from the device's argmax within the mask; with
/// log-probabilities asked for, from the logits on the host. Both must give the same tokens.
#[test]
fn greedy_constrained_choices_on_the_device_equal_the_hosts() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    let spec = ConstraintSpec::JsonSchema { schema, strict: true };
    let s = session();
    let prompts = [
        chat(&s, "Describe a person as JSON with a name and an age."),
        chat(&s, "Who wrote Hamlet? Answer in JSON."),
    ];
    let mut engine = engine(s);
    let mut receivers = Vec::new();
    for prompt in &prompts {
        for logprobs in [None, Some(0)] {
            let (mut request, rx) = request(prompt.clone(), SamplerConfig::greedy(), Some(spec.clone()));
            request.logprobs = logprobs;
            engine.handle.submit(request).unwrap();
            receivers.push(rx);
        }
    }
    let outputs = finish(&mut engine, receivers);
    for pair in outputs.chunks(2) {
        let (device, host) = (&pair[0], &pair[1]);
        assert_eq!(device.0, host.0, "{:?} vs {:?}", device.1, host.1);
        assert_eq!(device.2, FinishReason::Stop, "{:?}", device.1);
        let value: Value = serde_json::from_str(&device.1).unwrap_or_else(|e| panic!("{:?}: {e}", device.1));
        assert!(value["name"].is_string() && value["age"].is_i64(), "{}", device.1);
    }
}

#[test]
fn regex_holds_on_every_seed() {
    let outputs = constrained(
        session(),
        "Give me a phone number.",
        ConstraintSpec::Regex(r"[0-9]{3}-[0-9]{4}".into()),
    );
    for (text, finish) in outputs {
        assert_eq!(finish, FinishReason::Stop, "{text:?}");
        let chars: Vec<char> = text.chars().collect();
        assert_eq!(chars.len(), 8, "{text:?}");
        assert!(
            chars
                .iter()
                .enumerate()
                .all(|(i, c)| if i == 3 { *c == '-' } else { c.is_ascii_digit() }),
            "{text:?}"
        );
    }
}

#[test]
fn choice_holds_on_every_seed_and_grammars_compile_from_lark_and_gbnf() {
    let choices = ["red", "green", "blue"].map(String::from).to_vec();
    let outputs = constrained(session(), "Name a colour.", ConstraintSpec::Choice(choices.clone()));
    for (text, finish) in &outputs {
        assert_eq!(*finish, FinishReason::Stop);
        assert!(choices.contains(text), "{text:?}");
    }

    let s = session();
    let prompt = chat(&s, "What is six times seven?");
    let mut engine = engine(s);
    let grammars = [
        ConstraintSpec::Lark(r#"start: "The answer is " /[0-9]+/ "." "#.into()),
        // Upper case and `_` in rule names, which Lark reads otherwise, and a rule over lines.
        ConstraintSpec::Gbnf("root ::= (\"The answer is \"\n  Some_Digits) \".\"\nSome_Digits ::= [0-9]+\n".into()),
    ];
    let receivers = grammars
        .iter()
        .map(|g| {
            let (request, rx) = request(prompt.clone(), warm(1), Some(g.clone()));
            engine.handle.submit(request).unwrap();
            rx
        })
        .collect();
    for (_, text, finish) in finish(&mut engine, receivers) {
        assert_eq!(finish, FinishReason::Stop);
        let number = text
            .strip_prefix("The answer is ")
            .and_then(|t| t.strip_suffix('.'))
            .unwrap();
        assert!(
            !number.is_empty() && number.chars().all(|c| c.is_ascii_digit()),
            "{text:?}"
        );
    }

    // A bad constraint is refused at submission, saying why.
    for bad in [
        ConstraintSpec::Regex("[0-9".into()),
        ConstraintSpec::Lark("start: missing_rule".into()),
        ConstraintSpec::Gbnf("root ::= [z-a]".into()),
        ConstraintSpec::JsonSchema {
            schema: json!({"type": "no-such-type"}),
            strict: true,
        },
        ConstraintSpec::Choice(Vec::new()),
    ] {
        let (request, _rx) = request(prompt.clone(), warm(1), Some(bad.clone()));
        match engine.handle.submit(request) {
            Err(SubmitError::Constraint(e)) => assert!(!e.0.is_empty()),
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
}

#[test]
fn logit_bias_bans_the_greedy_token_and_stop_tokens_stop() {
    let s = session();
    let prompt = chat(&s, "Write a sentence about the sea.");
    let mut engine = engine(s);
    let run = |engine: &mut Engine, sampling: SamplerConfig, stop_token_ids: Vec<u32>| {
        let (mut request, rx) = request(prompt.clone(), sampling, None);
        request.max_tokens = 12;
        request.stop_token_ids = stop_token_ids;
        engine.handle.submit(request).unwrap();
        finish(engine, vec![rx]).remove(0)
    };
    let (plain, _, _) = run(&mut engine, SamplerConfig::greedy(), Vec::new());
    assert!(plain.len() >= 4);
    let banned = SamplerConfig {
        logit_bias: vec![(plain[0], -100.0)],
        ..SamplerConfig::greedy()
    };
    let (biased, _, _) = run(&mut engine, banned, Vec::new());
    assert_ne!(biased[0], plain[0]);
    // A large positive bias makes a token the greedy choice.
    let favoured = engine.tokenizer.encode(" banana", false, false).unwrap()[0];
    let pushed = SamplerConfig {
        logit_bias: vec![(favoured, 100.0)],
        ..SamplerConfig::greedy()
    };
    assert_eq!(run(&mut engine, pushed, Vec::new()).0[0], favoured);

    // Stop at the first occurrence of the fourth token, which stays out of the output.
    let stop = plain[3];
    let at = plain.iter().position(|&t| t == stop).unwrap();
    let (tokens, text, finish) = run(&mut engine, SamplerConfig::greedy(), vec![stop]);
    assert_eq!(tokens, plain[..at]);
    assert_eq!(finish, FinishReason::Stop);
    assert_eq!(text, engine.tokenizer.decode(&plain[..at], true).unwrap());

    let (mut request, _rx) = request(prompt.clone(), SamplerConfig::greedy(), None);
    request.stop_token_ids = vec![u32::MAX];
    assert!(matches!(
        engine.handle.submit(request),
        Err(SubmitError::OutOfVocabulary {
            field: "stop_token_ids",
            ..
        })
    ));
}

#[test]
fn generate_follows_a_schema_and_ends_when_it_is_complete() {
    let mut s = session();
    let prompt = chat(&s, "Describe a person as JSON.");
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    for seed in 0..3 {
        let mut kv = s.model.new_kv_cache(1024);
        let mut sampler = Sampler::new(warm(seed));
        let options = GenerateOptions {
            max_tokens: 100,
            constraint: Some(ConstraintSpec::JsonSchema {
                schema: schema.clone(),
                strict: true,
            }),
            ..Default::default()
        };
        let g = generate(&mut s, &mut kv, &prompt, &mut sampler, &options, |_| {}).unwrap();
        s.pages.free(&mut kv);
        assert!(
            matches!(
                g.stop_reason,
                StopReason::ConstraintComplete | StopReason::EndOfGeneration
            ),
            "{:?}",
            g.stop_reason
        );
        let value: Value = serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{:?}: {e}", g.text));
        assert!(value["name"].as_str().unwrap().chars().count() <= 20);
        assert!(value["age"].is_i64() || value["age"].is_u64());
    }
}

#[test]
fn tool_calls_name_a_tool_and_follow_its_parameters() {
    let weather = json!({
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/city"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": false,
        "$defs": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    });
    let tools = [
        ToolSchema {
            name: "get_weather",
            parameters: Some(&weather),
        },
        ToolSchema {
            name: "get_time",
            parameters: None,
        },
    ];
    let s = session();
    let prompt = chat(&s, "What is the weather in Paris for the next three days?");
    let mut engine = engine(s);
    let specs = [
        any_tool_call(&tools).unwrap(),
        any_tool_call(&tools).unwrap(),
        named_tool_call(&tools, "get_time").unwrap(),
    ];
    let receivers = specs
        .iter()
        .enumerate()
        .map(|(seed, spec)| {
            let (request, rx) = request(prompt.clone(), warm(seed as u64), Some(spec.clone()));
            engine.handle.submit(request).unwrap();
            rx
        })
        .collect();
    let outputs = finish(&mut engine, receivers);
    for (i, (_, text, finish)) in outputs.iter().enumerate() {
        assert_eq!(*finish, FinishReason::Stop, "{text:?}");
        let call: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let arguments = call["arguments"].as_object().unwrap();
        match call["name"].as_str().unwrap() {
            "get_weather" => {
                assert!(
                    ["Paris", "Oslo"].contains(&arguments["city"].as_str().unwrap()),
                    "{text}"
                );
                assert!(arguments["days"].is_i64() || arguments["days"].is_u64(), "{text}");
            }
            "get_time" => assert!(arguments.is_empty(), "{text}"),
            other => panic!("no tool {other}"),
        }
        if i == 2 {
            assert_eq!(call["name"], "get_time");
        }
    }
}
