//! int8 weights (`--quant int8`) on the real model stay close to bf16.

use super::*;
use gridlm::comm::Single;
use gridlm::engine::GenerateOptions;
use gridlm::kernels::Quant;
use gridlm::tokenizer::Tokenizer;

/// bf16 generates 64 greedy tokens; int8, forced along the same text, picks the same top-1 at
/// ≥ 90% of those 64 positions. (Inputs at 255 levels on every path: 63 and 60 with `vpdpbusd`
/// on Zen 5, 63 and 61 with `maddubs` on Zen 3, where at 129 levels it gave 59 and 59.)
#[test]
fn int8_top1_agrees_with_bf16_over_64_positions() {
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompts = [
        "The history of the Roman Empire began when",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ];
    let opts =
        GenerateOptions { max_tokens: 64, ignore_eos: true, eos_ids: vec![], keep_prompt_logits: false };
    let mut bf16 = local_engine(&dir, None);
    let mut int8 = local_engine(&dir, Some(Quant::Int8));
    assert_eq!(int8.shard.weight_dtype(), "int8");
    for p in prompts {
        let ids = tok.encode(p, true).unwrap();
        let reference = bf16.generate(&ids, &opts, &Single, &Single, |_| Ok(())).unwrap().token_ids;
        assert_eq!(reference.len(), 64);
        let picks = int8.greedy_along(&ids, &reference, &Single, &Single).unwrap();
        assert_eq!(picks.len(), 64);
        let same = picks.iter().zip(&reference).filter(|(a, b)| a == b).count();
        let kernel = gridlm::kernels::dot::int8_path().name();
        eprintln!("{p:?}: int8 top-1 agrees with bf16 at {same}/64 positions ({kernel})");
        assert!(same * 10 >= 64 * 9, "int8 agrees with bf16 at only {same}/64 positions for {p:?}");
    }
}
