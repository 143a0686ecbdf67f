//! Several sequences through one engine at once: greedy results equal each prompt run alone.

use super::*;
use gridlm::comm::Single;
use gridlm::engine::{Finish, GenerateOptions};
use gridlm::tokenizer::Tokenizer;

#[test]
fn batch_of_eight_prompts_equals_each_prompt_alone() {
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let texts = [
        "The capital of France is",
        "def add(a, b):",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "1, 2, 3, 4,",
        "Water boils at",
        "The three primary colors are red,",
        "In 1969, the first humans to walk on the Moon were",
        "Hello",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let lens: std::collections::BTreeSet<usize> = prompts.iter().map(Vec::len).collect();
    assert!(lens.len() >= 5, "prompts of different lengths: {lens:?}");
    let eos = tok.eos_id().into_iter().collect::<Vec<_>>();
    let opts = GenerateOptions { max_tokens: 20, ignore_eos: false, eos_ids: eos, keep_prompt_logits: false };
    let mut e = local_engine(&dir, None);
    let batched = e.generate_batch(&prompts, &opts, &Single, &Single).unwrap();
    assert_eq!(batched.len(), prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let alone = e.generate(p, &opts, &Single, &Single, |_| Ok(())).unwrap();
        assert_eq!(batched[i].0, alone.token_ids, "prompt {i} ({:?}): batched differs from alone", texts[i]);
        assert_eq!(batched[i].1, alone.finish, "prompt {i}: finish reason");
    }
    // Each finished on its own: with EOS allowed, lengths may differ, never beyond the limit.
    assert!(batched.iter().all(|(t, f)| t.len() <= 20 && (*f == Finish::Eos || t.len() == 20)));
}
