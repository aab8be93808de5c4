//! What becomes of a request's logits once its pending tokens are computed: repetition, presence and frequency
//! penalties, logit bias, a `response_format` constraint's mask, logprobs, the sampler, the incremental detokenizer
//! (never splits a character; what it holds back is released at the end), stop strings, eos, the constraint's end,
//! max_tokens and the context window; a thinking budget, which forces the end of thinking once spent. One [`Emitter`] per request, kept across preemptions so that its sampler,
//! penalties and grammar state carry on. Not where the token goes (the scheduler hands it to the request's sink).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use super::constraint::Constraint;
use super::logprobs::{token_logprobs, TokenLogprobs};
use super::request::{FinishReason, Request, ThinkingBudget};
use super::sampler::{apply_logit_bias, apply_penalties, apply_repetition_penalty, ban_bad_words, Sampler};
use super::stop::StopStrings;
use crate::loader::{Detokenizer, TextDecoder};
use crate::{Error, Result};

/// A request's output state: what it has generated so far, as the penalties, the grammar, the detokenizer and the
/// stop strings need it.
pub(super) struct Emitter {
    sampler: Sampler,
    generated_counts: HashMap<u32, u32>,
    /// Every token of the prompt and the output, for the repetition penalty (empty when it is 1).
    seen: HashSet<u32>,
    constraint: Option<Constraint>,
    detokenizer: Detokenizer,
    stop_strings: StopStrings,
    thinking: Option<Thinking>,
}

/// Where a request with a thinking budget is in its thinking.
struct Thinking {
    budget: ThinkingBudget,
    inside: bool,
    /// Tokens generated inside the thinking so far.
    spent: usize,
}

impl Thinking {
    /// The token the budget forces next, if it is spent while thinking.
    fn forced(&self) -> Option<u32> {
        (self.inside && self.spent >= self.budget.max_tokens).then_some(self.budget.end_id)
    }

    fn saw(&mut self, token: u32) {
        if token == self.budget.end_id {
            self.inside = false;
        } else if token == self.budget.start_id {
            self.inside = true;
        } else if self.inside {
            self.spent += 1;
        }
    }
}

/// One generated token.
#[derive(Debug, PartialEq)]
pub(super) struct Emitted {
    pub id: u32,
    /// The text it released (empty while a character or a possible stop string is incomplete).
    pub text: String,
    /// Its logprob and the alternatives', when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// Set when the request ends with this token.
    pub finish: Option<FinishReason>,
}

impl Emitter {
    pub(super) fn new(request: &Request) -> Self {
        let seen = match request.repetition_penalty == 1.0 {
            true => HashSet::new(),
            false => request.prompt_ids.iter().copied().collect(),
        };
        Emitter {
            sampler: Sampler::new(request.sampling.clone()),
            generated_counts: HashMap::new(),
            seen,
            constraint: request.constraint.as_ref().map(Constraint::fork),
            detokenizer: match request.skip_special_tokens {
                true => Detokenizer::new(),
                false => Detokenizer::keeping_special_tokens(),
            },
            stop_strings: StopStrings::new(request.stop_strings.clone()),
            thinking: request.thinking_budget.map(|budget| Thinking {
                budget,
                inside: budget.starts_inside,
                spent: 0,
            }),
        }
    }

    /// Samples the next token of `request` from its last position's `logits` and appends it to `tokens` (prompt
    /// and generated so far), then applies the stop rules. An error is the detokenizer's or the grammar's.
    pub(super) fn next_token(
        &mut self,
        request: &Request,
        tokens: &mut Vec<u32>,
        logits: &[f32],
        decoder: &dyn TextDecoder,
        max_model_len: usize,
    ) -> Result<Emitted> {
        let logits = self.shaped_logits(request, logits, &tokens[request.prompt_ids.len()..])?;
        let id = self.forced().unwrap_or_else(|| self.sampler.sample(&logits));
        let logprobs = request.logprobs.map(|top_n| token_logprobs(&logits, id, top_n));
        self.emit(request, tokens, id, logprobs, decoder, max_model_len)
    }

