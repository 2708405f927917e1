//! The `axiom` binary as a user runs it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn model() -> PathBuf {
    axiom::source::default_model().expect("the default model can be fetched")
}

fn refs(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../axiom/tests/refs/smollm2")
        .join(file)
}

fn axiom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args(args)
        .output()
        .expect("axiom runs")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "axiom failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn run_chat_json_gives_transformers_prompt_ids_and_first_token() {
    let m = model();
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(refs("hf_greedy.json")).unwrap()).unwrap();
    for case in refs["cases"].as_array().unwrap().iter().filter(|c| c["kind"] == "chat") {
        let text = case["text"].as_str().unwrap();
        let out = ok(&axiom(&[
            "run",
            "-m",
            m.to_str().unwrap(),
            "--chat",
            "--json",
            "--temp",
            "0",
            "-n",
            "4",
            text,
        ]));
        let json: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(ids(&json["prompt_tokens"]), ids(&case["ids"]));
        assert_eq!(json["tokens"][0], case["greedy64_ids"][0]);
        assert!(json["timings"]["generation_tokens_per_second"].as_f64().unwrap() > 0.0);
        assert!(case["greedy64_text"]
            .as_str()
            .unwrap()
            .starts_with(json["text"].as_str().unwrap()));
    }
}

#[test]
fn run_streams_text_to_stdout() {
    let m = model();
    let out = ok(&axiom(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "--temp",
        "0",
        "-n",
        "2",
        "-q",
        "The capital of France is",
    ]));
    assert_eq!(out, " Paris.\n");
}

#[test]
fn deterministic_is_accepted_on_the_cpu_and_changes_nothing() {
    // The CPU backend takes one path for every step already: the flag leaves its answers as
    // they are, greedy and seeded.
    let m = model();
    for sampling in [&["--temp", "0"][..], &["--temp", "0.8", "--seed", "7"]] {
        let answer = |extra: &[&str]| {
            let mut args = vec!["run", "-m", m.to_str().unwrap(), "--backend", "cpu", "-n", "12", "-q"];
            args.extend_from_slice(sampling);
            args.extend_from_slice(extra);
            args.push("The capital of France is");
            ok(&axiom(&args))
        };
        assert_eq!(answer(&["--deterministic"]), answer(&[]), "{sampling:?}");
    }
}

#[test]
fn tokenize_prints_ids() {
    let m = model();
    let out = ok(&axiom(&["tokenize", "-m", m.to_str().unwrap(), "Hello, world!"]));
    assert_eq!(out.trim(), "[19556,28,905,17]");
    let out = ok(&axiom(&[
        "tokenize",
        "-m",
        m.to_str().unwrap(),
        "--special",
        "<|im_start|>",
    ]));
    assert_eq!(out.trim(), "[1]");
}

#[test]
fn tokenize_reads_a_hugging_face_directory() {
    // The qwen2 fixture's first text and the ids transformers gave it (no BOS for Qwen2).
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../axiom/tests/fixtures/hf/qwen2");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap()).unwrap();
    let text = refs["texts"][0].as_str().unwrap();
    let out = ok(&axiom(&["tokenize", "-m", dir.to_str().unwrap(), text]));
    let got: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(ids(&got), ids(&refs["ids"][0]));
}

