//! The library's error type. Every message names what is wrong, where (file, tensor, flag) and
//! what was expected, so that `main` can print it as one line and exit non-zero.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not `source`: the message says it already, and a chain printed in full (`{:#}`) would
    /// say it twice.
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    /// A file exists but its content is wrong (bad JSON, missing field, unsupported value).
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    /// A tensor is missing, has the wrong shape or dtype, or its bytes are out of range.
    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    Tensor { path: PathBuf, tensor: String, msg: String },
    /// Bad user input that is not a file: flags, prompts, layouts.
    #[error("{0}")]
    Input(String),
    /// A failure reported by another rank or by the communication layer.
    #[error("{0}")]
    Comm(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: &Path, err: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), err }
    }
    pub fn file(path: &Path, msg: impl Into<String>) -> Self {
        Error::File { path: path.to_path_buf(), msg: msg.into() }
    }
    pub fn tensor(path: &Path, tensor: &str, msg: impl Into<String>) -> Self {
        Error::Tensor { path: path.to_path_buf(), tensor: tensor.to_string(), msg: msg.into() }
    }
}
