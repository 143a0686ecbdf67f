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
///
/// A tensor of more than two dimensions is read as the matrix of its rows, its leading
/// dimensions flattened ([`matrix_dims`]): a layer's experts stacked as `[experts, rows, cols]`
/// hold expert `e`'s row `r` at row `e · rows + r`.
pub trait Source {
    /// Rows `rows` of a tensor of 2 or more dimensions, or elements `rows` of a 1-D one.
    fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat>;
    /// Columns `cols` of rows `rows` of a tensor of 2 or more dimensions.
    fn block(
        &self,
        name: &str,
        expected_shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Mat>;
    /// Columns `cols` of every row of a tensor of 2 or more dimensions.
    fn cols(&self, name: &str, expected_shape: &[usize], cols: Range<usize>) -> Result<Mat> {
        self.block(name, expected_shape, 0..matrix_dims(expected_shape).0, cols)
    }
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

/// The error for a file `path` its format's reader refuses (`why`): where the file is a Git LFS
/// pointer (a model repository cloned without Git LFS keeps its large files as such pointers),
/// that is said instead.
pub fn unreadable(path: &std::path::Path, why: impl FnOnce() -> String) -> crate::Error {
    crate::Error::file(path, lfs_pointer(path).unwrap_or_else(why))
}

/// What to say of the file `path` where it is a Git LFS pointer.
fn lfs_pointer(path: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let text = std::str::from_utf8(&head[..n]).ok()?;
    if !text.starts_with("version https://git-lfs.github.com/spec/") {
        return None;
    }
    let size = text.lines().find_map(|l| l.strip_prefix("size ")?.trim().parse::<u64>().ok());
    let size = size.map_or(String::new(), |b| format!(" of {:.1} MB", b as f64 / 1e6));
    Some(format!(
        "a Git LFS pointer, not the file itself (its content{size} was never fetched: the repository was cloned without Git LFS); run `git lfs install && git lfs pull` in its folder"
    ))
}

/// The (rows, columns) a tensor of `shape` is read as: its last dimension the columns, the
/// product of the others the rows; a 1-D tensor is a column.
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [n] => (*n, 1),
        [lead @ .., c] => (lead.iter().product(), *c),
    }
}

/// `src`, the folder `dir`'s weights, as loading reads them: as stored, or with its matrices
/// converted to `dtype`.
pub fn as_loaded<S: Source + 'static>(
    src: S,
    dtype: Option<DType>,
    dir: &std::path::Path,
) -> Box<dyn Source> {
    match dtype {
        None => Box::new(src),
        Some(dtype) => Box::new(Cast { inner: src, dtype, dir: dir.to_path_buf() }),
    }
}

/// A source whose matrices are converted to `dtype` as they are read (`--dtype` with a model
/// folder), so one checkpoint runs and is measured in every weight dtype. 1-D tensors (norms,
/// biases) are read as f32 from the source itself, as they are for every dtype.
pub struct Cast<S> {
    pub inner: S,
    pub dtype: DType,
    /// Named in errors: the checkpoint's folder.
    pub dir: std::path::PathBuf,
}

impl<S: Source> Cast<S> {
    fn cast(&self, name: &str, m: Mat) -> Result<Mat> {
        let data = m.data.cast(self.dtype);
        // An infinity that was finite before the cast: a value f16 cannot hold (an infinity
        // in the source stays one, wherever it lies).
        if let Data::F16(out) = &data {
            if out.iter().any(|x| x.is_infinite()) {
                let src = m.data.to_f32_vec();
                if let Some((_, v)) = out.iter().zip(&src).find(|(o, v)| o.is_infinite() && v.is_finite()) {
                    return Err(crate::error::Error::tensor(
                        &self.dir,
                        name,
                        format!("holds {v}, beyond f16's range (±65504); load it in bf16 or f32"),
                    ));
                }
            }
        }
        Ok(Mat { data, ..m })
    }
}

impl<S: Source> Source for Cast<S> {
    fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat> {
        self.cast(name, self.inner.rows(name, expected_shape, rows)?)
    }
    fn block(
        &self,
        name: &str,
        expected_shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Mat> {
        self.cast(name, self.inner.block(name, expected_shape, rows, cols)?)
    }
    fn dtype(&self, name: &str, expected_shape: &[usize]) -> Result<DType> {
        self.inner.dtype(name, expected_shape)?;
        Ok(self.dtype)
    }
    fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.inner.vector_f32(name, len)
    }
    fn vector_range_f32(&self, name: &str, len: usize, range: Range<usize>) -> Result<Vec<f32>> {
        self.inner.vector_range_f32(name, len, range)
    }
}

/// A source whose 2-D tensors named as `turned` says are stored transposed (GPT-2's
/// `Conv1D` matrices, `[in, out]`): each is read by its `[out, in]` shape, as a `nn.Linear`'s
/// would be. Other tensors pass through.
pub struct Transposed<'a> {
    pub inner: &'a dyn Source,
    pub turned: fn(&str) -> bool,
}

impl Transposed<'_> {
    /// The stored shape of a tensor read as `shape`, if it is stored transposed.
    fn stored(&self, name: &str, shape: &[usize]) -> Option<[usize; 2]> {
        match shape {
            [r, c] if (self.turned)(name) => Some([*c, *r]),
            _ => None,
        }
    }
}

