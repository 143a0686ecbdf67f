//! gridlm: HuggingFace decoder-only LLMs on CPUs, one model split over a grid of MPI ranks
//! (pipeline stages × tensor-parallel ranks). See DESIGN.md in the shared folder for the map.

pub mod bench;
pub mod comm;
pub mod config;
pub mod engine;
pub mod error;
pub mod grid;
pub mod host;
pub mod kernels;
pub mod model;
pub mod plan;
pub mod prompts;
pub mod scaling;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
