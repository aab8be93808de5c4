//! Log-probabilities of a generated token and its most likely alternatives (OpenAI's `logprobs`).
//!
//! They are read from the distribution the sampler chooses from before it reshapes it: the logits after the
//! penalties, `logit_bias` and a `response_format` constraint's mask, log-softmaxed at temperature 1, before
//! temperature, top-k, top-p and min-p (vLLM's default "raw" logprobs, except that ferry's include the request's
//! own penalties, bias and mask). So a token the constraint forbids is never listed, and greedy's choice always has
//! the highest logprob.

/// Most alternatives a request may ask for per token (OpenAI's limit for chat `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and the `top` most likely tokens at its position, most likely first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// (token id, logprob); tokens of equal logprob in id order; never a token of probability 0.
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of `chosen` and of the `top_n` most likely tokens under softmax(`logits`).
pub fn token_logprobs(logits: &[f32], chosen: u32, top_n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    // Relative to the maximum first: subtracting log(sum of exp) from a large logit would lose its digits.
    let logprob = |logit: f32| (logit - max) - sum.ln() as f32;
    TokenLogprobs {
        logprob: logprob(logits[chosen as usize]),
        top: top_tokens(logits, top_n)
            .into_iter()
            .map(|(id, logit)| (id, logprob(logit)))
            .collect(),
    }
}

/// The `n` largest finite logits with their ids, largest first, lower id first among equals: one pass keeping a
/// sorted list of at most `n`, as `n` is small next to a vocabulary.
fn top_tokens(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (id, &logit) in logits.iter().enumerate() {
        if logit == f32::NEG_INFINITY || (top.len() == n && logit <= top[n - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, l)| l >= logit);
        top.insert(at, (id as u32, logit));
        top.truncate(n);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_is_ordered() {
        // softmax([ln 1, ln 2, ln 4, ln 1]) = [1/8, 2/8, 4/8, 1/8].
        let logits = [1f32.ln(), 2f32.ln(), 4f32.ln(), 1f32.ln()];
        let lp = token_logprobs(&logits, 1, 3);
        assert!(close(lp.logprob, 0.25f32.ln()), "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [2, 1, 0], "ties (0 and 3) go to the lower id");
        for (&(_, got), want) in lp.top.iter().zip([0.5f32, 0.25, 0.125]) {
            assert!(close(got, want.ln()), "{lp:?}");
        }
        assert!(token_logprobs(&logits, 2, 0).top.is_empty());
    }

    #[test]
    fn masked_tokens_have_no_probability_and_are_never_listed() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        let lp = token_logprobs(&logits, 3, 20);
        assert!(close(lp.logprob, 0.5f32.ln()));
        assert_eq!(lp.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(), [1, 3]);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let lp = token_logprobs(&[1000.0, 1000.0], 0, 1);
        assert!(close(lp.logprob, 0.5f32.ln()));
    }
}