#[test]
fn info_describes_the_model() {
    let out = ok(&axiom(&["info", model().to_str().unwrap()]));
    for needle in [
        "architecture:  llama",
        "layers:        30",
        "9 query, 3 key/value",
        "Q4_1 x210",
        "Q8_0 x1",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn info_names_the_rope_scaling_the_experts_and_the_quantization() {
    let fixture = |name: &str| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../axiom/tests/fixtures/hf")
            .join(name)
    };
    let cases: [(&str, &[&str]); 6] = [
        (
            "qwen3_fp8",
            &[
                "quantization:  FP8 E4M3 weights, a scale per 128x128 block (fp8)",
                "FP8_E4M3 x14",
            ],
        ),
        (
            "llama_fp8_channel",
            &["quantization:  FP8 E4M3 weights, a scale per output channel (compressed-tensors)"],
        ),
        (
            "qwen3_moe",
            &[
                "architecture:  qwen3_moe",
                "experts:       2 of 6 a token (FFN 48 each), weights renormalized, on 2 of 3 layers",
            ],
        ),
        (
            "qwen2_moe",
            &["not renormalized, on 2 of 2 layers, a gated shared expert of FFN 96"],
        ),
        (
            "qwen2_yarn",
            &["16 dims rotated", "YaRN x4 beyond 64 tokens", "attention factor 1.13"],
        ),
        (
            "phi4_mini",
            &[
                "architecture:  phi3",
                "12 dims rotated",
                "LongRoPE",
                "attention factor 1.15",
            ],
        ),
    ];
    for (name, needles) in cases {
        let out = ok(&axiom(&["info", fixture(name).to_str().unwrap()]));
        for needle in needles {
            assert!(out.contains(needle), "missing {needle:?} in\n{out}");
        }
    }
}

#[test]
fn convert_type_fp8_writes_a_directory_that_runs() {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../axiom/tests/fixtures/hf/qwen3_fp8_source");
    let out_dir = std::env::temp_dir().join(format!("axiom-cli-fp8-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = axiom(&[
        "convert",
        source.to_str().unwrap(),
        "-o",
        out_dir.to_str().unwrap(),
        "--type",
        "fp8",
    ]);
    ok(&out);
    let summary = String::from_utf8_lossy(&out.stderr);
    // Every layer matrix of the two layers; the tied embedding as stored.
    assert!(summary.contains("14 matrices FP8_E4M3"), "{summary}");
    assert!(summary.contains("1 matrices BF16"), "{summary}");
    let run = ok(&axiom(&[
        "run",
        "-m",
        out_dir.to_str().unwrap(),
        "-n",
        "2",
        "--temp",
        "0",
        "--json",
        "The license",
    ]));
    let json: Value = serde_json::from_str(run.lines().last().unwrap()).unwrap();
    assert_eq!(json["tokens"].as_array().unwrap().len(), 2, "{run}");
    std::fs::remove_dir_all(&out_dir).unwrap();

    // The Llama fixture (width 64) is no whole 128x128 block; the refusal names the block sizes
    // that fit, and the smaller one converts every matrix.
    let llama = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../axiom/tests/fixtures/hf/llama");
    let convert = |extra: &[&str]| {
        let args = [
            &["convert", llama.to_str().unwrap(), "-o", out_dir.to_str().unwrap()][..],
            extra,
        ]
        .concat();
        axiom(&args)
    };
    let refusals: [(&[&str], &str); 3] = [
        (
            &["--type", "fp8"],
            "no layer matrix is whole 128x128 blocks, so none converts to FP8; --fp8-block 64 or 32 fits",
        ),
        (
            &["--type", "fp8", "--fp8-block", "96"],
            "FP8 block size 96 is not supported (a power of two, 32 or more)",
        ),
        (
            &["--type", "q8_0", "--fp8-block", "32"],
            "--fp8-block applies to --type fp8 only",
        ),
    ];
    for (args, needle) in refusals {
        let out = convert(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{args:?}: {err}");
        assert!(!out_dir.exists(), "{args:?} wrote {}", out_dir.display());
    }
    let out = convert(&["--type", "fp8", "--fp8-block", "32"]);
    ok(&out);
    let summary = String::from_utf8_lossy(&out.stderr);
    // Every layer matrix of the two layers; the embedding and the LM head as stored.
    assert!(
        summary.contains("14 matrices FP8_E4M3") && summary.contains("2 matrices F32"),
        "{summary}"
    );
    let info = ok(&axiom(&["info", out_dir.to_str().unwrap()]));
    assert!(info.contains("a scale per 32x32 block (fp8)"), "{info}");
    std::fs::remove_dir_all(out_dir).unwrap();
}

#[test]
fn bench_counts_a_mixtures_chosen_experts_per_token() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../axiom/tests/fixtures/hf/qwen3_moe");
    let out = ok(&axiom(&[
        "bench",
        "-m",
        fixture.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
        "-t",
        "1",
    ]));
    // Every matrix but the embedding (the LM head is its own) and a third of the experts.
    assert!(out.contains("(0.8 MB per token, 2 of 6 experts a token)"), "{out}");
}

#[test]
fn perplexity_cli_reports_the_llama_cpp_method_value() {
    let m = model();
    let file = refs("apache-2.0.txt");
    let out = ok(&axiom(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-f",
        file.to_str().unwrap(),
        "-c",
        "128",
        "--json",
    ]));
    let json: Value = serde_json::from_str(out.trim()).unwrap();
    let ppl = json["result"]["perplexity"].as_f64().unwrap();
    // transformers fp32 at n_ctx 128: 16.4926.
    assert!((ppl / 16.4926 - 1.0).abs() < 0.01, "{ppl}");
    assert_eq!(json["tokens"], 2215);
}

