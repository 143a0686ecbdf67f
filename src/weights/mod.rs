//! Weights in memory and on disk. Owns: the in-memory matrix type ([`Mat`]) kept in its stored
//! dtype, reading shards of safetensors checkpoints, and GGUF import. Must not do arithmetic
//! beyond dtype conversion (that is `kernels`).

pub mod checkpoint;
pub mod convert;
pub mod gguf;
pub mod synthetic;

use crate::error::Result;
use half::{bf16, f16};
use std::ops::Range;

/// Where a shard's tensors come from: a checkpoint on disk or seeded synthetic weights. Names
/// and shapes are HF's (`[out, in]` for a Linear weight); only the requested part is produced.
pub trait Source {
    /// Rows `rows` of a 2-D tensor `[n_rows, n_cols]`, or elements `rows` of a 1-D one.
    fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat>;
    /// Columns `cols` of every row of a 2-D tensor `[n_rows, n_cols]`.
    fn cols(&self, name: &str, expected_shape: &[usize], cols: Range<usize>) -> Result<Mat>;
    /// The dtype [`Source::rows`] and [`Source::cols`] will give the tensor, without reading it.
    fn dtype(&self, name: &str, expected_shape: &[usize]) -> Result<DType>;

    /// A whole 1-D tensor as f32 (norm weights, biases).
    fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.rows(name, &[len], 0..len)?.data.to_f32_vec())
    }
    /// Elements `range` of a 1-D tensor as f32 (a shard of a bias).
    fn vector_range_f32(&self, name: &str, len: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.rows(name, &[len], range)?.data.to_f32_vec())
    }
}

/// Element type of stored weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "float16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// Weight values in their stored precision.
#[derive(Debug, Clone)]
pub enum Data {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F16(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
        }
    }
    /// Decodes little-endian bytes of `dtype`.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Self {
        match dtype {
            DType::F32 => Data::F32(
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            ),
            DType::BF16 => Data::BF16(
                bytes.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect(),
            ),
            DType::F16 => Data::F16(
                bytes.chunks_exact(2).map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect(),
            ),
        }
    }
    /// Copies `range` of the elements out as f32.
    pub fn to_f32_range(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            Data::F32(v) => out.copy_from_slice(&v[range]),
            Data::BF16(v) => v[range].iter().zip(out).for_each(|(a, o)| *o = a.to_f32()),
            Data::F16(v) => v[range].iter().zip(out).for_each(|(a, o)| *o = a.to_f32()),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.to_f32_range(0..self.len(), &mut out);
        out
    }
    /// Converts to another dtype (round to nearest even).
    pub fn cast(&self, dtype: DType) -> Data {
        if self.dtype() == dtype {
            return self.clone();
        }
        let v = self.to_f32_vec();
        match dtype {
            DType::F32 => Data::F32(v),
            DType::BF16 => Data::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => Data::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
        }
    }
    /// Appends another buffer of the same dtype.
    pub fn extend(&mut self, other: &Data) {
        match (self, other) {
            (Data::F32(a), Data::F32(b)) => a.extend_from_slice(b),
            (Data::BF16(a), Data::BF16(b)) => a.extend_from_slice(b),
            (Data::F16(a), Data::F16(b)) => a.extend_from_slice(b),
            (a, b) => {
                let joined = a.cast(DType::F32);
                let mut v = joined.to_f32_vec();
                v.extend(b.to_f32_vec());
                *a = Data::F32(v);
            }
        }
    }
}

/// A row-major matrix `[rows, cols]` in its stored dtype (a Linear weight is `[out, in]`).
#[derive(Debug, Clone)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Data,
}

impl Mat {
    pub fn bytes(&self) -> usize {
        self.data.len() * self.data.dtype().size_bytes()
    }
    /// Stacks matrices with equal column counts vertically (fused QKV, fused gate/up). Mixed
    /// dtypes fall back to f32.
    pub fn vstack(parts: Vec<Mat>) -> Mat {
        let mut it = parts.into_iter();
        let mut first = it.next().expect("vstack of no matrices");
        for m in it {
            assert_eq!(m.cols, first.cols, "vstack of matrices with different widths");
            first.rows += m.rows;
            first.data.extend(&m.data);
        }
        first
    }
}
