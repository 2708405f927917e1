//! Token sampling: a constraint's mask and the logit bias, then greedy, or penalties → top-k →
//! top-p → min-p → temperature → a seeded draw (llama.cpp's default chain order).
//!
//! The draw for the token at sequence position `p` is word `p` of the ChaCha20 keystream keyed by
//! the seed, so it depends on the seed and the position only: never on earlier draws, batching,
//! preemption or which backend computed the logits.

use super::constraint::TokenMask;
use crate::backend::cpu::kernels::argmax::argmax;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::collections::HashMap;
use std::ops::RangeInclusive;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 samples greedily.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    /// 1.0 keeps every token.
    pub top_p: f32,
    /// 0.0 keeps every token.
    pub min_p: f32,
    /// 1.0 disables; >1 divides positive logits (multiplies negative ones) of recent tokens.
    pub repeat_penalty: f32,
    /// Recent tokens the penalties look at.
    pub penalty_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to a token's logit before anything else; [`BANNED_BIAS`] bans the token.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

/// The logit bias that bans a token outright (OpenAI's convention), the bottom of the range.
pub const BANNED_BIAS: f32 = -100.0;

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            penalty_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

/// A sampler setting outside its range. Callers name the setting their own way (a CLI flag, an
/// API field) with [`SamplingError::describe`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.describe(self.field.name()))]
pub struct SamplingError {
    pub field: SamplingField,
    pub value: f32,
    pub range: RangeInclusive<f32>,
}

/// The [`SamplerConfig`] fields with a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplingField {
    Temperature,
    TopP,
    MinP,
    RepeatPenalty,
    PresencePenalty,
    FrequencyPenalty,
    LogitBias,
}

impl SamplingField {
    /// The field's name in [`SamplerConfig`].
    pub fn name(self) -> &'static str {
        match self {
            SamplingField::Temperature => "temperature",
            SamplingField::TopP => "top_p",
            SamplingField::MinP => "min_p",
            SamplingField::RepeatPenalty => "repeat_penalty",
            SamplingField::PresencePenalty => "presence_penalty",
            SamplingField::FrequencyPenalty => "frequency_penalty",
            SamplingField::LogitBias => "logit_bias",
        }
    }
}

impl SamplingError {
    /// The message, with the setting called `name`.
    pub fn describe(&self, name: &str) -> String {
        format!(
            "{name} must be between {} and {}, got {}",
            self.range.start(),
            self.range.end(),
            self.value
        )
    }
}

impl SamplerConfig {
    /// Checks every setting against its range (OpenAI's where it has one); NaN is in none.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let fields = [
            (SamplingField::Temperature, self.temperature, 0.0..=2.0),
            (SamplingField::TopP, self.top_p, 0.0..=1.0),
            (SamplingField::MinP, self.min_p, 0.0..=1.0),
            (SamplingField::RepeatPenalty, self.repeat_penalty, 0.01..=10.0),
            (SamplingField::PresencePenalty, self.presence_penalty, -2.0..=2.0),
            (SamplingField::FrequencyPenalty, self.frequency_penalty, -2.0..=2.0),
        ];
        let biases = self
            .logit_bias
            .iter()
            .map(|&(_, bias)| (SamplingField::LogitBias, bias, BANNED_BIAS..=-BANNED_BIAS));
        match fields
            .into_iter()
            .chain(biases)
            .find(|(_, value, range)| !range.contains(value))
        {
            Some((field, value, range)) => Err(SamplingError { field, value, range }),
            None => Ok(()),
        }
    }

    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        }
    }

    /// Whether sampling is the plain argmax of the logits (no bias or penalties to apply first).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0
            && self.logit_bias.is_empty()
            && self.repeat_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }
}