#[test]
fn tensor_parallel_ranks_on_the_cpu_generate_what_one_rank_does() {
    let model = model();
    let run = |ranks: &str| -> Value {
        let args = [
            "run",
            "--backend",
            "cpu",
            "-m",
            model.to_str().unwrap(),
            "--temp",
            "0",
            "-n",
            "12",
            "--json",
        ];
        serde_json::from_str(&ok(&axiom(
            &[&args[..], &["--tp", ranks, "The capital of France is"]].concat(),
        )))
        .unwrap()
    };
    let (one, three) = (run("1"), run("3"));
    assert_eq!(one["text"], three["text"]);
    assert_eq!(ids(&three["tokens"]).len(), 12);
}

/// A port on the loopback no one listens at now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn tensor_parallel_processes_on_the_cpu_generate_what_one_process_does() {
    let model = model();
    let args = |extra: &[&str]| -> Vec<String> {
        let run = [
            "run",
            "--backend",
            "cpu",
            "-t",
            "1",
            "--temp",
            "0",
            "-n",
            "12",
            "--json",
            "-m",
        ];
        let prompt = "The capital of France is";
        let mut args: Vec<String> = run.iter().map(|a| a.to_string()).collect();
        args.push(model.to_str().unwrap().into());
        args.extend(extra.iter().map(|a| a.to_string()));
        args.push(prompt.into());
        args
    };
    let one: Value =
        serde_json::from_str(&ok(&axiom(&args(&[]).iter().map(String::as_str).collect::<Vec<_>>()))).unwrap();
    // SmolLM2's 9 heads over 3 processes, the followers started first: they wait for rank 0.
    let address = format!("127.0.0.1:{}", free_port());
    let rank = |r: usize| {
        let group = ["--tp-size", "3", "--tp-rank", &r.to_string(), "--tp-addr", &address].map(String::from);
        Command::new(env!("CARGO_BIN_EXE_axiom"))
            .args(args(&group.iter().map(String::as_str).collect::<Vec<_>>()))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let followers = [rank(2), rank(1)];
    let first = rank(0).wait_with_output().unwrap();
    let three: Value = serde_json::from_str(&ok(&first)).unwrap();
    assert_eq!(ids(&three["tokens"]), ids(&one["tokens"]));
    assert_eq!(three["text"], one["text"]);
    for follower in followers {
        // Only rank 0 prints.
        assert!(ok(&follower.wait_with_output().unwrap()).is_empty());
    }
}

