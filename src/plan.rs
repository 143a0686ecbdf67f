//! `gridlm plan`: which grid layouts a cluster can hold and how fast each would run, from a
//! stated cost model. Owns the model; the inputs are the cluster's measured limits (as
//! `gridlm bench --limits` prints them) and its network.
//!
//! Cost model, per rank of each stage (ranks fill a node's slots first, as `launch/nodes`
//! places them, so a stage's tp ranks share a node when they fit):
//!
//! * memory: the rank's weights (its layers' slice, the embedding or output head slice) plus
//!   the KV cache of the batch at full length and the f32 buffers of the first step (all the
//!   batch's prompt tokens at once; on the last stage a row of logits for each sequence);
//! * a decode step of a stage: max(bytes read ÷ bandwidth per rank, FLOPs ÷ peak per rank),
//!   where bytes are the rank's weights (of a mixture of experts, the routers and the experts
//!   the step's tokens are expected to choose, `Moe::expected_experts`; FLOPs count those one
//!   token chooses) plus its KV cache read by attention, and the socket's
//!   peak is shared by the ranks on it (each has its cores). Its bandwidth is shared by the
//!   ranks on it that read at the same time: all of them where a pipeline's stages overlap,
//!   else only the stage's own (the stages take turns, and the others wait), each reading at
//!   most what its cores read alone (one core's bandwidth × its cores, where known; without
//!   it, every rank its cores' share of the socket's bandwidth, as if all read at once);
//! * each layer's two allreduces (and the embedding's one) over tp ranks: the faster of a ring
//!   (2 (tp − 1) messages of bytes/tp) and recursive doubling (⌈log2 tp⌉ messages of all the
//!   bytes), each message latency + bytes ÷ bandwidth of its link — shared memory inside a
//!   node, the network across nodes; the last stage's candidate allgather (tp − 1 messages);
//! * one message of hidden states per stage boundary, and one back to the driver;
//! * next-token latency: the stages one after another plus those messages; tokens/s at batch
//!   b: b ÷ latency, or with pp > 1 and b ≥ pp micro-batches overlapping, b ÷ (pp × the
//!   slowest stage's step on b/pp tokens);
//! * first token: the prompt's FLOPs ÷ peak (or bytes ÷ bandwidth, whichever is larger) per
//!   stage, plus the same communication with prompt-sized messages;
//! * the peak is the f32 FMA peak, or for bf16 weights the bf16 dot-product peak where the
//!   CPU has one (`vdpbf16ps`, twice the multiply-adds; `bench --limits` measures both).

use crate::bench::prefill_flops;
use crate::config::ModelConfig;
use crate::grid::{balanced_layers, heads_of};
use serde::Serialize;

/// The cluster and the workload.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub nodes: usize,
    pub sockets_per_node: usize,
    /// MPI ranks per socket (each with the socket's cores shared among them).
    pub ranks_per_socket: usize,
    /// Read bandwidth of one socket, GB/s (as `bench --limits` measures it).
    pub mem_gb_per_s: f64,
    /// f32 FMA peak of one socket, GFLOP/s.
    pub peak_gflops: f64,
    /// bf16 dot-product peak of one socket, GFLOP/s, where its bf16 kernels multiply with
    /// `vdpbf16ps` (AVX512_BF16; 0: not there or not known, bf16 weights then take
    /// `peak_gflops`).
    pub bf16_peak_gflops: f64,
    /// Read bandwidth of one core reading alone, GB/s, and the cores of a socket (0: not
    /// known; each rank then reads its share of the socket's bandwidth).
    pub core_gb_per_s: f64,
    pub cores_per_socket: usize,
    /// Memory of one socket, GB (0: not known, and then whether a layout fits is not either).
    pub mem_gb: f64,
    /// Network between nodes: bandwidth (Gbit/s) and one message's latency (µs).
    pub net_gbps: f64,
    pub net_latency_us: f64,
    /// Inside a node (shared memory): one message's latency (µs) and bandwidth (GB/s).
    pub local_latency_us: f64,
    pub local_gb_per_s: f64,
}