pub struct Sampler {
    config: SamplerConfig,
    /// Keyed by the seed; positioned afresh for every draw.
    rng: ChaCha20Rng,
    /// Candidates (token, logit), reused between calls.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Sampler {
        let rng = ChaCha20Rng::seed_from_u64(config.seed);
        Sampler {
            config,
            rng,
            candidates: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Picks the token for sequence position `position` from `logits`, given the tokens so far
    /// (for the penalties), among those `allowed` lets through; `None` when the mask and the bias
    /// leave no token.
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &[u32],
        allowed: Option<&TokenMask>,
        position: usize,
    ) -> Option<u32> {
        let c = &self.config;
        let mut logits = std::borrow::Cow::Borrowed(logits);
        if let Some(mask) = allowed {
            mask.apply(logits.to_mut());
        }
        if !c.logit_bias.is_empty() {
            apply_bias(logits.to_mut(), &c.logit_bias);
        }
        if c.repeat_penalty != 1.0 || c.presence_penalty != 0.0 || c.frequency_penalty != 0.0 {
            apply_penalties(
                logits.to_mut(),
                &history[history.len().saturating_sub(c.penalty_last_n)..],
                c,
            );
        }
        if (allowed.is_some() || !c.logit_bias.is_empty()) && !logits.iter().any(|l| l.is_finite()) {
            return None;
        }
        if c.temperature <= 0.0 {
            return Some(argmax(&logits));
        }
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .filter(|c| c.1 > f32::NEG_INFINITY),
        );
        let cands = &mut self.candidates;
        // Sorted by descending logit (ties: lower id first, so results do not depend on the sort).
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cands.len() {
            cands.select_nth_unstable_by(c.top_k - 1, by_logit);
            cands.truncate(c.top_k);
        }
        cands.sort_unstable_by(by_logit);
        top_p(cands, c.top_p);
        min_p(cands, c.min_p);
        let probs = softmax_with_temperature(cands, c.temperature);
        let r = draw(&mut self.rng, position);
        let mut acc = 0.0;
        for (&(id, _), p) in cands.iter().zip(&probs) {
            acc += p;
            if r < acc {
                return Some(id);
            }
        }
        cands.last().map(|c| c.0)
    }
}

/// The uniform draw in [0, 1) for `position`: word `position` of `rng`'s keystream.
fn draw(rng: &mut ChaCha20Rng, position: usize) -> f32 {
    rng.set_word_pos(position as u128);
    rng.random()
}

fn apply_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(token, b) in bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l = if b <= BANNED_BIAS { f32::NEG_INFINITY } else { *l + b };
        }
    }
}

fn apply_penalties(logits: &mut [f32], recent: &[u32], c: &SamplerConfig) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in recent {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &n) in &counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        *l = if *l > 0.0 {
            *l / c.repeat_penalty
        } else {
            *l * c.repeat_penalty
        };
        *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
    }
}

/// Keeps the smallest prefix (of tokens sorted by logit) whose probability reaches `p`.
fn top_p(cands: &mut Vec<(u32, f32)>, p: f32) {
    if p >= 1.0 || cands.is_empty() {
        return;
    }
    let probs = softmax_with_temperature(cands, 1.0);
    let mut acc = 0.0;
    let keep = probs.iter().position(|&q| {
        acc += q;
        acc >= p
    });
    cands.truncate(keep.map_or(cands.len(), |i| i + 1));
}

/// Drops tokens whose probability is below `p` times the most likely token's.
fn min_p(cands: &mut Vec<(u32, f32)>, p: f32) {
    if p <= 0.0 || cands.is_empty() {
        return;
    }
    // p_i / p_max = exp(l_i - l_max); sorted input, so the first logit is the max.
    let threshold = cands[0].1 + p.ln();
    let keep = cands.iter().take_while(|c| c.1 >= threshold).count().max(1);
    cands.truncate(keep);
}