/// The JSON body of `POST path` with `body` to the server on `port`, once it answers (within a
/// minute of starting: it loads the model first). HTTP/1.0, so the reply is not chunked.
fn post_when_up(port: u16, path: &str, body: &str) -> Value {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut stream = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(e) if std::time::Instant::now() > deadline => panic!("no server on port {port}: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(200)),
        }
    };
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert_eq!(head.split(' ').nth(1), Some("200"), "{head}\n{body}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[test]
fn a_server_split_over_processes_answers_as_one_process_does() {
    let model = model();
    let serve = |port: u16, group: &[&str]| {
        let port = port.to_string();
        let args = [
            "serve",
            "--backend",
            "cpu",
            "-t",
            "1",
            "--port",
            &port,
            "-m",
            model.to_str().unwrap(),
        ];
        Command::new(env!("CARGO_BIN_EXE_axiom"))
            .args(args.iter().chain(group))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let body = r#"{"model": "m", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}"#;
    let port = free_port();
    let mut alone = serve(port, &[]);
    let want = post_when_up(port, "/v1/completions", body);
    alone.kill().unwrap();
    alone.wait().unwrap();
    // SmolLM2's 9 heads over 3 processes; only rank 0 listens for requests.
    let (port, address) = (free_port(), format!("127.0.0.1:{}", free_port()));
    let rank = |r: &str| serve(port, &["--tp-size", "3", "--tp-rank", r, "--tp-addr", &address]);
    let mut followers = [rank("2"), rank("1")];
    let mut leader = rank("0");
    let got = post_when_up(port, "/v1/completions", body);
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(got["usage"], want["usage"]);
    // Rank 0 gone, the others stop rather than wait for it forever.
    leader.kill().unwrap();
    leader.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for follower in &mut followers {
        while follower.try_wait().unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "a rank outlived rank 0 by 30 s");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

#[test]
fn bad_inputs_fail_with_a_message() {
    let dir = std::env::temp_dir().join(format!("axiom-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bogus = dir.join("bogus.gguf");
    std::fs::write(&bogus, b"not a model at all").unwrap();
    let model = model();
    let cases: [(&[&str], &str); 17] = [
        (&["info", bogus.to_str().unwrap()], "not a GGUF file"),
        (&["run", "-m", "/nonexistent.gguf", "hi"], "does not exist"),
        // A name that is no file nor packaged model: the error lists what -m takes.
        (
            &["run", "-m", "gemma3", "hi"],
            "packaged model: smollm2-135m, gemma3-270m",
        ),
        (
            &["run", "-m", "hf:org/repo:Q4-K", "hi"],
            "is not hf:ORG/REPO[@REVISION][:QUANT]",
        ),
        (&["run", "-m", bogus.to_str().unwrap(), "hi"], "not a GGUF file"),
        (
            &["run", "--backend", "metal", "-m", bogus.to_str().unwrap(), "hi"],
            "Metal",
        ),
        // A KV cache bigger than the machine: refused before anything is allocated.
        (
            &[
                "serve",
                "--backend",
                "cpu",
                "-m",
                model.to_str().unwrap(),
                "--kv-memory",
                "4096GiB",
            ],
            "of memory is available",
        ),
        (
            &[
                "serve",
                "--backend",
                "cpu",
                "-m",
                model.to_str().unwrap(),
                "--max-seqs",
                "16",
                "--decode-batch-tokens",
                "16",
            ],
            "--decode-batch-tokens 16 leaves no room for a prompt beside 16 decoding streams",
        ),
        (
            &[
                "serve",
                "--backend",
                "cpu",
                "-m",
                model.to_str().unwrap(),
                "--max-batch-tokens",
                "0",
            ],
            "--max-batch-tokens must be at least 1",
        ),
        // Groups of processes that make no sense, refused before the model is read.
        (
            &[
                "run",
                "--tp",
                "2",
                "--tp-size",
                "2",
                "--tp-rank",
                "0",
                "--tp-addr",
                "127.0.0.1:1",
                "-m",
                "/nonexistent.gguf",
                "hi",
            ],
            "--tp-size over processes: give one of them",
        ),
        (
            &[
                "run",
                "--tp-size",
                "2",
                "--tp-rank",
                "2",
                "--tp-addr",
                "127.0.0.1:1",
                "-m",
                "/nonexistent.gguf",
                "hi",
            ],
            "--tp-rank 2 is not below --tp-size 2",
        ),
        (
            &[
                "run",
                "--tp-size",
                "2",
                "--tp-rank",
                "1",
                "-m",
                "/nonexistent.gguf",
                "hi",
            ],
            "--tp-size needs --tp-addr HOST:PORT",
        ),
        (
            &[
                "run",
                "--tp-size",
                "2",
                "--tp-addr",
                "127.0.0.1:1",
                "-m",
                "/nonexistent.gguf",
                "hi",
            ],
            "--tp-size needs --tp-rank",
        ),
        (
            &["run", "--tp-rank", "1", "-m", "/nonexistent.gguf", "hi"],
            "--tp-rank and --tp-addr go with --tp-size",
        ),
        (&["run", "--tp", "0", "hi"], "--tensor-parallel must be at least 1"),
        // The profiler's bracket is CUDA's: another backend says so rather than run unprofiled.
        (
            &[
                "bench",
                "--backend",
                "cpu",
                "-m",
                model.to_str().unwrap(),
                "-p",
                "4",
                "-n",
                "0",
                "-r",
                "1",
                "--profile",
            ],
            "has no profiler to start (--profile is for CUDA)",
        ),
        // SmolLM2's 9 heads split over 3 ranks, not 2.
        (
            &[
                "run",
                "--backend",
                "cpu",
                "--tp",
                "2",
                "-m",
                model.to_str().unwrap(),
                "hi",
            ],
            "the model's 9 attention heads do not divide evenly",
        ),
    ];
    for (args, needle) in cases {
        let out = axiom(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error:") && err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bench_prints_a_llama_bench_style_table_and_json() {
    let m = model();
    let m = m.to_str().unwrap();
    let out = ok(&axiom(&["bench", "-m", m, "-p", "16", "-n", "4", "-r", "1", "-t", "1"]));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "| model | size | params | backend | threads | test | t/s |");
    assert!(lines[1].starts_with("| --- |"));
    for (line, test) in lines[2..4].iter().zip(["pp16", "tg4"]) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        assert_eq!(cells[1], "llama 135M Q4_1", "{line}");
        assert_eq!(cells[2], "93.81 MiB");
        assert_eq!(cells[3], "134.52 M");
        assert!(cells[4].starts_with("CPU"));
        assert_eq!(cells[5], "1");
        assert_eq!(cells[6], test);
        let (mean, sd) = cells[7].split_once(" ± ").expect("mean ± stddev");
        assert!(mean.parse::<f64>().unwrap() > 0.0 && sd.parse::<f64>().unwrap() >= 0.0);
    }
    assert!(out.contains("tg4: ") && out.contains("GB/s of weights"), "{out}");

    let out = ok(&axiom(&["bench", "-m", m, "-p", "8", "-n", "2", "-r", "2", "--json"]));
    let objects: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(objects.len(), 2);
    assert_eq!(objects[0]["test"], "pp8");
    assert_eq!(objects[1]["test"], "tg2");
    assert_eq!(objects[1]["samples_ts"].as_array().unwrap().len(), 2);
    assert!(objects[1]["weight_bandwidth_gbps"].as_f64().unwrap() > 0.0);
    assert!(objects[0]["weight_bandwidth_gbps"].is_null());

    // After context: the tests are named as llama-bench names them, and each runs at each depth.
    let out = ok(&axiom(&[
        "bench", "-m", m, "-p", "8", "-n", "2", "-r", "1", "-d", "0,24", "--json",
    ]));
    let objects: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = objects.iter().map(|o| o["test"].as_str().unwrap()).collect();
    assert_eq!(names, ["pp8", "pp8 @ d24", "tg2", "tg2 @ d24"]);
    assert_eq!(objects[3]["n_depth"], 24);

    // Sequences decoding together: generation tests at each width, prompts alone.
    let out = ok(&axiom(&[
        "bench",
        "-m",
        m,
        "-p",
        "8",
        "-n",
        "3",
        "-r",
        "1",
        "-d",
        "0,16",
        "--parallel",
        "1,3",
        "--json",
    ]));
    let objects: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = objects.iter().map(|o| o["test"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["pp8", "pp8 @ d16", "tg3", "tg3 @ d16", "tg3 x3", "tg3 x3 @ d16"]
    );
    assert_eq!(objects[4]["n_parallel"], 3);
    assert!(objects[5]["avg_ts"].as_f64().unwrap() > 0.0);
    assert!(objects[4]["weight_bandwidth_gbps"].is_null());
}

#[test]
fn run_holds_its_output_to_a_schema_or_a_grammar_file() {
    let dir = std::env::temp_dir().join(format!("axiom-cli-constraint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("person.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer","maximum":120}},"required":["name","age"],"additionalProperties":false}"#,
    )
    .unwrap();
    let gbnf = dir.join("yes.gbnf");
    std::fs::write(&gbnf, "root ::= (\"yes\" | \"no\") \"!\"\n").unwrap();
    let lark = dir.join("yes.lark");
    std::fs::write(&lark, "start: (\"yes\" | \"no\") \"!\"\n").unwrap();
    let m = model();
    let m = m.to_str().unwrap();
    let run = |flag: &str, file: &PathBuf| -> Value {
        let out = axiom(&[
            "run",
            "-m",
            m,
            "--chat",
            "--json",
            "--seed",
            "1",
            "-n",
            "60",
            flag,
            file.to_str().unwrap(),
            "Describe a person.",
        ]);
        serde_json::from_str(&ok(&out)).unwrap()
    };
    let person = run("--json-schema", &schema);
    assert_eq!(person["stop_reason"], "constraint_complete", "{person}");
    let value: Value = serde_json::from_str(person["text"].as_str().unwrap()).unwrap();
    assert!(value["name"].is_string() && value["age"].is_u64(), "{value}");
    for file in [&gbnf, &lark] {
        let answer = run("--grammar", file);
        assert!(["yes!", "no!"].contains(&answer["text"].as_str().unwrap()), "{answer}");
    }
    // A GBNF grammar read as Lark (no .gbnf extension) is refused, naming what is wrong.
    let misnamed = dir.join("yes.txt");
    std::fs::write(&misnamed, "root ::= \"yes\"\n").unwrap();
    let out = axiom(&["run", "-m", m, "--grammar", misnamed.to_str().unwrap(), "hi"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("constraint:"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sampling_flags_out_of_range_are_refused_naming_the_flag() {
    // Refused before the model loads, so no model is named.
    for (flag, value, needle) in [
        ("--top-p", "2", "--top-p must be between 0 and 1, got 2"),
        ("--min-p", "5", "--min-p must be between 0 and 1"),
        ("--temp", "-1", "--temp must be between 0 and 2, got -1"),
        (
            "--logit-bias",
            "5=150",
            "--logit-bias must be between -100 and 100, got 150",
        ),
        (
            "--repeat-penalty",
            "NaN",
            "--repeat-penalty must be between 0.01 and 10",
        ),
    ] {
        let out = axiom(&["run", flag, value, "hi"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flag} {value}: {err}");
        assert!(err.contains(needle), "{flag} {value}: {err}");
    }
}

#[test]
fn an_unknown_tool_parser_is_refused_with_the_known_ones() {
    let out = axiom(&["serve", "--tool-parser", "pythonic"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(r#"unknown tool parser "pythonic"; known: hermes, llama3_json, mistral"#),
        "{err}"
    );
}

#[test]
fn huge_sizes_from_flags_are_clamped_or_refused() {
    const HUGE: &str = "18446744073709551615";
    let m = model();
    let m = m.to_str().unwrap();
    // A context beyond the model's is the model's: it runs.
    let out = ok(&axiom(&[
        "run",
        "-m",
        m,
        "-c",
        HUGE,
        "--temp",
        "0",
        "-n",
        "2",
        "-q",
        "The capital of France is",
    ]));
    assert_eq!(out, " Paris.\n");
    // Sizes that cannot be honoured are refused with a message, never a panic or an abort.
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let cases: [(&[&str], &str); 6] = [
        (
            &["perplexity", "-m", m, "-f", text, "-c", HUGE],
            "exceeds the model's context of 8192 tokens",
        ),
        (
            &["bench", "-m", m, "-p", HUGE],
            "exceeds the model's context of 8192 tokens",
        ),
        (
            &["bench", "-m", m, "-p", "8", "-d", "8190"],
            "a test of 128 tokens after 8190 of context exceeds the model's context of 8192 tokens",
        ),
        (&["bench", "-m", m, "-t", HUGE], "--threads must be between 1 and 1024"),
        (&["bench", "-m", m, "--parallel", "0"], "--parallel must be at least 1"),
        (
            &["serve", "--backend", "cpu", "-m", m, "--max-batch-tokens", HUGE],
            "more than the 4294967296 a model can be loaded with",
        ),
    ];
    for (args, needle) in cases {
        let out = axiom(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn a_closed_stdout_ends_commands_quietly() {
    let m = model();
    let m = m.to_str().unwrap();
    let commands: [&[&str]; 5] = [
        &["completions", "bash"],
        &["info", "--all", m],
        &["tokenize", "-m", m, "hello"],
        &["run", "-m", m, "--temp", "0", "-n", "4", "-q", "hello"],
        &["bench", "-m", m, "-p", "8", "-n", "2", "-r", "1", "-t", "1"],
    ];
    for args in commands {
        // The pipe's reader is gone before the command starts (as `| head -1` is after its line,
        // but without the race), so every write to stdout fails.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_axiom"))
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
    }
}