    /// [`Emitter::next_token`] where the logits' argmax (over the sampled vocabulary) was taken elsewhere, for a
    /// request whose choice it is ([`Emitter::argmax_decides`]; an error otherwise).
    pub(super) fn next_token_from_argmax(
        &mut self,
        request: &Request,
        tokens: &mut Vec<u32>,
        argmax: u32,
        decoder: &dyn TextDecoder,
        max_model_len: usize,
    ) -> Result<Emitted> {
        if !self.argmax_decides(request, tokens.len() - request.prompt_ids.len()) {
            return Err(Error::Request(
                "internal error: a token chosen by argmax for a request that samples otherwise".into(),
            ));
        }
        let id = self.forced().unwrap_or(argmax);
        self.emit(request, tokens, id, None, decoder, max_model_len)
    }

    /// Whether `request`'s next token, `generated` tokens into its output, is its last logits' argmax and needs
    /// nothing else of them: a greedy sampler, no logprobs, and nothing [`Emitter::shaped_logits`] would change
    /// (no penalty, bias, bad word, allowed list, grammar, nor ends that min_tokens holds back). Such a token can be
    /// chosen where the logits are (the scheduler's argmax steps).
    pub(super) fn argmax_decides(&self, request: &Request, generated: usize) -> bool {
        let rules = &request.stop;
        let ends_held_back = generated < rules.min_tokens
            && ((!rules.ignore_eos && !rules.eos_token_ids.is_empty()) || !rules.stop_token_ids.is_empty());
        self.sampler.is_greedy()
            && request.logprobs.is_none()
            && request.repetition_penalty == 1.0
            && request.presence_penalty == 0.0
            && request.frequency_penalty == 0.0
            && request.logit_bias.is_empty()
            && request.allowed_token_ids.is_empty()
            && request.bad_words.is_empty()
            && !ends_held_back
            && self.constraint.is_none()
    }

    /// The token a spent thinking budget forces next, if any.
    fn forced(&self) -> Option<u32> {
        self.thinking.as_ref().and_then(Thinking::forced)
    }

    /// Appends the chosen `id` to `tokens` and applies the stop rules (the grammar's commit, eos, the length limits,
    /// the detokenizer and the stop strings).
    fn emit(
        &mut self,
        request: &Request,
        tokens: &mut Vec<u32>,
        id: u32,
        logprobs: Option<TokenLogprobs>,
        decoder: &dyn TextDecoder,
        max_model_len: usize,
    ) -> Result<Emitted> {
        let generated = tokens.len() - request.prompt_ids.len();
        if let Some(thinking) = &mut self.thinking {
            thinking.saw(id);
        }
        let grammar_complete = match &mut self.constraint {
            Some(constraint) => constraint.commit(id)?,
            None => false,
        };
        tokens.push(id);
        *self.generated_counts.entry(id).or_default() += 1;
        if request.repetition_penalty != 1.0 {
            self.seen.insert(id);
        }
        let rules = &request.stop;
        let eos = (!rules.ignore_eos && rules.eos_token_ids.contains(&id)) || rules.stop_token_ids.contains(&id);
        let generated = generated + 1;
        let out_of_room = generated >= request.max_tokens || tokens.len() >= max_model_len;
        let ending = eos || grammar_complete || out_of_room;
        let piece = self.released_text(decoder, id, eos, ending)?;
        let (mut text, stopped) = match generated >= rules.min_tokens {
            true => self.stop_strings.push(&piece),
            false => (self.stop_strings.pass(&piece), None),
        };
        if let Some(stop) = stopped.filter(|_| rules.include_stop_string) {
            text += request.stop_strings.get(stop).map_or("", String::as_str);
        }
        if ending && stopped.is_none() {
            text += &self.stop_strings.flush();
        }
        let finish = match (stopped, eos || grammar_complete, out_of_room) {
            (Some(index), _, _) => Some(FinishReason::StopString(index)),
            (None, true, _) => Some(FinishReason::Stop),
            (None, false, true) => Some(FinishReason::Length),
            (None, false, false) => None,
        };
        Ok(Emitted {
            id,
            text,
            logprobs,
            finish,
        })
    }

