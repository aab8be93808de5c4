//! Turning prompts into tokens: requests and their events, sampling, stop rules, what becomes of a request's
//! logits, and the scheduler that serves many requests at once (on its own thread for the server, driven step by
//! step by `ferry generate` and `ferry bench`).

mod emit;
mod executor;
mod request;
mod sampler;
mod scheduler;
mod service;
mod stop;

pub use emit::NoText;
pub use executor::{Executor, ModelExecutor};
pub use request::{Event, EventSink, FinishReason, Request, RequestId, StopRules};
pub use sampler::{apply_penalties, argmax, Sampler, SamplingParams};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulerStats, StepReport};
pub use service::{EngineHandle, EngineStatus};
pub use stop::{partial_match_len, StopStrings};

/// The most tokens one forward pass carries: long prompts are prefilled in chunks of this many (which also bounds
/// the activation workspace a budget must hold).
pub const MAX_BATCH_TOKENS: usize = 2048;
