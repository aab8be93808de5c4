//! Turning a prompt into tokens: sampling, stop rules and the generation loop over a [`Model`].

mod generate;
mod sampler;

pub use generate::{generate, FinishReason, GenerateRequest, Generation, StopRules};
pub use sampler::{argmax, Sampler, SamplingParams};
