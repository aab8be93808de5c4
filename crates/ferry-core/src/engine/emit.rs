//! What becomes of a request's logits once its pending tokens are computed: presence and frequency penalties, the
//! sampler, the incremental detokenizer (never splits a character; what it holds back is released at the end),
//! stop strings, eos, max_tokens and the context window. One [`Emitter`] per request, kept across preemptions so
//! that its sampler and penalties carry on. Not where the token goes (the scheduler hands it to the request's sink).

use std::borrow::Cow;
use std::collections::HashMap;

use super::request::{FinishReason, Request};
use super::sampler::{apply_penalties, Sampler};
use super::stop::StopStrings;
use crate::loader::{Detokenizer, TextDecoder};
use crate::Result;

/// A request's output state: what it has generated so far, as the penalties, the detokenizer and the stop strings
/// need it.
pub(super) struct Emitter {
    sampler: Sampler,
    generated_counts: HashMap<u32, u32>,
    detokenizer: Detokenizer,
    stop_strings: StopStrings,
}

/// One generated token.
#[derive(Debug, PartialEq)]
pub(super) struct Emitted {
    pub id: u32,
    /// The text it released (empty while a character or a possible stop string is incomplete).
    pub text: String,
    /// Set when the request ends with this token.
    pub finish: Option<FinishReason>,
}

impl Emitter {
    pub(super) fn new(request: &Request) -> Self {
        Emitter {
            sampler: Sampler::new(request.sampling.clone()),
            generated_counts: HashMap::new(),
            detokenizer: Detokenizer::new(),
            stop_strings: StopStrings::new(request.stop_strings.clone()),
        }
    }

    /// Samples the next token of `request` from its last position's `logits` and appends it to `tokens` (prompt
    /// and generated so far), then applies the stop rules. An error is the detokenizer's.
    pub(super) fn next_token(
        &mut self,
        request: &Request,
        tokens: &mut Vec<u32>,
        logits: &[f32],
        decoder: &dyn TextDecoder,
        max_model_len: usize,
    ) -> Result<Emitted> {
        // Copied (a vocabulary's worth, every token) only when there are penalties to apply.
        let mut logits = Cow::Borrowed(logits);
        if request.presence_penalty != 0.0 || request.frequency_penalty != 0.0 {
            apply_penalties(
                logits.to_mut(),
                &self.generated_counts,
                request.presence_penalty,
                request.frequency_penalty,
            );
        }
        let id = self.sampler.sample(&logits);
        tokens.push(id);
        *self.generated_counts.entry(id).or_default() += 1;
        let eos = !request.stop.ignore_eos && request.stop.eos_token_ids.contains(&id);
        let generated = tokens.len() - request.prompt_ids.len();
        let out_of_room = generated >= request.max_tokens || tokens.len() >= max_model_len;
        let ending = eos || out_of_room;
        let piece = self.released_text(decoder, id, eos, ending)?;
        let (mut text, stopped) = self.stop_strings.push(&piece);
        if ending && !stopped {
            text += &self.stop_strings.flush();
        }
        let finish = match (stopped || eos, out_of_room) {
            (true, _) => Some(FinishReason::Stop),
            (false, true) => Some(FinishReason::Length),
            (false, false) => None,
        };
        Ok(Emitted { id, text, finish })
    }

    /// The text a new token releases (none for an eos token), and at the end whatever the detokenizer held back.
    fn released_text(&mut self, decoder: &dyn TextDecoder, token: u32, eos: bool, ending: bool) -> Result<String> {
        let mut text = match eos {
            true => String::new(),
            false => self.detokenizer.push(decoder, token)?.unwrap_or_default(),
        };
        if ending {
            text += &self.detokenizer.finish(decoder)?;
        }
        Ok(text)
    }
}

/// The decoder for callers that want token ids, not text (`ferry bench`, a checkpoint without a tokenizer): every
/// [`super::Event::Token`]'s text is empty.
pub struct NoText;

