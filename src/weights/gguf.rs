//! A reader for GGUF files (llama.cpp's format): metadata, tensor directory, and dequantization
//! of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
//! IQ4_XS tensors to f32.

use crate::error::{Error, Result};
use half::{bf16, f16};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The four bytes a GGUF file begins with.
const MAGIC: &[u8; 4] = b"GGUF";

/// What to do with llama.cpp's files where a model folder was wanted, for error lines.
pub const CONVERT_HINT: &str = "`gridlm convert --gguf FILE --out DIR` makes a model folder of one";

/// Whether `path` is a file that begins as a GGUF file does.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == MAGIC
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// GGML tensor types gridlm can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    /// The 5-bit blocks of 32 (a fifth bit per element beside the nibbles). llama.cpp's
    /// quantizer writes them where a row is not a whole number of k-quant blocks (256): in a
    /// Q4_K_M file of a model 576, 896 or 1536 wide (SmolLM2, Qwen2-0.5B...) Q4_K falls back to
    /// Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and Q2_K and Q3_K to IQ4_NL.
    Q5_0,
    Q5_1,
    Q8_0,
    /// llama.cpp's "k-quants" (blocks of 256 in sub-blocks with scales of their own), as most
    /// GGUF files on the Hub hold them (Q4_K_M: Q4_K and Q6_K; Q5_K_M: Q5_K and Q6_K; Q3_K_M
    /// and Q2_K: Q3_K, Q2_K and the larger types for some tensors).
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// 4-bit indices into a fixed non-uniform table of 16 levels (`IQ4_LEVELS` in this
    /// module), blocks of 32 with one scale.
    Iq4Nl,
    /// IQ4_NL's indices in blocks of 256: eight sub-blocks of 32 with 6-bit scales of their own.
    Iq4Xs,
}

