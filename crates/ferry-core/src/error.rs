//! The engine's error type: every failure names the file, tensor or setting it is about.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("config: {0}")]
    Config(String),
    #[error("tensor {name}: {message}")]
    Tensor { name: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Something the caller asked for that cannot be done (a bad prompt, a sampling setting out of range).
    #[error("{0}")]
    Request(String),
    /// An op given operands of the wrong shape: a bug in the model code or a backend, not the caller's fault.
    #[error("shape: {0}")]
    Shape(String),
    #[error("KV cache: {0}")]
    Kv(String),
    #[error("expert cache: {0}")]
    Cache(String),
    #[error("CUDA: {0}")]
    Cuda(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }

    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::File {
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn tensor(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Tensor {
            name: name.into(),
            message: message.into(),
        }
    }
}
