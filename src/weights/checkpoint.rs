//! Reading a shard of a HuggingFace safetensors checkpoint (single file or sharded with
//! `model.safetensors.index.json`). Files are memory-mapped and only the byte ranges of the
//! requested rows or columns are copied out, so a rank's resident memory holds its shard only.

use super::{matrix_dims, DType, Data, Mat, Source};
use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;

struct TensorInfo {
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range inside the file.
    bytes: Range<usize>,
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    tensors: HashMap<String, TensorInfo>,
}

impl MappedFile {
    /// Maps a safetensors file and validates its header (truncated or corrupt files fail here).
    fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is opened read-only and the map is only read; a checkpoint being
        // rewritten while we load it is outside what we can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            super::unreadable(&path, || format!("truncated or corrupt safetensors file: {e:?}"))
        })?;
        let data_start = 8 + header_len;
        let mut tensors = HashMap::new();
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
                TensorInfo { dtype, shape: info.shape.clone(), bytes: data_start + a..data_start + b },
            );
        }
        Ok(MappedFile { path, map, tensors })
    }
}

/// A checkpoint folder. Files are opened on first use, so a rank maps and validates only the
/// files that hold its tensors; everything is unmapped when the checkpoint is dropped.
pub struct Checkpoint {
    dir: PathBuf,
    /// Tensor name → file name, from the index; `None` for a single `model.safetensors`.
    index: Option<HashMap<String, String>>,
    /// What to name in "tensor missing" errors.
    origin: PathBuf,
    files: RefCell<HashMap<String, Rc<MappedFile>>>,
    /// Where the text model's tensors are stored in an image-and-text folder (Gemma 3's):
    /// `model.*` under this prefix instead (`language_model.model.` as first published,
    /// `model.language_model.` as later versions of HF save it), `lm_head.*` under `lm_head`.
    text_model: Option<(&'static str, &'static str)>,
    /// The tensors of `transformer.*` are stored without that prefix: a GPT-2 folder saved
    /// from the bare model (`GPT2Model`, as OpenAI's `gpt2` is).
    bare: bool,
}

/// Stored names of the text model of an image-and-text folder, by how its embedding is stored:
/// (prefix of `model.*`, prefix of `lm_head.*`).
const TEXT_MODEL_PREFIXES: [(&str, &str); 2] =
    [("language_model.model.", "language_model.lm_head."), ("model.language_model.", "lm_head.")];

/// The names of the files in `dir` ending in one of `exts` and starting with one of `starts`,
/// sorted (none where the folder cannot be read): what a folder holds in place of a model
/// folder's files, for error lines.
pub fn files_named(dir: &Path, exts: &[&str], starts: &[&str]) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| exts.iter().any(|x| n.ends_with(x)) && starts.iter().any(|p| n.starts_with(p)))
        .collect();
    names.sort_unstable();
    names
}

/// `names` for an error line: the first `shown` of them, then how many more.
pub fn some_of(names: &[String], shown: usize) -> String {
    let first = names[..names.len().min(shown)].join(", ");
    match names.len().saturating_sub(shown) {
        0 => first,
        more => format!("{first} and {more} more"),
    }
}

/// What a folder without `model.safetensors` or its index holds instead, said after the error:
/// PyTorch's weights, llama.cpp's files, or safetensors files without their index (empty where
/// none). Of PyTorch's files only weights count (`pytorch_model*.bin`, `model*.pt`,
/// `consolidated*.pth`, ...), not a trainer's `training_args.bin` or `optimizer.pt`.
fn held_instead(dir: &Path) -> String {
    let of = |exts: &[&str], starts: &[&str]| {
        let names = files_named(dir, exts, starts);
        (!names.is_empty()).then(|| some_of(&names, 1))
    };
    if let Some(f) = of(&[".bin", ".pt", ".pth"], &["pytorch_model", "model", "consolidated"]) {
        format!("; the folder holds {f}, PyTorch's format, which gridlm does not read: save the model as safetensors (transformers' `save_pretrained` does by default)")
    } else if let Some(f) = of(&[".gguf"], &[""]) {
        format!("; the folder holds {f}: {}", super::gguf::CONVERT_HINT)
    } else if let Some(f) = of(&[".safetensors"], &[""]) {
        format!("; the folder holds {f}, but no model.safetensors.index.json")
    } else {
        String::new()
    }
}