/// What runs on it.
#[derive(Debug, Clone)]
pub struct Workload {
    pub weight_bytes: f64,
    /// bf16 weights, not quantized: the products run at `Cluster::bf16_peak_gflops` where known.
    pub bf16: bool,
    pub kv_bytes: f64,
    pub prompt_len: usize,
    pub new_tokens: usize,
    pub batch: usize,
}

/// One layout's prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub pp: usize,
    pub tp: usize,
    pub ranks: usize,
    pub nodes_used: usize,
    /// Largest memory of any rank, bytes.
    pub mem_per_rank: f64,
    /// Whether that fits a rank's share of a socket's memory; `None` where it was not given.
    pub fits: Option<bool>,
    pub first_token_ms: f64,
    pub next_token_ms: f64,
    pub tokens_per_s: f64,
    /// Of the next-token latency: communication (ms).
    pub comm_ms: f64,
    /// tp groups or stage boundaries crossing the network.
    pub crosses_network: bool,
}

impl Cluster {
    fn slots_per_node(&self) -> usize {
        self.sockets_per_node * self.ranks_per_socket
    }
    fn node_of(&self, rank: usize) -> usize {
        rank / self.slots_per_node()
    }
    /// Ranks sharing the socket of `rank` when `ranks` ranks fill the slots in order.
    fn sharing(&self, rank: usize, ranks: usize) -> usize {
        let socket = rank / self.ranks_per_socket;
        let first = socket * self.ranks_per_socket;
        (ranks - first).min(self.ranks_per_socket)
    }
    /// The compute peak of one socket for `w`'s weights, GFLOP/s: the bf16 dot-product peak for
    /// bf16 weights where known, else the f32 FMA peak.
    fn peak_for(&self, w: &Workload) -> f64 {
        if w.bf16 && self.bf16_peak_gflops > 0.0 {
            self.bf16_peak_gflops
        } else {
            self.peak_gflops
        }
    }
    /// Ranks `first..first + n` on the socket of `first`.
    fn on_socket_of(&self, first: usize, n: usize) -> usize {
        let end = (first / self.ranks_per_socket + 1) * self.ranks_per_socket;
        (first + n).min(end) - first
    }
    /// Read bandwidth of a rank, bytes/s, on a socket it shares with `sharing` ranks of which
    /// `reading` read at the same time: the socket's split among those, but no more than the
    /// rank's cores read alone, and no less than its share of all (as when every rank reads).
    fn rank_bandwidth(&self, sharing: usize, reading: usize) -> f64 {
        let share = self.mem_gb_per_s / sharing as f64;
        if self.core_gb_per_s <= 0.0 || self.cores_per_socket == 0 {
            return share * 1e9;
        }
        let cores = (self.cores_per_socket / self.ranks_per_socket).max(1) as f64;
        let alone = (self.core_gb_per_s * cores).min(self.mem_gb_per_s);
        (self.mem_gb_per_s / reading as f64).min(alone).max(share) * 1e9
    }
    /// One message between ranks `a` and `b` of `bytes`, seconds.
    fn message(&self, a: usize, b: usize, bytes: f64) -> f64 {
        if self.node_of(a) == self.node_of(b) {
            self.local_latency_us * 1e-6 + bytes / (self.local_gb_per_s * 1e9)
        } else {
            self.net_latency_us * 1e-6 + bytes * 8.0 / (self.net_gbps * 1e9)
        }
    }
    /// An allreduce of `bytes` over the tp ranks starting at `first`, seconds: the faster of a
    /// ring (2 (tp − 1) steps of bytes/tp, each as slow as its slowest hop) and recursive
    /// doubling (⌈log2 tp⌉ steps of all the bytes, partners 1, 2, 4, ... apart), as MPI
    /// libraries choose by message size.
    fn allreduce(&self, first: usize, tp: usize, bytes: f64) -> f64 {
        if tp == 1 {
            return 0.0;
        }
        let slowest = |partner: &dyn Fn(usize) -> usize, b: f64| {
            (0..tp).map(|t| self.message(first + t, first + partner(t).min(tp - 1), b)).fold(0.0, f64::max)
        };
        let ring = 2.0 * (tp - 1) as f64 * slowest(&|t| (t + 1) % tp, bytes / tp as f64);
        let steps = tp.next_power_of_two().trailing_zeros() as usize;
        let doubling: f64 = (0..steps).map(|k| slowest(&|t| t ^ (1 << k), bytes)).sum();
        ring.min(doubling)
    }
}

