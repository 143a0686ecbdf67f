//! gridlm: HuggingFace decoder-only LLMs on CPUs, one model split over a grid of MPI ranks
//! (pipeline stages × tensor-parallel ranks). See DESIGN.md in the shared folder for the map.

pub mod allocs;
pub mod bench;
pub mod comm;
pub mod config;
pub mod embeddings;
pub mod engine;
pub mod error;
pub mod grammar;
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
pub mod tools;
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

/// Writes `bytes` to `path` whole or not at all: into a file beside it, renamed into place, the
/// file aside removed where writing fails (a full disk), so no half-written file is left.
pub fn write_whole(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map_or("out".into(), |n| n.to_string_lossy());
    let aside = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = std::fs::write(&aside, bytes).and_then(|()| std::fs::rename(&aside, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&aside);
        Error::io(path, e)
    })
}

/// "1 token", "2 tokens": `n` and `what`, plural but for one, for lines people read.
pub fn count(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    /// A file is written whole; where the disk is full (the file aside is `/dev/full`), the error
    /// names the file and nothing is left, neither the file nor the one aside.
    #[test]
    fn a_file_is_written_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.svg");
        super::write_whole(&path, b"<svg/>").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"<svg/>");
        std::fs::remove_file(&path).unwrap();
        let aside = dir.path().join(format!(".plot.svg.partial-{}", std::process::id()));
        std::os::unix::fs::symlink("/dev/full", &aside).unwrap();
        let err = super::write_whole(&path, b"<svg/>").unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: No space left on device", path.display())), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