/// llama.cpp's 16 levels of IQ4_NL and IQ4_XS (`kvalues_iq4nl`).
const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            20 => GgmlType::Iq4Nl,
            23 => GgmlType::Iq4Xs,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2K => (256, 84),
            GgmlType::Q3K => (256, 110),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Iq4Nl => (32, 18),
            GgmlType::Iq4Xs => (256, 136),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorEntry {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
    /// Shape in row-major (HF) order: reversed GGML dims.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

pub struct Gguf {
    pub path: PathBuf,
    pub meta: HashMap<String, Value>,
    pub tensors: Vec<TensorEntry>,
    bytes: Vec<u8>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            Error::file(
                self.path,
                format!("truncated GGUF: needs {n} bytes at offset {} of {}", self.pos, self.buf.len()),
            )
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64()?;
        if n as usize > self.buf.len() {
            return Err(Error::file(
                self.path,
                format!("corrupt GGUF: {what} length {n} exceeds the file size"),
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.len("string")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| Error::file(self.path, "corrupt GGUF: a string is not UTF-8"))
    }
    fn value(&mut self, ty: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(self.take(1)?[0] as u64),
            1 => Value::I64(self.take(1)?[0] as i8 as i64),
            2 => {
                let b = self.take(2)?;
                Value::U64(u16::from_le_bytes([b[0], b[1]]) as u64)
            }
            3 => {
                let b = self.take(2)?;
                Value::I64(i16::from_le_bytes([b[0], b[1]]) as i64)
            }
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let elem_ty = self.u32()?;
                let n = self.len("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem_ty)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(Error::file(self.path, format!("corrupt GGUF: unknown value type {other}"))),
        })
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let mut c = Cursor { buf: &bytes, pos: 0, path };
        if c.take(4)? != MAGIC {
            return Err(super::unreadable(path, || "not a GGUF file (magic bytes are not `GGUF`)".into()));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::file(path, format!("unsupported GGUF version {version} (expected 2 or 3)")));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut meta = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty)?;
            meta.insert(key, v);
        }
        // The counts are checked against the file's size only: reserve for a plausible few.
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims > 4 {
                return Err(Error::file(
                    path,
                    format!("corrupt GGUF: tensor `{name}` has {n_dims} dimensions"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.len("dimension")?);
            }
            let ty_id = c.u32()?;
            let offset = c.u64()? as usize;
            raw.push((name, dims, ty_id, offset));
        }
        let alignment = meta.get("general.alignment").and_then(|v| v.as_u64()).unwrap_or(32) as usize;
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty_id, offset) in raw {
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                Error::tensor(
                    path,
                    &name,
                    format!(
                        "unsupported GGML type {ty_id} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)"
                    ),
                )
            })?;
            let corrupt = |what: &str| Error::tensor(path, &name, format!("corrupt GGUF: {what}"));
            let overflow = || corrupt(&format!("dimensions {dims:?} overflow"));
            let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(overflow)?;
            let (block, block_bytes) = ty.block();
            if !n.is_multiple_of(block) {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!("{n} elements is not a multiple of the block size {block}"),
                ));
            }
            let n_bytes = (n / block).checked_mul(block_bytes).ok_or_else(overflow)?;
            let offset = data_start.checked_add(offset).filter(|o| o.checked_add(n_bytes).is_some());
            let offset = offset.ok_or_else(|| corrupt("a data offset beyond any file"))?;
            if offset + n_bytes > bytes.len() {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!(
                        "data ends at byte {} beyond the end of the file ({} bytes): truncated",
                        offset + n_bytes,
                        bytes.len()
                    ),
                ));
            }
            tensors.push(TensorEntry { name, dims, ty, offset, n_bytes });
        }
        Ok(Gguf { path: path.to_path_buf(), meta, tensors, bytes })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Dequantizes a tensor to f32, row-major in HF order.
    pub fn dequantize(&self, t: &TensorEntry) -> Vec<f32> {
        dequantize(t.ty, &self.bytes[t.offset..t.offset + t.n_bytes])
    }

    /// Part `part` of `parts` equal parts of `t` along its outermost dimension (an expert of
    /// a stacked expert tensor), dequantized; `None` if a part does not end on a block.
    pub fn dequantize_part(&self, t: &TensorEntry, part: usize, parts: usize) -> Option<Vec<f32>> {
        let (block, block_bytes) = t.ty.block();
        let per_part = t.n_elements() / parts;
        if per_part * parts != t.n_elements() || !per_part.is_multiple_of(block) {
            return None;
        }
        let (len, at) = (per_part / block * block_bytes, t.offset + part * per_part / block * block_bytes);
        Some(dequantize(t.ty, &self.bytes[at..at + len]))
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes raw GGML blocks of type `ty` to f32.
pub fn dequantize(ty: GgmlType, raw: &[u8]) -> Vec<f32> {
    let (block, block_bytes) = ty.block();
    let mut out = Vec::with_capacity(raw.len() / block_bytes * block);
    match ty {
        GgmlType::F32 => {
            out.extend(raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        }
        GgmlType::F16 => out.extend(raw.chunks_exact(2).map(|b| f16_at(b, 0))),
        GgmlType::BF16 => out
            .extend(raw.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())),
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(block_bytes) {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            for b in raw.chunks_exact(block_bytes) {
                let d = f16_at(b, 0);
                let (m, qs) =
                    if ty == GgmlType::Q4_1 { (f16_at(b, 2), &b[4..20]) } else { (-8.0 * d, &b[2..18]) };
                // Low nibbles are elements 0..16, high nibbles 16..32.
                out.extend(qs.iter().map(|&q| (q & 0x0F) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // d, [Q5_1: m,] 32 fifth bits (element j's in bit j), 16 bytes of nibbles (low:
            // elements 0..16, high: 16..32); Q5_0 centred on 16 (`(q - 16) d`), Q5_1 offset by
            // m (`q d + m`), as llama.cpp computes them.
            let q5_1 = ty == GgmlType::Q5_1;
            for b in raw.chunks_exact(block_bytes) {
                let d = f16_at(b, 0);
                let (m, at) = if q5_1 { (f16_at(b, 2), 4) } else { (0.0, 2) };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 20];
                let value = |q: u8, j: usize| {
                    let v = (q | (((qh >> j) & 1) << 4) as u8) as i32;
                    if q5_1 {
                        v as f32 * d + m
                    } else {
                        (v - 16) as f32 * d
                    }
                };
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(q & 0x0F, j)));
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(q >> 4, j + 16)));
            }
        }
        GgmlType::Q2K => {
            // Sixteen bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit values, d, dmin: two
            // halves of 128 elements, each four shifts of 32 bytes' bit pairs, each shift two
            // sub-blocks of 16 with a pair of their own.
            for b in raw.chunks_exact(block_bytes) {
                let (scales, qs) = (&b[0..16], &b[16..80]);
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                for half in 0..2 {
                    let q = &qs[32 * half..32 * (half + 1)];
                    for shift in 0..4 {
                        for sub in 0..2 {
                            let sc = scales[8 * half + 2 * shift + sub];
                            let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
                            let q = &q[16 * sub..16 * (sub + 1)];
                            out.extend(q.iter().map(|&v| dl * ((v >> (2 * shift)) & 3) as f32 - ml));
                        }
                    }
                }
            }
        }
        GgmlType::Q3K => {
            // 32 bytes of high bits (element l + 32 i's in bit i of byte l), 64 bytes of 2-bit
            // values, twelve bytes of sixteen 6-bit scales (offset by 32), d: laid out as Q2_K's
            // values, a value 4 lower where its high bit is clear.
            for b in raw.chunks_exact(block_bytes) {
                let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
                let d = f16_at(b, 108);
                let scale = |j: usize| {
                    let low = if j < 8 { sc[j] & 0x0F } else { sc[j - 8] >> 4 };
                    let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
                    (low | high << 4) as i32 - 32
                };
                for half in 0..2 {
                    let q = &qs[32 * half..32 * (half + 1)];
                    for shift in 0..4 {
                        let bit = 1u8 << (4 * half + shift);
                        for sub in 0..2 {
                            let dl = d * scale(8 * half + 2 * shift + sub) as f32;
                            let range = 16 * sub..16 * (sub + 1);
                            out.extend(q[range.clone()].iter().zip(&hmask[range]).map(|(&v, &h)| {
                                let low = ((v >> (2 * shift)) & 3) as i32;
                                dl * (low - if h & bit != 0 { 0 } else { 4 }) as f32
                            }));
                        }
                    }
                }
            }
        }
        GgmlType::Iq4Nl => {
            // d, 16 bytes of indices into the table (low nibbles: elements 0..16, high: 16..32).
            for b in raw.chunks_exact(block_bytes) {
                iq4_sub_block(&b[2..18], f16_at(b, 0), &mut out);
            }
        }
        GgmlType::Iq4Xs => {
            // d, the scales' top two bits (sub-block j's in bits 2j, 2j + 1 of a u16), their low
            // nibbles (two sub-blocks a byte, the even one low), 8 × 16 bytes of indices laid
            // out as IQ4_NL's; each scale offset by 32.
            for b in raw.chunks_exact(block_bytes) {
                let d = f16_at(b, 0);
                let high = u16::from_le_bytes([b[2], b[3]]);
                for (j, qs) in b[8..136].chunks_exact(16).enumerate() {
                    let low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
                    let scale = (low | (((high >> (2 * j)) & 3) as u8) << 4) as i32 - 32;
                    iq4_sub_block(qs, d * scale as f32, &mut out);
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, [Q5_K: 32 bytes of fifth
            // bits,] 128 bytes of low nibbles: four runs of 64 elements, each two sub-blocks of
            // 32 (the low nibbles of 32 bytes, then their high nibbles).
            let q5 = ty == GgmlType::Q5K;
            for b in raw.chunks_exact(block_bytes) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if q5 { (&b[16..48], &b[48..176]) } else { (&b[16..16], &b[16..144]) };
                for run in 0..4 {
                    let q = &qs[32 * run..32 * (run + 1)];
                    for half in 0..2 {
                        let (sc, m) = k_scale_min(scales, 2 * run + half);
                        let (dl, ml) = (d * sc as f32, dmin * m as f32);
                        let bit = 1u8 << (2 * run + half);
                        out.extend(q.iter().zip(qh.iter().chain(std::iter::repeat(&0))).map(|(&q, &h)| {
                            let low = if half == 0 { q & 0x0F } else { q >> 4 };
                            let high = if h & bit != 0 { 16 } else { 0 };
                            dl * (low + high) as f32 - ml
                        }));
                    }
                }
            }
        }
        GgmlType::Q6K => {
            // 128 bytes of low nibbles, 64 of high bit pairs, sixteen i8 scales (one per 16
            // elements), d: two halves of 128 elements, each four runs of 32.
            for b in raw.chunks_exact(block_bytes) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let (ql, qh) =
                        (&b[64 * half..64 * (half + 1)], &b[128 + 32 * half..128 + 32 * (half + 1)]);
                    let sc = &b[192 + 8 * half..192 + 8 * (half + 1)];
                    for run in 0..4 {
                        out.extend((0..32).map(|l| {
                            let low =
                                if run < 2 { ql[l + 32 * run] & 0x0F } else { ql[l + 32 * (run - 2)] >> 4 };
                            let q = (low | ((qh[l] >> (2 * run)) & 3) << 4) as i32 - 32;
                            d * sc[l / 16 + 2 * run] as i8 as f32 * q as f32
                        }));
                    }
                }
            }
        }
    }
    out
}