    /// The logits the sampler and logprobs see after `output` (the tokens generated so far): after the penalties,
    /// the bias, the bad words, the tokens not allowed, the ends that min_tokens holds back and the grammar's mask,
    /// in that order. Copied (a vocabulary's worth) only when one of them applies.
    fn shaped_logits<'a>(&mut self, request: &Request, logits: &'a [f32], output: &[u32]) -> Result<Cow<'a, [f32]>> {
        let generated = output.len();
        let mut logits = Cow::Borrowed(logits);
        if request.repetition_penalty != 1.0 {
            apply_repetition_penalty(logits.to_mut(), &self.seen, request.repetition_penalty);
        }
        if request.presence_penalty != 0.0 || request.frequency_penalty != 0.0 {
            apply_penalties(
                logits.to_mut(),
                &self.generated_counts,
                request.presence_penalty,
                request.frequency_penalty,
            );
        }
        if !request.logit_bias.is_empty() {
            apply_logit_bias(logits.to_mut(), &request.logit_bias);
        }
        if !request.bad_words.is_empty() {
            ban_bad_words(logits.to_mut(), &request.bad_words, output);
        }
        if !request.allowed_token_ids.is_empty() {
            let logits = logits.to_mut();
            let kept: Vec<(usize, f32)> = request
                .allowed_token_ids
                .iter()
                .filter_map(|&id| logits.get(id as usize).map(|&logit| (id as usize, logit)))
                .collect();
            logits.fill(f32::NEG_INFINITY);
            for (id, logit) in kept {
                logits[id] = logit;
            }
        }
        let rules = &request.stop;
        if generated < rules.min_tokens {
            let eos = rules.eos_token_ids.iter().filter(|_| !rules.ignore_eos);
            let logits = logits.to_mut();
            for &id in eos.chain(&rules.stop_token_ids) {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(constraint) = &mut self.constraint {
            constraint.mask(logits.to_mut())?;
        }
        Ok(logits)
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
    use crate::engine::{argmax, SamplingParams};

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
            ("bc".into(), vec![1, 2, 4, 8], Some(FinishReason::StopString(0)))
        );
        stopped.stop.include_stop_string = true;
        assert_eq!(
            emit_all(&stopped, &bcei, 16),
            ("bcei".into(), vec![1, 2, 4, 8], Some(FinishReason::StopString(0))),
            "the stop string kept, what follows it dropped"
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
    fn stop_tokens_end_generation_whatever_ignore_eos_and_min_tokens_holds_every_end_back() {
        let bcei = steps(&[1, 2, 4, 8, 3]);
        let mut stop_token = request(6);
        stop_token.stop.stop_token_ids = vec![4];
        stop_token.stop.ignore_eos = true;
        assert_eq!(
            emit_all(&stop_token, &bcei, 16),
            ("bc".into(), vec![1, 2, 4], Some(FinishReason::Stop))
        );
        // eos (4) is the greedy choice from the second token on, 5 close behind: min_tokens 3 keeps 4 out of the
        // first three tokens, so the fourth is the first that can end the output.
        let eager = [favouring(1, 0), favouring(4, 5), favouring(4, 5), favouring(4, 5)];
        let mut patient = request(6);
        patient.stop.eos_token_ids = vec![4];
        assert_eq!(emit_all(&patient, &eager, 16).1, vec![1, 4]);
        patient.stop.min_tokens = 3;
        assert_eq!(
            emit_all(&patient, &eager, 16),
            ("bff".into(), vec![1, 5, 5, 4], Some(FinishReason::Stop))
        );
        // Stop strings are looked for from the min_tokens-th token on: with 3, "bc" (tokens 1 and 2) is text, and
        // "ei", begun at the third token, ends the output; with 2, "bc" ends it at its second token.
        let mut strings = request(6);
        strings.stop_strings = vec!["bc".into(), "ei".into()];
        assert_eq!(emit_all(&strings, &bcei, 16).2, Some(FinishReason::StopString(0)));
        strings.stop.min_tokens = 2;
        assert_eq!(emit_all(&strings, &bcei, 16).1, vec![1, 2]);
        strings.stop.min_tokens = 3;
        assert_eq!(
            emit_all(&strings, &bcei, 16),
            ("bc".into(), vec![1, 2, 4, 8], Some(FinishReason::StopString(1)))
        );
    }

    #[test]
    fn only_allowed_tokens_are_generated_in_the_order_their_logits_say() {
        // Greedy would take 1, 2, 4, 8; with 5 and 8 allowed, each step takes the better of those two.
        let steps: Vec<Vec<f32>> = [(1, 5), (2, 8), (8, 5)].map(|(t, r)| favouring(t, r)).to_vec();
        let mut narrow = request(3);
        narrow.allowed_token_ids = vec![8, 5];
        assert_eq!(emit_all(&narrow, &steps, 16).1, vec![5, 8, 8]);
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

    #[test]
    fn logprobs_rank_the_chosen_token_and_its_alternatives() {
        let mut asked = request(1);
        asked.logprobs = Some(2);
        let mut emitter = Emitter::new(&asked);
        let mut tokens = asked.prompt_ids.clone();
        let emitted = emitter
            .next_token(&asked, &mut tokens, &favouring(3, 5), &Letters, 16)
            .unwrap();
        let logprobs = emitted.logprobs.unwrap();
        let ranked: Vec<u32> = logprobs.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ranked, [3, 5]);
        assert_eq!(logprobs.logprob, logprobs.top[0].1);
        assert!(
            (logprobs.top[0].1 - logprobs.top[1].1 - 0.5).abs() < 1e-5,
            "{logprobs:?}"
        );
        let mut tokens = asked.prompt_ids.clone();
        let plain = Emitter::new(&request(1))
            .next_token(&request(1), &mut tokens, &favouring(3, 5), &Letters, 16)
            .unwrap();
        assert_eq!(plain.logprobs, None, "none unless asked");
    }

    #[test]
    fn logit_bias_and_repetition_penalty_change_the_choice() {
        let repeat: Vec<_> = (0..2).map(|_| favouring(0, 1)).collect();
        let mut banned = request(2);
        banned.logit_bias = vec![(0, -100.0)];
        assert_eq!(emit_all(&banned, &repeat, 16).0, "bb");
        // Token 0 is in the prompt: its logit of 1.0 becomes 1/3, below token 1's 0.5, until token 1 is generated
        // and falls to 1/6.
        let mut penalised = request(2);
        penalised.repetition_penalty = 3.0;
        assert_eq!(emit_all(&penalised, &repeat, 16).0, "ba");
        penalised.prompt_ids = vec![7];
        // Token 0 leads until it has been generated once.
        assert_eq!(emit_all(&penalised, &repeat, 16).0, "ab");
    }

    #[test]
    fn bad_words_never_end_the_output_whole() {
        let repeat: Vec<_> = (0..3).map(|_| favouring(0, 1)).collect();
        assert_eq!(emit_all(&request(3), &repeat, 16).0, "aaa");
        // "aa" is banned: its second 'a' gives way to 'b' wherever the output ends with an 'a'.
        let mut pair = request(3);
        pair.bad_words = vec![vec![0, 0]];
        assert_eq!(emit_all(&pair, &repeat, 16).0, "aba");
        pair.bad_words = vec![vec![0]];
        assert_eq!(emit_all(&pair, &repeat, 16).0, "bbb");
    }

    #[test]
    fn a_spent_thinking_budget_forces_the_end_of_thinking() {
        // 'f' (5) opens thinking and 'g' (6) ends it; the model would think ('b') forever.
        let budget = ThinkingBudget {
            max_tokens: 2,
            start_id: 5,
            end_id: 6,
            starts_inside: false,
        };
        let thinks_on = steps(&[1, 5, 1, 1, 1, 1, 1]);
        let mut bounded = request(7);
        bounded.thinking_budget = Some(budget);
        assert_eq!(emit_all(&bounded, &thinks_on, 16).0, "bfbbgbb");
        assert_eq!(emit_all(&request(7), &thinks_on, 16).0, "bfbbbbb", "no budget");
        // A template that opened the thinking: the budget counts from the first token.
        bounded.thinking_budget = Some(ThinkingBudget {
            starts_inside: true,
            ..budget
        });
        assert_eq!(emit_all(&bounded, &steps(&[1; 7]), 16).0, "bbgbbbb");
        // Thinking the model ended itself within its budget is left alone.
        let short = steps(&[5, 1, 6, 1, 1]);
        bounded.thinking_budget = Some(budget);
        bounded.max_tokens = 5;
        assert_eq!(emit_all(&bounded, &short, 16).0, "fbgbb");
    }

    #[test]
    fn argmax_decides_only_for_greedy_requests_whose_logits_are_not_shaped() {
        let emitter_says =
            |request: &Request, generated: usize| Emitter::new(request).argmax_decides(request, generated);
        let plain = request(4);
        assert!(emitter_says(&plain, 0));
        let mut top_one = request(4);
        top_one.sampling = SamplingParams {
            temperature: 0.7,
            top_k: Some(1),
            ..SamplingParams::default()
        };
        assert!(emitter_says(&top_one, 0));
        let edits: [fn(&mut Request); 8] = [
            |r| r.sampling.temperature = 0.7,
            |r| r.logprobs = Some(0),
            |r| r.repetition_penalty = 1.1,
            |r| r.presence_penalty = 0.5,
            |r| r.frequency_penalty = 0.5,
            |r| r.logit_bias = vec![(3, 1.0)],
            |r| r.allowed_token_ids = vec![1, 2],
            |r| r.bad_words = vec![vec![1]],
        ];
        for edit in edits {
            let mut edited = request(4);
            edit(&mut edited);
            assert!(!emitter_says(&edited, 0), "{edited:?}");
        }
        // min_tokens holds eos back (the logits change) until it is reached; without ends to hold, nothing changes.
        let mut held = request(4);
        held.stop.min_tokens = 2;
        held.stop.eos_token_ids = vec![7];
        assert!(!emitter_says(&held, 1));
        assert!(emitter_says(&held, 2));
        held.stop.ignore_eos = true;
        assert!(emitter_says(&held, 1));
        held.stop.stop_token_ids = vec![8];
        assert!(!emitter_says(&held, 1));
    }

    #[test]
    fn a_token_chosen_by_argmax_elsewhere_emits_what_sampling_the_logits_does() {
        let budget = ThinkingBudget {
            max_tokens: 1,
            start_id: 5,
            end_id: 6,
            starts_inside: true,
        };
        let mut thinking = request(6);
        thinking.thinking_budget = Some(budget);
        thinking.stop.eos_token_ids = vec![9];
        let logits = steps(&[1, 1, 2, 3, 9, 4]);
        for request in [request(6), thinking] {
            let mut emitter = Emitter::new(&request);
            let mut tokens = request.prompt_ids.clone();
            let mut emitted = Vec::new();
            for step in &logits {
                let e = emitter
                    .next_token_from_argmax(&request, &mut tokens, argmax(step) as u32, &Letters, 16)
                    .unwrap();
                let end = e.finish.is_some();
                emitted.push(e);
                if end {
                    break;
                }
            }
            let text: String = emitted.iter().map(|e| e.text.as_str()).collect();
            let (expected, ids, finish) = emit_all(&request, &logits, 16);
            assert_eq!(
                (text, tokens[1..].to_vec(), emitted.last().unwrap().finish),
                (expected, ids, finish)
            );
        }
        let mut sampled = request(2);
        sampled.sampling.temperature = 0.7;
        let mut tokens = sampled.prompt_ids.clone();
        assert!(Emitter::new(&sampled)
            .next_token_from_argmax(&sampled, &mut tokens, 1, &Letters, 16)
            .is_err());
    }
}
