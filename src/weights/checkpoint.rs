//! Reading a shard of a HuggingFace safetensors checkpoint (single file or sharded with
//! `model.safetensors.index.json`). Files are memory-mapped and only the byte ranges of the
//! requested rows or columns are copied out, so a rank's resident memory holds its shard only.

use super::{DType, Data, Mat};
use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

struct TensorInfo {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range inside the file.
    bytes: Range<usize>,
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

pub struct Checkpoint {
    files: Vec<MappedFile>,
    tensors: HashMap<String, TensorInfo>,
    /// What to name in "tensor missing" errors.
    origin: PathBuf,
}

impl Checkpoint {
    /// Opens `DIR/model.safetensors` or the files listed in `DIR/model.safetensors.index.json`,
    /// validating every header (truncated or corrupt files are reported here).
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (file_names, origin): (Vec<String>, PathBuf) = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::file(&index, "missing object `weight_map`"))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            (names, index.clone())
        } else if single.exists() {
            (vec!["model.safetensors".into()], single.clone())
        } else {
            return Err(Error::file(
                &single,
                "not found (expected model.safetensors or model.safetensors.index.json)",
            ));
        };
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for name in file_names {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the file is opened read-only and the map is only read; a checkpoint being
            // rewritten while we load it is outside what we can guard against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                Error::file(
                    &path,
                    format!("truncated or corrupt safetensors file: {e:?}"),
                )
            })?;
            let data_start = 8 + header_len;
            let file_idx = files.len();
            for (tname, info) in meta.tensors() {
                let dtype = match info.dtype {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    other => {
                        return Err(Error::tensor(
                            &path,
                            &tname,
                            format!("unsupported dtype {other:?} (expected F32, BF16 or F16)"),
                        ))
                    }
                };
                let (a, b) = info.data_offsets;
                tensors.insert(
                    tname.clone(),
                    TensorInfo {
                        file: file_idx,
                        dtype,
                        shape: info.shape.clone(),
                        bytes: data_start + a..data_start + b,
                    },
                );
            }
            files.push(MappedFile { path, map });
        }
        Ok(Checkpoint {
            files,
            tensors,
            origin,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn info(&self, name: &str, expected_shape: &[usize]) -> Result<(&TensorInfo, &MappedFile)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&self.origin, name, "missing from the checkpoint"))?;
        let file = &self.files[info.file];
        if info.shape != expected_shape {
            return Err(Error::tensor(
                &file.path,
                name,
                format!(
                    "shape {:?} disagrees with config.json (expected {:?})",
                    info.shape, expected_shape
                ),
            ));
        }
        Ok((info, file))
    }

    /// Rows `rows` of a 2-D tensor of shape `[n_rows, n_cols]`, or elements `rows` of a 1-D one.
    pub fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat> {
        let (info, file) = self.info(name, expected_shape)?;
        let cols = if expected_shape.len() == 2 {
            expected_shape[1]
        } else {
            1
        };
        let row_bytes = cols * info.dtype.size_bytes();
        let start = info.bytes.start + rows.start * row_bytes;
        let end = info.bytes.start + rows.end * row_bytes;
        let data = Data::from_le_bytes(info.dtype, &file.map[start..end]);
        Ok(Mat {
            rows: rows.len(),
            cols,
            data,
        })
    }

    /// Columns `cols` of every row of a 2-D tensor `[n_rows, n_cols]` (o_proj and down_proj shards).
    pub fn cols(&self, name: &str, expected_shape: &[usize], cols: Range<usize>) -> Result<Mat> {
        let (info, file) = self.info(name, expected_shape)?;
        let (n_rows, n_cols) = (expected_shape[0], expected_shape[1]);
        let es = info.dtype.size_bytes();
        let mut bytes = Vec::with_capacity(n_rows * cols.len() * es);
        for r in 0..n_rows {
            let row0 = info.bytes.start + r * n_cols * es;
            bytes.extend_from_slice(&file.map[row0 + cols.start * es..row0 + cols.end * es]);
        }
        Ok(Mat {
            rows: n_rows,
            cols: cols.len(),
            data: Data::from_le_bytes(info.dtype, &bytes),
        })
    }

    /// A whole 1-D tensor as f32 (norm weights, biases).
    pub fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.rows(name, &[len], 0..len)?.data.to_f32_vec())
    }

    /// Elements `range` of a 1-D tensor as f32 (a shard of a bias).
    pub fn vector_range_f32(
        &self,
        name: &str,
        len: usize,
        range: Range<usize>,
    ) -> Result<Vec<f32>> {
        Ok(self.rows(name, &[len], range)?.data.to_f32_vec())
    }
}
