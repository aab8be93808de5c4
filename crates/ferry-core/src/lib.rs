//! ferry-core: the engine as a library.
//!
//! - [`loader`]: a Hugging Face checkpoint directory (config, memory-mapped safetensors, tokenizer, chat template,
//!   generation config), read without copying weights.
//! - [`backend`]: the [`backend::Backend`] trait every model is written against, and the CPU backend (the numerical
//!   reference, CI's backend, and later the CPU lane for expert misses).
//! - [`model`]: one file per model family, built from the shared layers in [`model::layers`].
//! - [`kv`]: the key/value cache of running sequences, and its block accounting.
//! - [`engine`]: sampling, stop rules, the generation loop, and the scheduler that serves many requests at once
//!   (continuous batching, chunked prefill, preemption) on its own thread.
//! - [`moe`]: the expert cache's pure logic: eviction policies, the planner of one slot pool shared by all MoE
//!   layers, routing traces.
//!
//! Not here: HTTP serving (ferry-server), the command line (ferry-cli), GPU kernels (ferry-kernels).

pub mod backend;
pub mod engine;
pub mod error;
pub mod kv;
pub mod loader;
pub mod model;
pub mod moe;

pub use error::{Error, Result};
