//! `/metrics`: Prometheus counters, gauges and latency histograms, fed by the scheduler.

use axiom::engine::scheduler::{Completion, EngineStatus, Metrics};
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

pub struct ServerMetrics {
    registry: Registry,
    requests: IntCounterVec,
    prompt_tokens: IntCounter,
    generated_tokens: IntCounter,
    cached_prompt_tokens: IntCounter,
    preemptions: IntCounter,
    queued: IntGauge,
    running: IntGauge,
    pages_used: IntGauge,
    pages_free: IntGauge,
    pages_cached: IntGauge,
    ttft: Histogram,
    itl: Histogram,
    step_tokens: Histogram,
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::new(name, help)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> prometheus::Result<Histogram> {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

impl ServerMetrics {
    /// Registers every metric; fails only on an invalid or repeated metric name.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new_custom(Some("axiom".into()), None)?;
        let requests = IntCounterVec::new(
            Opts::new("requests_total", "Requests finished, by outcome"),
            &["outcome"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        let latency = vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        Ok(ServerMetrics {
            requests,
            prompt_tokens: counter(&registry, "prompt_tokens_total", "Prompt tokens of finished requests")?,
            generated_tokens: counter(&registry, "generated_tokens_total", "Tokens generated")?,
            cached_prompt_tokens: counter(
                &registry,
                "prompt_tokens_cached_total",
                "Prompt tokens whose KV came from the prefix cache",
            )?,
            preemptions: counter(
                &registry,
                "preemptions_total",
                "Sequences preempted for lack of KV pages",
            )?,
            queued: gauge(&registry, "queue_depth", "Requests waiting for admission")?,
            running: gauge(&registry, "running_sequences", "Sequences in the running batch")?,
            pages_used: gauge(&registry, "kv_pages_used", "KV cache pages held by sequences")?,
            pages_free: gauge(&registry, "kv_pages_free", "KV cache pages not held (free or cached)")?,
            pages_cached: gauge(
                &registry,
                "kv_pages_cached",
                "Free KV pages still holding a reusable prefix",
            )?,
            ttft: histogram(
                &registry,
                "time_to_first_token_seconds",
                "From arrival to the first token",
                latency.clone(),
            )?,
            itl: histogram(
                &registry,
                "inter_token_latency_seconds",
                "Between consecutive tokens",
                latency,
            )?,
            step_tokens: histogram(
                &registry,
                "step_tokens",
                "Tokens a forward step runs: the decoding sequences' next tokens and prompt chunks",
                vec![1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0],
            )?,
            registry,
        })
    }

    pub fn count_request(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }

    /// The Prometheus text exposition, gauges as of `status`.
    pub fn render(&self, status: EngineStatus) -> String {
        self.queued.set(status.queued as i64);
        self.running.set(status.running as i64);
        self.pages_used.set(status.pages.used as i64);
        self.pages_free.set(status.pages.free() as i64);
        self.pages_cached.set(status.pages.cached as i64);
        let mut out = Vec::new();
        // Encoding our own registry into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

impl Metrics for ServerMetrics {
    fn request_finished(&self, c: &Completion) {
        self.count_request(c.finish.as_str());
        self.prompt_tokens.inc_by(c.prompt_tokens as u64);
        self.cached_prompt_tokens.inc_by(c.cached_tokens as u64);
    }
    fn request_cancelled(&self) {
        self.count_request("cancelled");
    }
    fn time_to_first_token(&self, seconds: f64) {
        self.generated_tokens.inc();
        self.ttft.observe(seconds);
    }
    fn inter_token_latency(&self, seconds: f64) {
        self.generated_tokens.inc();
        self.itl.observe(seconds);
    }
    fn preempted(&self) {
        self.preemptions.inc();
    }
    fn step_planned(&self, decode_tokens: usize, prompt_tokens: usize) {
        self.step_tokens.observe((decode_tokens + prompt_tokens) as f64);
    }
}
