//! Turning prompts into tokens: sampling, stop rules, the generation loop for one sequence, and the scheduler that
//! serves many requests at once on its own thread.

mod executor;
mod generate;
mod sampler;
mod scheduler;
mod service;
mod stop;

pub use executor::{Executor, ModelExecutor};
pub use generate::{generate, generate_routed, FinishReason, GenerateRequest, Generation, StopRules};
pub use sampler::{apply_penalties, argmax, Sampler, SamplingParams};
pub use scheduler::{Event, EventSink, Request, RequestId, Scheduler, SchedulerConfig, SchedulerStats, StepReport};
pub use service::{EngineHandle, EngineStatus};
pub use stop::{partial_match_len, StopStrings};

/// The most tokens one forward pass carries: long prompts are prefilled in chunks of this many (which also bounds
/// the activation workspace a budget must hold).
pub const MAX_BATCH_TOKENS: usize = 2048;
