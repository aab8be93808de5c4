//! Turning prompts into tokens: sampling, stop rules, the generation loop for one sequence, and the scheduler that
//! serves many requests at once on its own thread.

mod executor;
mod generate;
mod sampler;
mod scheduler;
mod service;
mod stop;

pub use executor::{Executor, ModelExecutor};
pub use generate::{generate, FinishReason, GenerateRequest, Generation, StopRules};
pub use sampler::{apply_penalties, argmax, Sampler, SamplingParams};
pub use scheduler::{Event, EventSink, Request, RequestId, Scheduler, SchedulerConfig, SchedulerStats, StepReport};
pub use service::{EngineHandle, EngineStatus};
pub use stop::{partial_match_len, StopStrings};
