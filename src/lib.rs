//! gridlm: HuggingFace decoder-only LLMs on CPUs, one model split over a grid of MPI ranks
//! (pipeline stages × tensor-parallel ranks). See DESIGN.md in the shared folder for the map.

pub mod allocs;
pub mod bench;
pub mod comm;
pub mod config;
pub mod engine;
pub mod error;
pub mod grid;
pub mod host;
pub mod http;
pub mod inspect;
pub mod kernels;
pub mod model;
pub mod plan;
pub mod prompts;
pub mod scaling;
pub mod serve;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};

/// Grows `v` to at least `len` elements (new ones `T::default()`); never shrinks it. Reused
/// buffers grow to the largest request, then serve every later one without allocating.
pub(crate) fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// Makes room in `v` for `len` elements in all (its capacity at least `len`), without changing
/// its contents: buffers reserved when a run begins, so its steps never grow them.
pub(crate) fn room<T>(v: &mut Vec<T>, len: usize) {
    v.reserve(len.saturating_sub(v.len()));
}

/// FNV-1a of `s`: a stable 64-bit hash of a name (tensor names seed synthetic weights; boot ids
/// group ranks by machine).
pub(crate) fn fnv1a(s: &str) -> u64 {
    fnv1a_more(FNV1A_START, s.as_bytes())
}

/// FNV-1a's 64-bit offset basis: the hash of no bytes.
pub(crate) const FNV1A_START: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a of `h`, the hash so far, followed by `bytes`.
pub(crate) fn fnv1a_more(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// "1 token", "2 tokens": `n` and `what`, plural but for one, for lines people read.
pub fn count(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}