impl TextDecoder for NoText {
    fn decode(&self, _ids: &[u32], _skip_special_tokens: bool) -> Result<String> {
        Ok(String::new())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Token t reads as the letter 'a' + t.
    pub(in crate::engine) struct Letters;

    impl TextDecoder for Letters {
        fn decode(&self, ids: &[u32], _skip_special_tokens: bool) -> Result<String> {
            Ok(ids.iter().map(|&t| (b'a' + t as u8) as char).collect())
        }
    }

    const VOCAB: usize = 16;

    fn request(max_tokens: usize) -> Request {
        Request::new(vec![0], max_tokens)
    }

    /// Logits that make `token` the greedy choice, with `runner_up` close behind.
    fn favouring(token: u32, runner_up: u32) -> Vec<f32> {
        let mut logits = vec![-10.0; VOCAB];
        logits[runner_up as usize] = 0.5;
        logits[token as usize] = 1.0;
        logits
    }

    /// Emits the greedy choice of each step's logits until the request ends (at most `steps.len()` tokens): the
    /// text released and how it finished.
    fn emit_all(
        request: &Request,
        steps: &[Vec<f32>],
        max_model_len: usize,
    ) -> (String, Vec<u32>, Option<FinishReason>) {
        let mut emitter = Emitter::new(request);
        let mut tokens = request.prompt_ids.clone();
        let mut text = String::new();
        for logits in steps {
            let emitted = emitter
                .next_token(request, &mut tokens, logits, &Letters, max_model_len)
                .unwrap();
            text += &emitted.text;
            if emitted.finish.is_some() {
                return (text, tokens[1..].to_vec(), emitted.finish);
            }
        }
        (text, tokens[1..].to_vec(), None)
    }

    fn steps(tokens: &[u32]) -> Vec<Vec<f32>> {
        tokens.iter().map(|&t| favouring(t, 0)).collect()
    }

    #[test]
    fn max_tokens_and_the_context_window_end_generation() {
        let bcei = steps(&[1, 2, 4, 8, 3]);
        assert_eq!(
            emit_all(&request(2), &bcei, 16),
            ("bc".into(), vec![1, 2], Some(FinishReason::Length))
        );
        assert_eq!(
            emit_all(&request(10), &bcei, 4),
            ("bce".into(), vec![1, 2, 4], Some(FinishReason::Length)),
            "prompt and output fill a context of 4"
        );
        assert_eq!(emit_all(&request(10), &bcei, 16).2, None);
    }

    #[test]
    fn stop_strings_and_eos_end_generation_without_their_text() {
        let mut stopped = request(6);
        stopped.stop_strings = vec!["ei".into()];
        let bcei = steps(&[1, 2, 4, 8, 3]);
        // "e" is held back while it could start "ei"; the stop string and what follows are dropped.
        assert_eq!(
            emit_all(&stopped, &bcei, 16),
            ("bc".into(), vec![1, 2, 4, 8], Some(FinishReason::Stop))
        );
        let mut eos = request(6);
        eos.stop.eos_token_ids = vec![4];
        assert_eq!(
            emit_all(&eos, &bcei, 16),
            ("bc".into(), vec![1, 2, 4], Some(FinishReason::Stop))
        );
        eos.stop.ignore_eos = true;
        assert_eq!(emit_all(&eos, &bcei, 16).0, "bceid", "eos ignored");
    }

    #[test]
    fn text_held_back_is_released_at_the_end() {
        let mut held = request(3);
        held.stop_strings = vec!["dx".into()];
        // "d" could start "dx" until generation ends: then it is released with the last token.
        let (text, _, finish) = emit_all(&held, &steps(&[1, 2, 3]), 16);
        assert_eq!((text.as_str(), finish), ("bcd", Some(FinishReason::Length)));
    }

    #[test]
    fn a_frequency_penalty_changes_the_choice() {
        // Token 0 ('a') leads every step, token 1 ('b') close behind.
        let repeat: Vec<_> = (0..3).map(|_| favouring(0, 1)).collect();
        assert_eq!(emit_all(&request(3), &repeat, 16).0, "aaa");
        let mut penalised = request(3);
        penalised.frequency_penalty = 2.0;
        assert_eq!(emit_all(&penalised, &repeat, 16).0, "aba");
    }
}
