//! SentencePiece's BPE written from its algorithm, not from HF's converter or the `tokenizers`
//! crate, to check the tokenizer gridlm's converter makes of a SentencePiece vocabulary: a
//! vocabulary learned by BPE from a corpus, laid out as SentencePiece lays out its BPE models,
//! and text encoded as SentencePiece encodes it (merge the adjacent pair whose joined piece
//! scores highest, the leftmost of equals, until no pair joins into a piece; a character
//! outside the vocabulary as its UTF-8 bytes' `<0xHH>` pieces).

use std::collections::HashMap;

/// The whitespace mark SentencePiece writes spaces as.
pub const SPACE: char = '\u{2581}';

/// A SentencePiece BPE vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte pieces, the learned
/// pieces in the order they were merged, then the single characters.
pub struct SentencePiece {
    pub pieces: Vec<String>,
    pub scores: Vec<f32>,
    /// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte.
    pub types: Vec<i32>,
    ids: HashMap<String, u32>,
}

impl SentencePiece {
    pub const UNK: u32 = 0;
    pub const BOS: u32 = 1;
    pub const EOS: u32 = 2;

    /// Learns `merges` merges from the words of `corpus` (each word after a space mark, as
    /// SentencePiece splits its training text), the most frequent adjacent pair each time (of
    /// equals, the least in string order).
    pub fn learn(corpus: &str, merges: usize) -> Self {
        // A word starts at its space mark: `▁a▁▁b` is `▁a`, `▁`, `▁b`.
        let mut words: HashMap<Vec<String>, usize> = HashMap::new();
        let text = normalize(corpus);
        let mut starts: Vec<usize> = text.match_indices(SPACE).map(|(i, _)| i).collect();
        starts.push(text.len());
        for pair in starts.windows(2) {
            let word: Vec<String> = text[pair[0]..pair[1]].chars().map(String::from).collect();
            *words.entry(word).or_default() += 1;
        }
        let mut chars: Vec<String> = words.keys().flatten().cloned().collect();
        chars.sort();
        chars.dedup();
        let mut learned: Vec<String> = Vec::new();
        for _ in 0..merges {
            let mut counts: HashMap<(String, String), usize> = HashMap::new();
            for (w, n) in &words {
                for p in w.windows(2) {
                    *counts.entry((p[0].clone(), p[1].clone())).or_default() += n;
                }
            }
            let Some(((a, b), _)) = counts.into_iter().max_by(|x, y| x.1.cmp(&y.1).then(y.0.cmp(&x.0)))
            else {
                break;
            };
            let joined = format!("{a}{b}");
            words = words
                .into_iter()
                .map(|(w, n)| {
                    let mut out: Vec<String> = Vec::with_capacity(w.len());
                    for s in w {
                        if out.last() == Some(&a) && s == b {
                            out.pop();
                            out.push(joined.clone());
                        } else {
                            out.push(s);
                        }
                    }
                    (out, n)
                })
                .collect();
            learned.push(joined);
        }
        let mut pieces: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.extend([6; 256]);
        let mut scores = vec![0.0; pieces.len()];
        for (i, p) in learned.into_iter().chain(chars).enumerate() {
            pieces.push(p);
            types.push(1);
            scores.push(-(i as f32));
        }
        let ids = pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
        SentencePiece { pieces, scores, types, ids }
    }

    /// The normal piece `p`'s id and score.
    fn piece(&self, p: &str) -> Option<(u32, f32)> {
        let &id = self.ids.get(p)?;
        (self.types[id as usize] == 1).then_some((id, self.scores[id as usize]))
    }

    /// `text`'s ids, as SentencePiece encodes it (a space mark put first, spaces as marks).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut symbols: Vec<String> = normalize(text).chars().map(String::from).collect();
        loop {
            let best = (0..symbols.len().saturating_sub(1))
                .filter_map(|i| Some((i, self.piece(&format!("{}{}", symbols[i], symbols[i + 1]))?.1)))
                .fold(None, |best: Option<(usize, f32)>, (i, s)| match best {
                    Some((_, b)) if b >= s => best,
                    _ => Some((i, s)),
                });
            let Some((i, _)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        let mut ids = Vec::new();
        for s in &symbols {
            match self.piece(s) {
                Some((id, _)) => ids.push(id),
                None => ids.extend(
                    s.bytes().map(|b| self.ids.get(&format!("<0x{b:02X}>")).copied().unwrap_or(Self::UNK)),
                ),
            }
        }
        ids
    }

    /// The text of `ids`: byte pieces as their bytes, marks as spaces, the first one dropped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let p = &self.pieces[id as usize];
            match self.types[id as usize] {
                6 => bytes.push(u8::from_str_radix(&p[3..5], 16).unwrap()),
                1 => bytes.extend(p.replace(SPACE, " ").bytes()),
                _ => {}
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        text.strip_prefix(' ').map(String::from).unwrap_or(text)
    }
}

/// `text` as SentencePiece's models for Llama normalize it: a space mark first, spaces as marks.
fn normalize(text: &str) -> String {
    format!("{SPACE}{}", text.replace(' ', &SPACE.to_string()))
}
