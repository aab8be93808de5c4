//! Turning prompts into tokens: requests and their events, sampling, stop rules, what becomes of a request's
//! logits, and the scheduler that serves many requests at once (on its own thread for the server, driven step by
//! step by `ferry generate` and `ferry bench`).

mod constraint;
mod emit;
mod executor;
mod logprobs;
pub mod plan;
mod request;
mod sampler;
mod scheduler;
mod service;
mod stop;

pub use crate::backend::cpu::argmax;
pub use constraint::{choice_alternatives, regex_terminal, Constraint, GrammarCompiler, ResponseFormat};
pub use emit::NoText;
pub use executor::{Executor, ModelExecutor};
pub use logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
pub use plan::MAX_BATCH_TOKENS;
pub use request::{Event, EventSink, FinishReason, Request, RequestId, StopRules, ThinkingBudget};
pub use sampler::{apply_penalties, Sampler, SamplingParams};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulerStats, SchedulingPolicy, StepReport};
pub use service::{EngineHandle, EngineStatus, Heartbeat};
pub use stop::{partial_match_len, validate_stop_strings, StopStrings};