/// Every layout of 1 up to all the cluster's slots, with its prediction, by ranks and then
/// stages.
pub fn layouts(cfg: &ModelConfig, c: &Cluster, w: &Workload) -> Vec<Prediction> {
    let slots = c.nodes.saturating_mul(c.slots_per_node());
    // At most a stage per layer and a tp rank per head: the pairs, not the slots, bound the
    // work (a cluster of millions of slots is listed as fast as one of hundreds).
    let mut grid: Vec<(usize, usize)> = (1..=cfg.n_layers.min(slots))
        .flat_map(|pp| (1..=cfg.n_heads.min(slots / pp)).map(move |tp| (pp, tp)))
        .collect();
    grid.sort_by_key(|&(pp, tp)| (pp * tp, pp));
    grid.into_iter().map(|(pp, tp)| predict(cfg, c, w, pp, tp)).collect()
}

/// The prediction for one layout.
pub fn predict(cfg: &ModelConfig, c: &Cluster, w: &Workload, pp: usize, tp: usize) -> Prediction {
    let ranks = pp * tp;
    let (h, hd) = (cfg.hidden_size as f64, cfg.head_dim as f64);
    let attention_params = cfg.attention_params();
    let head_params = cfg.vocab_size as f64 * h;
    // Weights one token multiplies by in the whole model (of a mixture of experts, the
    // experts it chooses).
    let active_params =
        (0..cfg.n_layers).map(|i| attention_params + cfg.ffn_params_per_token(i)).sum::<f64>() + head_params;
    let split = balanced_layers(cfg, pp);
    let ctx = (w.prompt_len + w.new_tokens) as f64;
    let b = w.batch as f64;
    // KV heads on the busiest tp rank (a KV head may live on two ranks).
    let kv_heads = (0..tp).map(|t| heads_of(cfg, tp, t).1.len()).max().unwrap_or(1) as f64;
    let mut mem_max: f64 = 0.0;
    let (mut decode_s, mut decode_comm, mut prefill_s, mut slowest_stage) = (0.0, 0.0, 0.0, 0.0f64);
    let mut crosses = false;
    let msg = |tokens: f64| tokens * h * 4.0;
    // With a batch of at least pp sequences, micro-batches keep every stage at work at once.
    let overlap = pp > 1 && w.batch >= pp;
    let socket_peak = c.peak_for(w);
    for (s, &layers) in split.iter().enumerate() {
        let first = s * tp;
        let start: usize = split[..s].iter().sum();
        let stage_layers = start..start + layers;
        let layers = layers as f64;
        let head = if s == pp - 1 { head_params / tp as f64 } else { 0.0 };
        // Of the stage's weights a rank holds, reads in a step of `tokens` tokens (of a
        // mixture of experts, those its tokens are expected to choose) and multiplies one
        // token by.
        let of_layers = |ffn: &dyn Fn(usize) -> f64| {
            (layers * attention_params + stage_layers.clone().map(ffn).sum::<f64>()) / tp as f64 + head
        };
        let params = of_layers(&|i| cfg.ffn_params(i));
        let read = |tokens: f64| of_layers(&|i| cfg.ffn_params_read(i, tokens.ceil() as usize));
        let active = of_layers(&|i| cfg.ffn_params_per_token(i));
        // The first stage holds the embedding for lookups; one stage with tied embeddings
        // holds a single copy for lookups and the head.
        let embed =
            if s == 0 && !(pp == 1 && cfg.tie_word_embeddings) { head_params / tp as f64 } else { 0.0 };
        let held = (params + embed) * w.weight_bytes;
        let kv = layers * kv_heads * hd * 2.0 * ctx * b * w.kv_bytes;
        // The buffers of the first step (every prompt at once, as bench runs it): each
        // token's residual stream, norm and hidden state, and its slices of the attention and
        // widest FFN activations (a product's outputs are its weights ÷ its inputs); on the
        // last stage each sequence's hidden state and logits over the rank's vocabulary shard.
        let widest_ffn = stage_layers.clone().map(|i| cfg.ffn_params_per_token(i)).fold(0.0, f64::max);
        let per_token = 3.0 * h + (attention_params + widest_ffn) / (h * tp as f64);
        let rows = if s == pp - 1 { b * (h + (cfg.vocab_size as f64 / tp as f64).ceil()) } else { 0.0 };
        let buffers = 4.0 * (b * w.prompt_len as f64 * per_token + rows);
        mem_max = mem_max.max(held + kv + buffers);
        let share = c.sharing(first, ranks);
        // Reading at the same time on the socket: every rank there where the stages overlap,
        // else this stage's ranks there (the stages take turns).
        let reading = if overlap { share } else { c.on_socket_of(first, tp) };
        let (bw, peak) = (c.rank_bandwidth(share, reading), socket_peak * 1e9 / share as f64);
        let tp_crosses = c.node_of(first) != c.node_of(first + tp - 1);
        crosses |= tp_crosses;
        // Decode step on `tokens` tokens per sequence-step, at full context.
        let step = |tokens: f64| {
            let bytes = read(tokens) * w.weight_bytes + kv * tokens / b.max(1.0);
            let flops = 2.0 * active * tokens;
            let mut comm = 2.0 * layers * c.allreduce(first, tp, msg(tokens));
            if s == 0 {
                comm += c.allreduce(first, tp, msg(tokens));
            }
            if s == pp - 1 {
                comm += (tp - 1) as f64 * c.message(first, first + 1.min(tp - 1), 8.0 * tokens);
            }
            ((bytes / bw).max(flops / peak), comm)
        };
        let (compute, comm) = step(b);
        decode_s += compute + comm;
        decode_comm += comm;
        if overlap {
            let (c1, m1) = step(b / pp as f64);
            slowest_stage = slowest_stage.max(c1 + m1);
        }
        // Prefill: the whole prompt of every sequence.
        let n = w.prompt_len as f64;
        let share_of_model = active / active_params;
        let flops = b * prefill_flops(cfg, w.prompt_len) * share_of_model.min(1.0);
        let p_comm = (2.0 * layers + (s == 0) as u8 as f64) * c.allreduce(first, tp, msg(n * b));
        prefill_s += (flops / peak).max(params * w.weight_bytes / bw) + p_comm;
        if s + 1 < pp {
            let next = (s + 1) * tp;
            crosses |= c.node_of(first) != c.node_of(next);
            let hop = c.message(first, next, msg(b));
            decode_s += hop;
            decode_comm += hop;
            prefill_s += c.message(first, next, msg(n * b));
            slowest_stage = slowest_stage.max(c.message(first, next, msg(b / pp as f64)));
        }
    }
    // The tokens back to the driver (rank 0, in the last stage itself when pp = 1).
    let back = if pp > 1 { c.message((pp - 1) * tp, 0, 16.0 * b) } else { 0.0 };
    decode_s += back;
    decode_comm += back;
    prefill_s += back;
    let tokens_per_s = if overlap { b / (pp as f64 * slowest_stage) } else { b / decode_s };
    let fits = (c.mem_gb > 0.0).then(|| mem_max <= c.mem_gb * 1e9 / c.ranks_per_socket as f64);
    Prediction {
        pp,
        tp,
        ranks,
        nodes_used: c.node_of(ranks - 1) + 1,
        mem_per_rank: mem_max,
        fits,
        first_token_ms: prefill_s * 1e3,
        next_token_ms: decode_s * 1e3,
        tokens_per_s,
        comm_ms: decode_comm * 1e3,
        crosses_network: crosses,
    }
}