fn softmax_with_temperature(cands: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = cands.iter().map(|c| ((c.1 - max) / temperature).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_names_the_field_out_of_range() {
        assert_eq!(SamplerConfig::default().validate(), Ok(()));
        let with = |change: fn(&mut SamplerConfig)| {
            let mut config = SamplerConfig::default();
            change(&mut config);
            config.validate().map_err(|e| e.field)
        };
        assert_eq!(with(|c| c.temperature = -1.0), Err(SamplingField::Temperature));
        assert_eq!(with(|c| c.temperature = f32::NAN), Err(SamplingField::Temperature));
        assert_eq!(with(|c| c.temperature = 2.0), Ok(()));
        assert_eq!(with(|c| c.top_p = 2.0), Err(SamplingField::TopP));
        assert_eq!(with(|c| c.min_p = 5.0), Err(SamplingField::MinP));
        assert_eq!(with(|c| c.repeat_penalty = 0.0), Err(SamplingField::RepeatPenalty));
        assert_eq!(
            with(|c| c.presence_penalty = f32::INFINITY),
            Err(SamplingField::PresencePenalty)
        );
        assert_eq!(
            with(|c| c.frequency_penalty = -2.5),
            Err(SamplingField::FrequencyPenalty)
        );

        let e = SamplerConfig {
            top_p: 2.0,
            ..SamplerConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.to_string(), "top_p must be between 0 and 1, got 2");
        assert_eq!(e.describe("--top-p"), "--top-p must be between 0 and 1, got 2");
    }

    fn logits() -> Vec<f32> {
        // Token i has logit i/10: a clear order with a long tail.
        (0..100).map(|i| i as f32 / 10.0).collect()
    }

    /// The tokens for positions `0..n`.
    fn draws(config: SamplerConfig, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(config);
        (0..n).map(|p| s.sample(&logits(), &[], None, p).unwrap()).collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        assert_eq!(draws(SamplerConfig::greedy(), 3), vec![99, 99, 99]);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let config = SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let a = draws(config.clone(), 50);
        assert_eq!(a, draws(config.clone(), 50));
        assert_ne!(a, draws(SamplerConfig { seed: 8, ..config }, 50));
    }

    #[test]
    fn a_draw_depends_on_its_position_only() {
        let config = SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 11,
            ..Default::default()
        };
        let all = draws(config.clone(), 64);
        // A sampler resumed at each position, or walking the positions backwards, draws the same.
        for (p, &token) in all.iter().enumerate() {
            assert_eq!(
                Sampler::new(config.clone()).sample(&logits(), &[], None, p),
                Some(token)
            );
        }
        let mut backwards = Sampler::new(config);
        let reversed: Vec<u32> = (0..64)
            .rev()
            .map(|p| backwards.sample(&logits(), &[], None, p).unwrap())
            .collect();
        assert!(all.iter().eq(reversed.iter().rev()));
        // And the positions do draw differently.
        assert!(all.iter().any(|&t| t != all[0]), "{all:?}");
    }

    #[test]
    fn top_k_limits_the_candidates() {
        let config = SamplerConfig {
            temperature: 5.0,
            top_k: 3,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
            ..Default::default()
        };
        let d = draws(config, 300);
        assert!(d.iter().all(|&t| t >= 97), "{d:?}");
        assert!([97, 98, 99].iter().all(|t| d.contains(t)));
    }

    #[test]
    fn top_p_keeps_the_smallest_sufficient_prefix() {
        let mut cands = vec![(0, 2.0f32.ln()), (1, 1.0f32.ln()), (2, 1.0f32.ln())]; // probs .5 .25 .25
        top_p(&mut cands, 0.5);
        assert_eq!(cands.len(), 1);
        let mut cands = vec![(0, 2.0f32.ln()), (1, 1.0f32.ln()), (2, 1.0f32.ln())];
        top_p(&mut cands, 0.7);
        assert_eq!(cands.len(), 2);
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        let mut cands = vec![(0, 0.0), (1, -0.5), (2, -3.0)]; // relative probs 1, .61, .05
        min_p(&mut cands, 0.1);
        assert_eq!(cands.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn repetition_penalties_push_seen_tokens_down() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplerConfig::greedy()
        };
        let mut l = vec![4.0, -1.0, 4.0];
        apply_penalties(&mut l, &[0, 0, 1], &c);
        assert_eq!(l, vec![4.0 / 2.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 4.0]);
        // Greedy with a penalty switches away from the repeated token.
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 1.5,
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&[3.0, 2.5], &[0], None, 1), Some(1));
    }

    #[test]
    fn logit_bias_shifts_and_bans() {
        let bias = |logit_bias: Vec<(u32, f32)>, temperature: f32| SamplerConfig {
            logit_bias,
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        assert!(!bias(vec![(3, 1.0)], 0.0).is_plain_greedy());
        assert_eq!(draws(bias(vec![(3, 20.0)], 0.0), 1), vec![3]);
        assert_eq!(draws(bias(vec![(99, BANNED_BIAS)], 0.0), 1), vec![98]);
        let banned: Vec<(u32, f32)> = (90..100).map(|t| (t, BANNED_BIAS)).collect();
        assert!(draws(bias(banned, 5.0), 200).iter().all(|&t| t < 90));
        let everything: Vec<(u32, f32)> = (0..100).map(|t| (t, BANNED_BIAS)).collect();
        assert_eq!(
            Sampler::new(bias(everything, 1.0)).sample(&logits(), &[], None, 0),
            None
        );
        let e = bias(vec![(1, 150.0)], 1.0).validate().unwrap_err();
        assert_eq!(e.to_string(), "logit_bias must be between -100 and 100, got 150");
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let base = SamplerConfig {
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 3,
            ..Default::default()
        };
        let cold = draws(
            SamplerConfig {
                temperature: 0.01,
                ..base.clone()
            },
            100,
        );
        assert!(cold.iter().all(|&t| t == 99));
        let hot = draws(
            SamplerConfig {
                temperature: 10.0,
                ..base
            },
            100,
        );
        assert!(hot.iter().filter(|&&t| t < 90).count() > 30);
    }
}