/// 32 elements of IQ4_NL or IQ4_XS, `d` times the levels the 16 bytes `qs` index (low nibbles
/// first, then the high ones).
fn iq4_sub_block(qs: &[u8], d: f32, out: &mut Vec<f32>) {
    out.extend(qs.iter().map(|&q| d * IQ4_LEVELS[(q & 0x0F) as usize] as f32));
    out.extend(qs.iter().map(|&q| d * IQ4_LEVELS[(q >> 4) as usize] as f32));
}

/// Sub-block `j`'s 6-bit (scale, min) of a Q4_K or Q5_K block's 12 scale bytes: the first four
/// pairs in the low six bits of bytes 0–3 and 4–7; the last four in the nibbles of bytes 8–11,
/// their top two bits in the top bits of bytes 0–3 (scales) and 4–7 (mins).
fn k_scale_min(q: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    /// A GGUF file of one F32 tensor `t` with `dims` at data offset `offset`, padded to
    /// `size` bytes (the header's lengths are checked against the file's size).
    fn one_tensor(dims: &[u64], offset: u64, size: usize) -> Vec<u8> {
        one_tensor_of(0, dims, offset, size)
    }

    /// [`one_tensor`] of GGML type `ty`.
    fn one_tensor_of(ty: u32, dims: &[u64], offset: u64, size: usize) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.push(b't');
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        b.resize(size, 0);
        b
    }

    /// Crafted sizes and offsets are errors naming the tensor, not an overflow (a panic, or a
    /// wrapped size passing the file-size check).
    #[test]
    fn sizes_and_offsets_beyond_any_file_are_corrupt() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("x.gguf");
        for (dims, offset, want) in [
            (&[1u64 << 16; 4][..], 0, "dimensions [65536, 65536, 65536, 65536] overflow"),
            (&[1 << 16, 1 << 16, 1 << 15, 1 << 15], 0, "overflow"),
            (&[4], u64::MAX - 8, "a data offset beyond any file"),
            (&[4], 1 << 20, "beyond the end of the file"),
        ] {
            std::fs::write(&path, one_tensor(dims, offset, 70_000)).unwrap();
            let e = Gguf::open(&path).err().expect("an error").to_string();
            assert!(e.contains("`t`") && e.contains(want), "{dims:?} at {offset}: {e}");
        }
        std::fs::write(&path, one_tensor(&[4], 0, 70_000)).unwrap();
        assert_eq!(Gguf::open(&path).unwrap().tensors[0].n_bytes, 16);
    }

    /// A type gridlm cannot dequantize (IQ2_XXS, whose grids it does not hold) is one error
    /// naming the tensor and the type.
    #[test]
    fn an_unsupported_type_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("x.gguf");
        std::fs::write(&path, one_tensor_of(16, &[256], 0, 70_000)).unwrap();
        let e = Gguf::open(&path).err().expect("an error").to_string();
        assert!(e.contains("`t`") && e.contains("unsupported GGML type 16") && e.contains("IQ4_XS"), "{e}");
    }

    #[test]
    fn q4_1_block_layout() {
        let mut b = Vec::new();
        b.extend(f16_bytes(0.5));
        b.extend(f16_bytes(-1.0));
        b.extend((0..16u8).map(|i| (15 - i) << 4 | i));
        let v = dequantize(GgmlType::Q4_1, &b);
        assert_eq!(v.len(), 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[3], 0.5);
        assert_eq!(v[16], 15.0 * 0.5 - 1.0);
        assert_eq!(v[31], -1.0);
    }

    /// IQ4_NL indexes llama.cpp's table of 16 levels (`kvalues_iq4nl`), low nibbles first.
    #[test]
    fn iq4_nl_block_layout() {
        let mut b = Vec::new();
        b.extend(f16_bytes(0.5));
        b.extend((0..16u8).map(|i| (15 - i) << 4 | i));
        let v = dequantize(GgmlType::Iq4Nl, &b);
        assert_eq!(v.len(), 32);
        assert_eq!((v[0], v[7], v[8], v[15]), (-63.5, -5.0, 0.5, 56.5));
        assert_eq!((v[16], v[31]), (56.5, -63.5));
    }

    /// IQ4_XS: eight sub-blocks of 32, sub-block j's 6-bit scale (offset by 32) in nibble j of
    /// the four low-scale bytes and bits 2j, 2j + 1 of the u16 before them.
    #[test]
    fn iq4_xs_block_layout() {
        let ls: Vec<u8> = (0..8).map(|j| 33 + j).collect();
        let mut b = Vec::new();
        b.extend(f16_bytes(0.5));
        let high = ls.iter().enumerate().fold(0u16, |h, (j, &l)| h | ((l >> 4) as u16) << (2 * j));
        b.extend(high.to_le_bytes());
        b.extend(ls.chunks(2).map(|p| (p[0] & 0x0F) | (p[1] & 0x0F) << 4));
        b.extend([0x80u8; 128]);
        let v = dequantize(GgmlType::Iq4Xs, &b);
        assert_eq!(v.len(), 256);
        for j in 0..8 {
            let d = 0.5 * (1 + j) as f32;
            assert_eq!((v[32 * j], v[32 * j + 15]), (d * -127.0, d * -127.0), "sub-block {j}");
            assert_eq!((v[32 * j + 16], v[32 * j + 31]), (d, d), "sub-block {j}");
        }
    }

    #[test]
    fn q4_0_and_q8_0() {
        let mut b = Vec::new();
        b.extend(f16_bytes(2.0));
        b.extend([0x8Fu8; 16]);
        let v = dequantize(GgmlType::Q4_0, &b);
        assert_eq!((v[0], v[16]), ((15.0 - 8.0) * 2.0, 0.0));
        let mut b = Vec::new();
        b.extend(f16_bytes(0.25));
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &b);
        assert_eq!((v[0], v[31]), (-4.0, 15.0 * 0.25));
    }
}