/// The predictions as a Markdown table.
pub fn table(p: &[Prediction]) -> String {
    let mut s = String::from(
        "| layout | ranks | nodes | memory/rank (GB) | fits | first token (ms) | next token (ms) | of which comm (ms) | tokens/s |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in p {
        s += &format!(
            "| {}×{} | {} | {}{} | {:.2} | {} | {:.1} | {:.2} | {:.2} | {:.1} |\n",
            r.pp,
            r.tp,
            r.ranks,
            r.nodes_used,
            if r.crosses_network { " (network)" } else { "" },
            r.mem_per_rank / 1e9,
            match r.fits {
                Some(true) => "yes",
                Some(false) => "no",
                None => "—",
            },
            r.first_token_ms,
            r.next_token_ms,
            r.comm_ms,
            r.tokens_per_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(nodes: usize) -> Cluster {
        Cluster {
            nodes,
            sockets_per_node: 2,
            ranks_per_socket: 1,
            mem_gb_per_s: 100.0,
            peak_gflops: 2000.0,
            bf16_peak_gflops: 0.0,
            core_gb_per_s: 0.0,
            cores_per_socket: 0,
            mem_gb: 256.0,
            net_gbps: 25.0,
            net_latency_us: 20.0,
            local_latency_us: 2.0,
            local_gb_per_s: 20.0,
        }
    }

    fn work() -> Workload {
        Workload { weight_bytes: 2.0, bf16: true, kv_bytes: 2.0, prompt_len: 128, new_tokens: 64, batch: 1 }
    }

    /// The layouts are every pp × tp up to the slots with a stage per layer at most and a tp
    /// rank per head at most, by ranks then pp, as counting every rank count through gives
    /// them; a cluster of ten million slots takes no longer than its 80 × 64 pairs.
    #[test]
    fn layouts_are_every_pair_up_to_the_slots() {
        let cfg = crate::weights::synthetic::shape("smollm2-135m").unwrap();
        for nodes in [1, 3, 7, 40] {
            let c = cluster(nodes);
            let slots = nodes * c.slots_per_node();
            let mut want = Vec::new();
            for ranks in 1..=slots {
                for pp in (1..=ranks).filter(|pp| ranks % pp == 0) {
                    if ranks / pp <= cfg.n_heads && pp <= cfg.n_layers {
                        want.push((pp, ranks / pp));
                    }
                }
            }
            let got: Vec<_> = layouts(&cfg, &c, &work()).iter().map(|p| (p.pp, p.tp)).collect();
            assert_eq!(got, want, "{nodes} nodes");
        }
        let big = crate::weights::synthetic::shape("llama-2-70b").unwrap();
        assert_eq!(layouts(&big, &cluster(5_000_000), &work()).len(), big.n_layers * big.n_heads);
    }

    #[test]
    fn decode_is_bandwidth_over_bytes_on_one_rank() {
        let cfg = crate::weights::synthetic::shape("llama-3-8b").unwrap();
        let p = predict(&cfg, &cluster(1), &work(), 1, 1);
        // ~8B parameters of 2 bytes at 100 GB/s: ~160 ms, no communication.
        assert!((140.0..180.0).contains(&p.next_token_ms), "{p:?}");
        assert_eq!(p.comm_ms, 0.0);
        assert!(p.fits == Some(true) && !p.crosses_network);
    }

    #[test]
    fn more_ranks_more_bandwidth_until_the_network() {
        let cfg = crate::weights::synthetic::shape("llama-3-8b").unwrap();
        let all = layouts(&cfg, &cluster(2), &work());
        let get = |pp, tp| all.iter().find(|p| p.pp == pp && p.tp == tp).unwrap().clone();
        // Two sockets of one node: tp=2 nearly halves the latency.
        let (one, two) = (get(1, 1), get(1, 2));
        assert!(two.next_token_ms < 0.6 * one.next_token_ms, "{one:?} {two:?}");
        // tp=4 spans the network: 64 allreduces each pay its latency; pp=2 × tp=2 keeps them local.
        let (tp4, mixed) = (get(1, 4), get(2, 2));
        assert!(tp4.crosses_network && mixed.crosses_network);
        assert!(tp4.comm_ms > mixed.comm_ms, "{tp4:?} {mixed:?}");
        // 70B needs several sockets' memory.
        let big = crate::weights::synthetic::shape("llama-2-70b").unwrap();
        let mut c = cluster(2);
        c.mem_gb = 64.0;
        assert_eq!(predict(&big, &c, &work(), 1, 1).fits, Some(false));
        assert_eq!(predict(&big, &c, &work(), 1, 4).fits, Some(true));
        c.mem_gb = 0.0;
        assert_eq!(predict(&big, &c, &work(), 1, 1).fits, None, "no memory given: not known");
    }

    #[test]
    fn stages_taking_turns_read_at_what_their_cores_read_alone() {
        let cfg = crate::weights::synthetic::shape("llama-3-8b").unwrap();
        // One socket of 8 cores and 100 GB/s, two ranks on it, one core reading 30 GB/s.
        let mut c = cluster(1);
        (c.sockets_per_node, c.ranks_per_socket) = (1, 2);
        let unknown = predict(&cfg, &c, &work(), 2, 1);
        (c.core_gb_per_s, c.cores_per_socket) = (30.0, 8);
        let known = predict(&cfg, &c, &work(), 2, 1);
        // At batch 1 the stages take turns: each reads alone at min(100, 4 × 30) = 100 GB/s
        // where, not knowing what its 4 cores read, the model gives it half the socket's.
        assert!((known.next_token_ms / unknown.next_token_ms - 0.5).abs() < 0.01, "{known:?} {unknown:?}");
        // Two cores a rank read 60 GB/s alone.
        c.cores_per_socket = 4;
        let two = predict(&cfg, &c, &work(), 2, 1);
        assert!((two.next_token_ms / unknown.next_token_ms - 50.0 / 60.0).abs() < 0.01, "{two:?}");
        // tp ranks of one stage read at once: their share, whatever one core reads.
        assert_eq!(predict(&cfg, &c, &work(), 1, 2).next_token_ms, {
            let mut c = c.clone();
            c.core_gb_per_s = 0.0;
            predict(&cfg, &c, &work(), 1, 2).next_token_ms
        });
        // With a batch of pp sequences the stages overlap and share the socket again.
        let batch = Workload { batch: 2, ..work() };
        c.cores_per_socket = 8;
        let overlapped = predict(&cfg, &c, &batch, 2, 1);
        c.core_gb_per_s = 0.0;
        assert_eq!(overlapped.tokens_per_s, predict(&cfg, &c, &batch, 2, 1).tokens_per_s);
    }

    #[test]
    fn bf16_weights_compute_at_the_bf16_peak_where_known() {
        let cfg = crate::weights::synthetic::shape("llama-3-8b").unwrap();
        // A prompt long enough that prefill is bound by arithmetic, not reads.
        let long = Workload { prompt_len: 2048, ..work() };
        let mut c = cluster(1);
        let f32_peak = predict(&cfg, &c, &long, 1, 1);
        c.bf16_peak_gflops = 2.0 * c.peak_gflops;
        let bf16_peak = predict(&cfg, &c, &long, 1, 1);
        assert!((bf16_peak.first_token_ms / f32_peak.first_token_ms - 0.5).abs() < 0.01, "{bf16_peak:?}");
        // Decode at batch 1 reads its bytes, whatever the peak.
        assert_eq!(bf16_peak.next_token_ms, f32_peak.next_token_ms);
        // f16 weights, and int8 ones, are multiplied by f32 FMAs: the f32 peak.
        let f16 = Workload { bf16: false, ..long };
        c.bf16_peak_gflops = 0.0;
        let without = predict(&cfg, &c, &f16, 1, 1);
        c.bf16_peak_gflops = 2.0 * c.peak_gflops;
        assert_eq!(predict(&cfg, &c, &f16, 1, 1).first_token_ms, without.first_token_ms);
        assert_eq!(without.first_token_ms, f32_peak.first_token_ms);
    }
}
