//! Picks the next token from logits: greedy at temperature 0, otherwise temperature, top-k, top-p (nucleus) and
//! min-p sampling from a seeded generator, so a given seed always gives the same continuation. Also the edits a
//! request makes to its logits before that: presence, frequency and repetition penalties, and logit bias.

use std::collections::{HashMap, HashSet};

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::backend::cpu::argmax;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (None or 0: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
    pub top_p: f32,
    /// Keep only tokens at least this fraction as likely as the most likely one (0: all).
    pub min_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values no sampler can honour, naming the parameter.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Whether this sampler always takes the most likely token (temperature 0, or top-k 1): then
    /// [`crate::backend::Backend::argmax_rows`] makes its choice.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == Some(1)
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits) as u32;
        }
        let p = &self.params;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if let Some(k) = p.top_k.filter(|&k| k > 0) {
            order.truncate(k);
        }
        let max = logits[order[0]];
        let mut probs: Vec<f32> = order
            .iter()
            .map(|&i| ((logits[i] - max) / p.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        // Both filters keep a prefix of the sorted probabilities, each judged on the same distribution.
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|q| {
                    cumulative += q;
                    cumulative >= p.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let threshold = p.min_p * probs[0];
            let keep = probs.iter().position(|&q| q < threshold).unwrap_or(probs.len());
            probs.truncate(keep.max(1));
        }
        let total: f32 = probs.iter().sum();
        let mut draw = self.rng.random::<f32>() * total;
        for (i, q) in probs.iter().enumerate() {
            draw -= q;
            if draw <= 0.0 {
                return order[i] as u32;
            }
        }
        order[probs.len() - 1] as u32
    }
}

/// OpenAI's presence and frequency penalties: each token already generated loses `presence` once and
/// `frequency` per time it was generated.
pub fn apply_penalties(logits: &mut [f32], generated_counts: &HashMap<u32, u32>, presence: f32, frequency: f32) {
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    for (&token, &count) in generated_counts {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit -= presence + frequency * count as f32;
        }
    }
}

/// transformers' repetition penalty: every token of the prompt or the output so far has its logit divided by
/// `penalty` when positive and multiplied by it when negative, so a penalty above 1 always makes it less likely.
pub fn apply_repetition_penalty(logits: &mut [f32], seen: &HashSet<u32>, penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    for &token in seen {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit = if *logit > 0.0 {
                *logit / penalty
            } else {
                *logit * penalty
            };
        }
    }
}

/// Adds each `(token, bias)` to that token's logit (OpenAI's `logit_bias`; -100 all but bans a token).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(token, b) in bias {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit += b;
        }
    }
}

/// Bans (to -infinity) the last token of each of `bad_words` (token sequences) where `output` ends with the rest of
/// it, so no sequence is ever generated whole (vLLM's `bad_words`); a one-token sequence is banned everywhere.
pub fn ban_bad_words(logits: &mut [f32], bad_words: &[Vec<u32>], output: &[u32]) {
    for word in bad_words {
        if let Some((&last, rest)) = word.split_last() {
            if output.ends_with(rest) {
                if let Some(logit) = logits.get_mut(last as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_word_is_banned_only_where_the_output_ends_with_the_rest_of_it() {
        let words = [vec![3], vec![1, 2, 0]];
        let mut logits = [0.0; 4];
        ban_bad_words(&mut logits, &words, &[2, 1]);
        assert_eq!(
            logits,
            [0.0, 0.0, 0.0, f32::NEG_INFINITY],
            "one-token words everywhere; [1, 2] not yet"
        );
        let mut logits = [0.0; 4];
        ban_bad_words(&mut logits, &words, &[0, 1, 2]);
        assert_eq!(logits, [f32::NEG_INFINITY, 0.0, 0.0, f32::NEG_INFINITY]);
        let mut logits = [0.0; 4];
        ban_bad_words(&mut logits, &[vec![1, 2, 9]], &[1, 2]);
        assert_eq!(logits, [0.0; 4], "a token outside the vocabulary bans nothing");
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let mut logits = [2.0, -2.0, 2.0, 0.0];
        apply_repetition_penalty(&mut logits, &HashSet::from([0, 1, 3, 99]), 2.0);
        assert_eq!(
            logits,
            [1.0, -4.0, 2.0, 0.0],
            "token 2 unseen, 99 outside the vocabulary"
        );
    }

    #[test]
    fn logit_bias_moves_the_greedy_choice() {
        let mut logits = [1.0, 3.0, 2.0];
        apply_logit_bias(&mut logits, &[(1, -100.0), (0, 0.5)]);
        assert_eq!(logits, [1.5, -97.0, 2.0]);
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits), 2);
    }

    #[test]
    fn min_p_drops_tokens_less_likely_than_a_fraction_of_the_best() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: min_p 0.3 keeps tokens with p >= 0.19, i.e. 0 and 1.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.3,
            ..params(1.0, None, 1.0, 3)
        });
        let seen: HashSet<u32> = (0..400).map(|_| s.sample(&logits)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn penalties_lower_generated_tokens_by_presence_and_count() {
        let mut logits = [1.0, 1.0, 1.0];
        let counts = HashMap::from([(0, 3), (2, 1)]);
        apply_penalties(&mut logits, &counts, 0.5, 0.25);
        assert_eq!(logits, [1.0 - 0.5 - 0.75, 1.0, 1.0 - 0.5 - 0.25]);
    }

    fn params(temperature: f32, top_k: Option<usize>, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_limits_choice() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, Some(3), 1.0, seed));
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        let mut allowed: Vec<usize> = (0..50).collect();
        allowed.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        for t in &a {
            assert!(allowed[..3].contains(&(*t as usize)), "token {t} is outside the top 3");
        }
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "sampling never varied"
        );
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.5 keeps only the first.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(params(1.0, None, 0.5, 1));
        assert!((0..100).all(|_| s.sample(&logits) == 0));
        let mut s = Sampler::new(params(1.0, None, 0.8, 1));
        let seen: std::collections::HashSet<u32> = (0..300).map(|_| s.sample(&logits)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn invalid_parameters_are_named() {
        assert!(params(-1.0, None, 1.0, 0)
            .validate()
            .unwrap_err()
            .contains("temperature"));
        assert!(params(1.0, None, 0.0, 0).validate().unwrap_err().contains("top_p"));
        let min_p = SamplingParams {
            min_p: 1.5,
            ..params(1.0, None, 1.0, 0)
        };
        assert!(min_p.validate().unwrap_err().contains("min_p"));
    }
}