impl Checkpoint {
    /// Finds `DIR/model.safetensors` or `DIR/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let index = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index_path, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::file(&index_path, "missing object `weight_map`"))?;
            let mut index = HashMap::new();
            for (t, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    Error::file(&index_path, format!("weight_map entry `{t}` is not a file name"))
                })?;
                index.insert(t.clone(), f.to_string());
            }
            Some(index)
        } else if single.exists() {
            None
        } else {
            return Err(Error::file(
                &single,
                format!(
                    "not found (expected model.safetensors or model.safetensors.index.json){}",
                    held_instead(dir)
                ),
            ));
        };
        let origin = if index.is_some() { index_path } else { single };
        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            index,
            origin,
            files: RefCell::new(HashMap::new()),
            text_model: None,
            bare: false,
        };
        // Plain `model.*` names, or those of an image-and-text folder's text model.
        let holds = |ckpt: &Checkpoint, name: &str| -> Result<bool> {
            Ok(match &ckpt.index {
                Some(index) => index.contains_key(name),
                None => ckpt.file("model.safetensors")?.tensors.contains_key(name),
            })
        };
        // GPT-2's tensors without `transformer.`: none named under it, some of its own there.
        let bare = |names: &mut dyn Iterator<Item = &String>| {
            let (mut under, mut own) = (false, false);
            for n in names {
                under |= n.starts_with("transformer.");
                own |= n.starts_with("h.0.") || n == "wte.weight" || n == "wpe.weight";
            }
            own && !under
        };
        ckpt.bare = match &ckpt.index {
            Some(index) => bare(&mut index.keys()),
            None => bare(&mut ckpt.file("model.safetensors")?.tensors.keys()),
        };
        if !holds(&ckpt, "model.embed_tokens.weight")? {
            for prefixes in TEXT_MODEL_PREFIXES {
                if holds(&ckpt, &format!("{}embed_tokens.weight", prefixes.0))? {
                    ckpt.text_model = Some(prefixes);
                }
            }
        }
        Ok(ckpt)
    }

    /// The name tensor `name` is stored under.
    fn stored<'a>(&self, name: &'a str) -> std::borrow::Cow<'a, str> {
        if self.bare {
            return name.strip_prefix("transformer.").unwrap_or(name).into();
        }
        let Some((model, head)) = self.text_model else { return name.into() };
        match (name.strip_prefix("model."), name.strip_prefix("lm_head.")) {
            (Some(rest), _) => format!("{model}{rest}").into(),
            (_, Some(rest)) => format!("{head}{rest}").into(),
            _ => name.into(),
        }
    }

    fn file(&self, name: &str) -> Result<Rc<MappedFile>> {
        if let Some(f) = self.files.borrow().get(name) {
            return Ok(f.clone());
        }
        let f = Rc::new(MappedFile::open(self.dir.join(name))?);
        self.files.borrow_mut().insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// The file holding tensor `name`, opened if needed.
    fn file_of(&self, name: &str) -> Result<Rc<MappedFile>> {
        let file_name = match &self.index {
            Some(index) => index
                .get(name)
                .ok_or_else(|| Error::tensor(&self.origin, name, "missing from the checkpoint"))?
                .as_str(),
            None => "model.safetensors",
        };
        self.file(file_name)
    }

    fn info(&self, name: &str, expected_shape: &[usize]) -> Result<(Rc<MappedFile>, Range<usize>, DType)> {
        let stored = self.stored(name);
        let name = stored.as_ref();
        let file = self.file_of(name)?;
        let info = file
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(&file.path, name, "missing from the checkpoint"))?;
        if info.shape != expected_shape {
            return Err(Error::tensor(
                &file.path,
                name,
                format!("shape {:?} disagrees with config.json (expected {:?})", info.shape, expected_shape),
            ));
        }
        let (bytes, dtype) = (info.bytes.clone(), info.dtype);
        Ok((file, bytes, dtype))
    }
}

impl Source for Checkpoint {
    /// Rows `rows` of a tensor of 2 or more dimensions, or elements `rows` of a 1-D one.
    fn rows(&self, name: &str, expected_shape: &[usize], rows: Range<usize>) -> Result<Mat> {
        let (file, bytes, dtype) = self.info(name, expected_shape)?;
        let cols = matrix_dims(expected_shape).1;
        let row_bytes = cols * dtype.size_bytes();
        let start = bytes.start + rows.start * row_bytes;
        let end = bytes.start + rows.end * row_bytes;
        let data = Data::from_le_bytes(dtype, &file.map[start..end]);
        Ok(Mat { rows: rows.len(), cols, data })
    }

    /// Columns `cols` of rows `rows` of a tensor of 2 or more dimensions (o_proj and down_proj
    /// shards, an expert's of a stacked down tensor).
    fn block(
        &self,
        name: &str,
        expected_shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Mat> {
        let (file, tensor_bytes, dtype) = self.info(name, expected_shape)?;
        let n_cols = matrix_dims(expected_shape).1;
        let es = dtype.size_bytes();
        let mut bytes = Vec::with_capacity(rows.len() * cols.len() * es);
        for r in rows.clone() {
            let row0 = tensor_bytes.start + r * n_cols * es;
            bytes.extend_from_slice(&file.map[row0 + cols.start * es..row0 + cols.end * es]);
        }
        Ok(Mat { rows: rows.len(), cols: cols.len(), data: Data::from_le_bytes(dtype, &bytes) })
    }

    fn dtype(&self, name: &str, expected_shape: &[usize]) -> Result<DType> {
        Ok(self.info(name, expected_shape)?.2)
    }
}

#[cfg(test)]
mod tests {
    /// Error lines name the first few of a folder's files and count the rest.
    #[test]
    fn some_names_and_how_many_more() {
        let names: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        assert_eq!(super::some_of(&names, 1), "a and 3 more");
        assert_eq!(super::some_of(&names, 3), "a, b, c and 1 more");
        assert_eq!(super::some_of(&names[..2], 3), "a, b");
        assert_eq!(super::some_of(&names[..1], 1), "a");
    }
}