impl Source for Transposed<'_> {
    fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat> {
        match self.stored(name, expected_shape) {
            Some(s) => Ok(self.inner.block(name, &s, 0..s[0], rows)?.transpose()),
            None => self.inner.rows(name, expected_shape, rows),
        }
    }
    fn block(
        &self,
        name: &str,
        expected_shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Mat> {
        match self.stored(name, expected_shape) {
            Some(s) => Ok(self.inner.block(name, &s, cols, rows)?.transpose()),
            None => self.inner.block(name, expected_shape, rows, cols),
        }
    }
    fn dtype(&self, name: &str, expected_shape: &[usize]) -> Result<DType> {
        match self.stored(name, expected_shape) {
            Some(s) => self.inner.dtype(name, &s),
            None => self.inner.dtype(name, expected_shape),
        }
    }
    fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.inner.vector_f32(name, len)
    }
    fn vector_range_f32(&self, name: &str, len: usize, range: Range<usize>) -> Result<Vec<f32>> {
        self.inner.vector_range_f32(name, len, range)
    }
}

/// A row-major `rows × cols` matrix's values, transposed.
pub(crate) fn transposed<T: Copy>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..cols).flat_map(|c| (0..rows).map(move |r| v[r * cols + c])).collect()
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
    /// The matrix turned on its side: `[cols, rows]`, row `c` holding column `c`.
    pub fn transpose(&self) -> Mat {
        let data = match &self.data {
            Data::F32(v) => Data::F32(transposed(v, self.rows, self.cols)),
            Data::BF16(v) => Data::BF16(transposed(v, self.rows, self.cols)),
            Data::F16(v) => Data::F16(transposed(v, self.rows, self.cols)),
        };
        Mat { rows: self.cols, cols: self.rows, data }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A transpose moves each value `[r][c]` to `[c][r]`, in the stored dtype.
    #[test]
    fn transpose_turns_rows_into_columns() {
        let v: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let m = Mat { rows: 2, cols: 3, data: Data::F32(v.clone()) }.transpose();
        assert_eq!((m.rows, m.cols, m.data.to_f32_vec()), (3, 2, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]));
        let b = Mat { rows: 2, cols: 3, data: Data::F32(v).cast(DType::BF16) }.transpose();
        assert_eq!((b.data.dtype(), b.data.to_f32_vec()), (DType::BF16, m.data.to_f32_vec()));
    }

    /// One 2x2 matrix `w` holding `values` in f32.
    struct Fixed(Vec<f32>);

    impl Source for Fixed {
        fn rows(&self, _: &str, shape: &[usize], rows: Range<usize>) -> Result<Mat> {
            let cols = shape.get(1).copied().unwrap_or(1);
            let v = self.0[rows.start * cols..rows.end * cols].to_vec();
            Ok(Mat { rows: rows.len(), cols, data: Data::F32(v) })
        }
        fn block(&self, name: &str, shape: &[usize], rows: Range<usize>, cols: Range<usize>) -> Result<Mat> {
            let n = rows.len();
            let all = self.rows(name, shape, rows)?.data.to_f32_vec();
            let v = all.chunks(shape[1]).flat_map(|r| r[cols.clone()].to_vec()).collect();
            Ok(Mat { rows: n, cols: cols.len(), data: Data::F32(v) })
        }
        fn dtype(&self, _: &str, _: &[usize]) -> Result<DType> {
            Ok(DType::F32)
        }
    }

    #[test]
    fn cast_converts_matrices_and_keeps_vectors() {
        let values = vec![1.0 / 3.0, -2.5, 1e-3, 7.0];
        let cast = Cast { inner: Fixed(values.clone()), dtype: DType::F16, dir: "m".into() };
        assert_eq!(cast.dtype("w", &[2, 2]).unwrap(), DType::F16);
        let rows = cast.rows("w", &[2, 2], 1..2).unwrap();
        let want: Vec<f16> = values[2..].iter().map(|&x| f16::from_f32(x)).collect();
        assert!(matches!(&rows.data, Data::F16(v) if *v == want), "{rows:?}");
        let cols = cast.cols("w", &[2, 2], 0..1).unwrap();
        let f = |x: f32| f16::from_f32(x).to_f32();
        assert_eq!(cols.data.to_f32_vec(), [f(values[0]), f(values[2])]);
        // Norms and biases stay f32, as the source gives them.
        assert_eq!(cast.vector_f32("w", 4).unwrap(), values);
    }

    #[test]
    fn cast_to_f16_names_a_value_out_of_its_range() {
        let cast =
            Cast { inner: Fixed(vec![1.0, 7e4, 0.0, f32::INFINITY]), dtype: DType::F16, dir: "m".into() };
        let e = cast.rows("w", &[2, 2], 0..2).unwrap_err().to_string();
        assert!(e.contains("tensor `w`") && e.contains("70000") && e.contains("f16"), "{e}");
        // An infinity stays one: only finite values that f16 cannot hold are refused, also
        // where an infinity comes before them.
        assert!(cast.rows("w", &[2, 2], 1..2).is_ok());
        let after =
            Cast { inner: Fixed(vec![f32::INFINITY, 7e4, 0.0, 1.0]), dtype: DType::F16, dir: "m".into() };
        let e = after.rows("w", &[2, 2], 0..1).unwrap_err().to_string();
        assert!(e.contains("tensor `w`") && e.contains("70000"), "{e}");
        let bf16 = Cast { inner: Fixed(vec![1.0, 7e4, 0.0, 1.0]), dtype: DType::BF16, dir: "m".into() };
        assert!(bf16.rows("w", &[2, 2], 0..2).is_ok());
    }
}
