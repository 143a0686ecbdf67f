//! `gridlm bench`: statistics and the report. Owns: turning timings, byte counts and measured
//! machine limits into the numbers users compare (latency percentiles, tokens/s, GB/s, GFLOP/s,
//! efficiencies). The measuring itself is done by the engine and `kernels::limits`.

use crate::config::ModelConfig;
use serde::Serialize;

/// Per-rank figures, gathered to the driver.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    pub rank: usize,
    pub stage: usize,
    pub tp: usize,
    pub weight_bytes: u64,
    pub rss_bytes: u64,
    pub weight_rss_bytes: u64,
    /// Weight bytes a decode step reads on this rank (of a mixture of experts, those its
    /// steps' tokens chose, as counted: `Shard::bytes_per_step`).
    pub bytes_per_token: u64,
    /// Keys and values of one position on this rank (all its layers and KV heads, in the KV
    /// cache's dtype): what attention reads per position a token sees.
    pub kv_bytes_per_position: u64,
    /// Per decode step on this rank (ms): from taking the plan to finishing its part, split
    /// into compute and the time inside allreduce, allgather and point-to-point calls (waiting
    /// for the stage before included).
    pub step_ms: f64,
    pub compute_ms: f64,
    pub allreduce_ms: f64,
    pub allgather_ms: f64,
    pub sendrecv_ms: f64,
    /// Heap allocations per decode step on this rank, kernel threads included (`None` where
    /// they are not counted).
    pub allocations_per_step: Option<f64>,
    /// How the rank's one-token products prefetch (`none`, `near`, `far`, `nta` or `page`,
    /// [`crate::kernels::Fetch`]), what decided it (`timed`, `GRIDLM_PREFETCH` or `default`),
    /// and how many timings of every way it took (1, or 2 where the first would have left
    /// `page`; 0 where it was not timed).
    pub prefetch: String,
    pub prefetch_by: String,
    pub prefetch_timings: usize,
    /// How its many-token bf16 products on AVX512_BF16 stream their weights (`l2`, `nta` or
    /// `whole`, [`crate::kernels::ManyFetch`]), what decided it (`timed`, `GRIDLM_MANY_PREFETCH` or
    /// `default`: not timed, as for a run of one token a step), and its timings (as above,
    /// the second where the first would have left `whole`).
    pub many_prefetch: String,
    pub many_prefetch_by: String,
    pub many_prefetch_timings: usize,
    /// With `--compare-batch`: the many-token way the baseline batch ran under, picked at its
    /// own tokens a step, what decided it and its timings (as above; null otherwise).
    pub baseline_many_prefetch: Option<String>,
    pub baseline_many_prefetch_by: Option<String>,
    pub baseline_many_prefetch_timings: Option<usize>,
    /// With `--compare-prefetch`: the one-token way the baseline ran under, and what decided
    /// it (`--compare-prefetch`; null otherwise).
    pub baseline_prefetch: Option<String>,
    pub baseline_prefetch_by: Option<String>,
    /// Which pieces of its one-token products the AVX2 kernels read in three streams (`long`:
    /// from 1 MiB on; `every`: every piece; [`crate::kernels::Streams`]), what decided it
    /// (`timed`, `GRIDLM_STREAMS` or `default`: not timed, as where no AVX2 kernel reads them)
    /// and its timings (as above, the second where the first would have left `long`).
    pub streams: String,
    pub streams_by: String,
    pub streams_timings: usize,
    /// With `--compare-streams`: the streams the baseline's one-token products read in, and
    /// what decided it (`--compare-streams`; null otherwise).
    pub baseline_streams: Option<String>,
    pub baseline_streams_by: Option<String>,
    /// The kernels the rank runs: its SIMD path ([`crate::kernels::dot::Isa`]: `portable`,
    /// `avx2`, `avx512` or `avx512bf16`) and, for int8 weights, how their products are summed
    /// ([`crate::kernels::dot::Int8Path`]: `portable`, `maddubs`, `avx-vnni` or `avx512-vnni`).
    pub isa: String,
    pub int8_kernel: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub weight_dtype: String,
    pub kv_dtype: String,
    pub pp: usize,
    pub tp: usize,
    pub threads_per_rank: usize,
    pub prompt_len: usize,
    pub new_tokens: usize,
    pub batch: usize,
    /// Groups the batch was split into, and whether their steps overlapped in the pipeline.
    pub micro_batches: usize,
    pub overlap: bool,
    pub temperature: f32,
    pub reps: usize,
    /// Latency, decode speed, bytes, bandwidth and each timed run (keys at the top level).
    #[serde(flatten)]
    pub decode: DecodeFigures,
    pub prefill_tokens_per_s: f64,
    /// When decode's bandwidth was read: `between_steps` (a slice of the probe's buffer after each
    /// step, every rank at once, its time left out of the step times) or `around_runs` (before
    /// and after each run; where steps overlap in a pipeline, or when asked).
    pub bandwidth_reads: &'static str,
    /// The fastest read before or after the timed runs (every rank's, summed).
    pub best_gb_per_s: f64,
    pub prefill_gflops: f64,
    pub measured_peak_gflops: f64,
    pub prefill_efficiency: f64,
    /// The bf16 dot-product peak where the bf16 kernels multiply with `vdpbf16ps` (null
    /// elsewhere; [`crate::kernels::limits::bf16_peak_gflops`]), and prefill's GFLOP/s over it
    /// where the weights are bf16 (null otherwise): the instruction's own limit, where
    /// `prefill_efficiency` is against the f32 FMA peak.
    pub measured_bf16_peak_gflops: Option<f64>,
    pub prefill_bf16_efficiency: Option<f64>,
    /// The kernel team's handoff around the timed runs, in µs (the median of the readings;
    /// the slowest rank's): one empty job to every thread and back
    /// ([`crate::kernels::limits::handoff_us`]).
    pub handoff_us: f64,
    /// With `--compare-unquantized`, `--compare-batch` or `--compare-prefetch`: what these runs
    /// were compared with, run in turn with them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
    pub ranks: Vec<RankReport>,
}

/// What the driver measured of one side's timed runs (those bench reports on, or their
/// baseline), in order: each run's first-token latency (the median over its sequences), decode
/// rate and [`tokens_digest`], and the gaps between tokens of all of them.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub firsts: Vec<f64>,
    pub rates: Vec<f64>,
    pub digests: Vec<u64>,
    pub gaps: Vec<f64>,
}

/// A fingerprint of the tokens a run generated: 64-bit FNV-1a over each sequence in order,
/// its length (u64) and then its tokens (u32), little-endian. The same prompts on the same
/// weights give the same digest in every rep; with it two runs of bench (two grid layouts, two
/// builds, a comparison's side and the same side run alone) can be checked to have computed
/// the same tokens.
pub fn tokens_digest<'a>(sequences: impl IntoIterator<Item = &'a [u32]>) -> u64 {
    sequences.into_iter().fold(crate::FNV1A_START, |h, seq| {
        let h = crate::fnv1a_more(h, &(seq.len() as u64).to_le_bytes());
        seq.iter().fold(h, |h, t| crate::fnv1a_more(h, &t.to_le_bytes()))
    })
}

/// A digest as the report gives it: 16 hexadecimal digits.
pub fn digest_hex(d: u64) -> String {
    format!("{d:016x}")
}

/// One side's decode figures, from its timed runs: the report's own and its baseline's are
/// computed the same way ([`DecodeFigures::new`]).
#[derive(Debug, Clone, Serialize)]
pub struct DecodeFigures {
    pub first_token_ms: f64,
    pub next_token_ms_p50: f64,
    pub next_token_ms_p90: f64,
    pub decode_tokens_per_s: f64,
    pub weight_bytes_per_token: u64,
    /// Keys and values attention reads for a decode token, on average over the decode window
    /// ([`kv_positions_per_token`] × every rank's bytes per position).
    pub kv_bytes_per_token: u64,
    /// What decode reads from memory, weights and keys and values, per second.
    pub achieved_gb_per_s: f64,
    /// Read bandwidth while the timed runs ran (every rank's reads, summed; the mean of the
    /// runs', as `decode_tokens_per_s` is the mean of their rates): decode's measure.
    pub measured_gb_per_s: f64,
    pub decode_efficiency: f64,
    /// The [`tokens_digest`] of the tokens every timed run generated, where all gave the same;
    /// null where they differ, which would be a fault: every run decodes the same prompts on
    /// the same weights with the same sampling seed (one a process without `--seed`).
    pub tokens_digest: Option<String>,
    /// CPU time a hypervisor took from the ranks' CPUs during the timed runs (their
    /// [`RunReport::stolen_ms`] summed); null where a rank's system does not say.
    pub stolen_ms: Option<f64>,
    /// Each timed run on its own, in order: on a host whose bandwidth wanders, the spread
    /// between runs shows how much of a low efficiency is the host's.
    pub runs: Vec<RunReport>,
}

impl DecodeFigures {
    /// From the driver's measurements `m` and, per timed run in the same order, the bandwidth
    /// read with it, the team's handoff around it and the CPU time stolen during it
    /// ([`run_reports`]). Bytes are per decode token: the weights' (every rank's) and the keys
    /// and values attention reads.
    pub fn new(m: &Measured, weight_bytes_per_token: u64, kv_bytes_per_token: u64, by_run: &ByRun) -> Self {
        let bytes_per_token = weight_bytes_per_token + kv_bytes_per_token;
        let decode_tokens_per_s = mean(&m.rates);
        let achieved_gb_per_s = bytes_per_token as f64 * decode_tokens_per_s / 1e9;
        // The runs' mean, as decode's rate is theirs: their efficiencies' spread holds this one.
        let measured_gb_per_s = mean(&by_run.gb_per_s);
        let runs = run_reports(&m.rates, &m.digests, by_run, bytes_per_token);
        DecodeFigures {
            first_token_ms: percentile(&m.firsts, 0.5),
            next_token_ms_p50: percentile(&m.gaps, 0.5),
            next_token_ms_p90: percentile(&m.gaps, 0.9),
            decode_tokens_per_s,
            weight_bytes_per_token,
            kv_bytes_per_token,
            achieved_gb_per_s,
            measured_gb_per_s,
            decode_efficiency: achieved_gb_per_s / measured_gb_per_s,
            tokens_digest: m
                .digests
                .first()
                .filter(|&&d| m.digests.iter().all(|&e| e == d))
                .map(|&d| digest_hex(d)),
            stolen_ms: runs.iter().map(|r| r.stolen_ms).sum(),
            runs,
        }
    }
}

/// What a bench's runs are compared with, run in turn with them on the same engine: the same
/// weights unquantized (`--compare-unquantized`), another batch size (`--compare-batch`), or
/// another one-token prefetch way (`--compare-prefetch`).
/// Every warm-up and rep runs both, one right after the other, so the two meet the same moments
/// of a host whose bandwidth wanders, and their speeds compare without its drift between two
/// separate runs of bench.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    pub weight_dtype: String,
    pub batch: usize,
    /// With `--compare-prefetch`: the one-token prefetch way the baseline ran under (null
    /// otherwise).
    pub prefetch: Option<String>,
    /// With `--compare-streams`: which pieces of one-token products the baseline read in three
    /// streams (`long` or `every`; null otherwise).
    pub streams: Option<String>,
    #[serde(flatten)]
    pub decode: DecodeFigures,
    /// The compared runs' decode tokens/s over these (each the mean of its runs' rates).
    pub speedup: f64,
    /// Per rep, the compared run's decode rate over the baseline run's beside it.
    pub speedup_by_rep: Vec<f64>,
    /// The speed-up were both to read memory at the same rate: the compared runs' decode tokens
    /// per GB/s of their bandwidth readings over these runs' (`speedup` × this
    /// `measured_gb_per_s` ÷ the report's). Runs a second apart can still meet different reads
    /// on a shared host (the two placements of its cores).
    pub speedup_at_same_reads: f64,
    /// How the two sides took turns.
    pub alternated: Alternated,
}

/// How the two sides of a comparison take turns (`alternated` in the report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alternated {
    /// Each warm-up and rep one run of both, their steps in turn, so both meet the same moments.
    Steps,
    /// Whole runs in turn, where a side runs micro-batches of a pipeline.
    Runs,
}

impl Baseline {
    /// The baseline's figures (`decode`, of `weight_dtype` weights at `batch` sequences, under
    /// the one-token way `prefetch` and `streams` where it has its own) and the speed-ups of
    /// the runs compared with it (`compared`), rep by rep in the same order; `alternated` as
    /// the field says.
    #[allow(clippy::too_many_arguments)] // what the baseline ran, its figures, the compared ones
    pub fn new(
        weight_dtype: String,
        batch: usize,
        prefetch: Option<String>,
        streams: Option<String>,
        decode: DecodeFigures,
        compared: &DecodeFigures,
        alternated: Alternated,
    ) -> Self {
        let rate = |r: &RunReport| r.decode_tokens_per_s;
        let speedup = compared.decode_tokens_per_s / decode.decode_tokens_per_s;
        Baseline {
            weight_dtype,
            batch,
            prefetch,
            streams,
            alternated,
            speedup,
            speedup_by_rep: compared.runs.iter().zip(&decode.runs).map(|(c, b)| rate(c) / rate(b)).collect(),
            speedup_at_same_reads: speedup * decode.measured_gb_per_s / compared.measured_gb_per_s,
            decode,
        }
    }
}

/// The mean of `v` (0 when empty).
pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// One timed run: its decode rate, the read bandwidth of the readings between its steps or
/// just before and just after it ([`BenchReport::bandwidth_reads`]; every rank's, summed),
/// the efficiency of the two, the team's handoff read just before and just after it (their
/// mean; the slowest rank's), the CPU time a hypervisor took from a rank's CPUs from just
/// before to just after it, and the [`tokens_digest`] of what it generated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    pub decode_tokens_per_s: f64,
    pub measured_gb_per_s: f64,
    pub decode_efficiency: f64,
    pub handoff_us: f64,
    /// [`crate::host::stolen_ms`] over the run, summed over its CPUs (the most any rank lost;
    /// null where a rank's system does not say). Time stolen from a virtual CPU while it
    /// decodes lengthens the steps but not the bandwidth readings between them, so a run that
    /// lost much of its time to the host reads a low efficiency that is not the kernels'.
    pub stolen_ms: Option<f64>,
    /// The same as a share of the time of the rank's CPUs over the run (the largest of any
    /// rank's); from [`STOLEN_SHARE`] up the report warns.
    pub stolen_share: Option<f64>,
    pub tokens_digest: String,
}

/// Per timed run, in order, what the ranks read beside it: the bandwidth (summed over ranks),
/// the handoff (the slowest rank's) and the CPU time stolen ([`RunReport::stolen_ms`]; NaN
/// where unknown).
#[derive(Debug, Clone, Default)]
pub struct ByRun {
    pub gb_per_s: Vec<f64>,
    pub handoff_us: Vec<f64>,
    pub stolen_ms: Vec<f64>,
    pub stolen_share: Vec<f64>,
}

impl ByRun {
    /// The runs whose place `k` in this order `keep` takes (one side's of a comparison).
    pub fn only(&self, keep: impl Fn(usize) -> bool) -> ByRun {
        let pick = |v: &[f64]| v.iter().enumerate().filter(|(k, _)| keep(*k)).map(|(_, &x)| x).collect();
        ByRun {
            gb_per_s: pick(&self.gb_per_s),
            handoff_us: pick(&self.handoff_us),
            stolen_ms: pick(&self.stolen_ms),
            stolen_share: pick(&self.stolen_share),
        }
    }
}

/// Read bandwidth of `readings` ((bytes, seconds) each) together, in GB/s: all their bytes over
/// all their time, every read counted (a run's bandwidth from the whole reads around it; those
/// between its steps are too short for it, see [`median_gb_per_s`] and [`run_gb_per_s`]).
pub fn gb_per_s(readings: &[(f64, f64)]) -> f64 {
    let (bytes, secs) = readings.iter().fold((0.0, 0.0), |a, r| (a.0 + r.0, a.1 + r.1));
    bytes / secs.max(1e-9) / 1e9
}

/// Read bandwidth of a run from the short readings between its steps, in GB/s: the median of
/// their rates. Each reads a sixteenth of the probe buffer in about a millisecond, so a single
/// pause of the virtual CPU (tens to hundreds of milliseconds on a shared host) inside one of
/// them would outweigh all the others in [`gb_per_s`] and halve the run's bandwidth, or worse,
/// where the same pause among its steps' hundreds of milliseconds moves decode by a few per
/// cent. The median is the bandwidth of a typical moment between the steps; without pauses it
/// sits 1–3% above all bytes over all time.
pub fn median_gb_per_s(readings: &[(f64, f64)]) -> f64 {
    let rates: Vec<f64> = readings.iter().map(|r| r.0 / r.1.max(1e-12) / 1e9).collect();
    percentile(&rates, 0.5)
}

/// Fewest readings in a stretch of [`run_gb_per_s`].
pub const STRETCH: usize = 16;

/// Read bandwidth of a run from the readings between its steps (one after each), in GB/s: the
/// run cut into stretches of at least [`STRETCH`] readings, each stretch's
/// [`median_gb_per_s`], and the harmonic mean of those, each weighted by its readings. Its
/// steps read the same bytes each, so where the bandwidth changes within a run (the cores
/// moved apart or together), a step's time goes as one over the bandwidth of its moment: the
/// harmonic mean is what the run's decode rate is to be set against. The median of the whole
/// run set it against the spell that held most of its steps: on Zen 4 a rep whose first steps
/// met reads of ~63 GB/s and the rest ~37 came out at 0.72 of the median, 63.4, where its reps
/// before and after gave 0.87–0.96 within one spell. Inside a stretch the median still guards
/// against a paused reading, as it did for the whole run. A run of fewer than twice
/// [`STRETCH`] readings is one stretch: its median.
pub fn run_gb_per_s(readings: &[(f64, f64)]) -> f64 {
    let stretches = (readings.len() / STRETCH).max(1);
    let (mut n, mut time) = (0.0, 0.0);
    for k in 0..stretches {
        let part = &readings[k * readings.len() / stretches..(k + 1) * readings.len() / stretches];
        let gb = median_gb_per_s(part);
        if gb > 0.0 {
            n += part.len() as f64;
            time += part.len() as f64 / gb;
        }
    }
    if time > 0.0 {
        n / time
    } else {
        0.0
    }
}

/// Read bandwidth around each run, in GB/s, from one rank's readings in order: `readings[k]`
/// is (bytes, seconds) of the reading before run `k`, `readings[k + 1]` of the one after it.
/// A run's bandwidth is [`gb_per_s`] of those two.
pub fn gb_per_s_around_runs(readings: &[(f64, f64)]) -> Vec<f64> {
    readings.windows(2).map(gb_per_s).collect()
}

/// A figure read with each bandwidth reading (the team's handoff), per run: the mean of the
/// readings just before and just after it, as [`gb_per_s_around_runs`] pairs them.
pub fn mean_around_runs(readings: &[f64]) -> Vec<f64> {
    readings.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

/// A run whose bandwidth readings came in under this fraction of the fastest read of the
/// limits taken before and after the runs met a stall of the host, not its memory: in one run
/// on the 2-core Zen 5 machine the readings between its steps fell to 5.2 GB/s through most
/// of it (the fastest read ~80) while decode went at its usual rate, for an efficiency of
/// 9.46. The two placements of the cores read 26–54 and 46–85 GB/s, so a run in the slower
/// placement, with the limits read in the faster, stays above it (26 of 85 is 0.31).
pub const STALLED_READS: f64 = 0.25;

/// The runs (numbered from 1) whose bandwidth readings (`gb_per_s`, per run) fell under
/// [`STALLED_READS`] of `best`, the fastest read of the limits.
pub fn stalled_runs(gb_per_s: &[f64], best: f64) -> Vec<usize> {
    (1..=gb_per_s.len()).filter(|&i| gb_per_s[i - 1] < STALLED_READS * best).collect()
}

/// Each run's report from its decode rate, its tokens' digest, what was read beside it
/// ([`ByRun`]) and the bytes read per generated token.
pub fn run_reports(rates: &[f64], digests: &[u64], by_run: &ByRun, bytes_per_token: u64) -> Vec<RunReport> {
    rates
        .iter()
        .zip(digests)
        .zip(&by_run.gb_per_s)
        .zip(&by_run.handoff_us)
        .zip(by_run.stolen_ms.iter().zip(&by_run.stolen_share))
        .map(|((((&tps, &digest), &gb), &handoff_us), (&stolen, &share))| RunReport {
            decode_tokens_per_s: tps,
            measured_gb_per_s: gb,
            decode_efficiency: bytes_per_token as f64 * tps / 1e9 / gb,
            handoff_us,
            stolen_ms: (!stolen.is_nan()).then_some(stolen),
            stolen_share: (!share.is_nan()).then_some(share),
            tokens_digest: digest_hex(digest),
        })
        .collect()
}

/// Decode throughput of sequences run side by side, from each sequence's token arrival times
/// (ms): tokens per second inside the window where every sequence is decoding — after the last
/// first token, up to the first last token — and the gaps between consecutive tokens inside
/// it. Outside the window some sequences are still prefilling (one micro-batch's prompts may
/// hold the pipeline while another decodes) or already done, so it is not steady decode.
/// `None` when the window holds no gap.
pub fn decode_window(times: &[&[f64]]) -> Option<(f64, Vec<f64>)> {
    let firsts: Option<Vec<f64>> = times.iter().map(|t| t.first().copied()).collect();
    let start = firsts?.into_iter().fold(f64::NEG_INFINITY, f64::max);
    let end = times.iter().filter_map(|t| t.last().copied()).fold(f64::INFINITY, f64::min);
    let mut gaps = Vec::new();
    let mut tokens = 0usize;
    for t in times {
        for w in t.windows(2) {
            if w[0] >= start && w[1] <= end {
                gaps.push(w[1] - w[0]);
            }
        }
        tokens += t.iter().filter(|&&x| x > start && x <= end).count();
    }
    (end > start && !gaps.is_empty()).then(|| (tokens as f64 / ((end - start) / 1e3), gaps))
}

/// Positions a decode token's attention reads, on average over the tokens the decode rate is
/// measured on (the second to the last of `new_tokens` after a prompt of `prompt_len`, as
/// [`decode_window`] counts them for sequences of equal length): new token `k` comes from the
/// step that feeds token `k − 1` at position `prompt_len + k − 1`, which sees `prompt_len + k`
/// positions, or `window` of them under a sliding window.
pub fn kv_positions_per_token(prompt_len: usize, new_tokens: usize, window: Option<usize>) -> f64 {
    let seen = |k: usize| (prompt_len + k).min(window.unwrap_or(usize::MAX));
    let tokens = new_tokens.saturating_sub(1);
    (1..new_tokens).map(seen).sum::<usize>() as f64 / tokens.max(1) as f64
}

/// The `q`-quantile (0..=1) of `v`, by nearest rank.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

/// Floating-point operations of a prefill of `n` tokens over the whole model: every Linear
/// (2 flops per weight per token; of a mixture of experts, the router and the experts a token
/// chooses), attention scores and weighted sums over the (query, key)
/// pairs each layer's window lets through (the causal triangle for a global layer), and the
/// output head for the last position only.
pub fn prefill_flops(cfg: &ModelConfig, n: usize) -> f64 {
    let h = cfg.hidden_size as f64;
    let qd = cfg.q_dim() as f64;
    let attention_weights = cfg.attention_params();
    let ffn_weights: f64 = (0..cfg.n_layers).map(|i| cfg.ffn_params_per_token(i)).sum();
    let linear = 2.0 * (attention_weights * cfg.n_layers as f64 + ffn_weights) * n as f64;
    // Position `p` sees `min(p + 1, window)` keys.
    let pairs = |w: Option<usize>| (0..n).map(|p| (p + 1).min(w.unwrap_or(usize::MAX))).sum::<usize>() as f64;
    let attention: f64 = (0..cfg.n_layers).map(|i| 2.0 * 2.0 * qd * pairs(cfg.layer_window(i))).sum();
    linear + attention + 2.0 * cfg.vocab_size as f64 * h
}

/// [`kv_positions_per_token`] averaged over the model's layers, each through its own window.
pub fn kv_positions_per_layer_token(cfg: &ModelConfig, prompt_len: usize, new_tokens: usize) -> f64 {
    let layers = cfg.n_layers.max(1);
    (0..layers).map(|i| kv_positions_per_token(prompt_len, new_tokens, cfg.layer_window(i))).sum::<f64>()
        / layers as f64
}

/// A run that lost this share of its CPUs' time or more to the host (its
/// [`RunReport::stolen_share`]) is named in a warning. On the 2-core Zen 4 test machine a
/// SmolLM2 batch-8 run started right after a bench of the llama-3.2-1b shape (whose exit
/// handed ~3.5 GB back to the host) lost 260 ms in one rep of ~1.9 s on two CPUs (~7%) and
/// decoded at 542 tokens/s against 847 in its next rep, which lost none; runs that did not
/// follow such an exit lost 0–30 ms (under 1%).
pub const STOLEN_SHARE: f64 = 0.05;

/// A run that decoded faster than this share of the bandwidth read with it is named in a
/// warning: its readings read slower than its own steps did, so its efficiency overstates the
/// kernels'. The kernels stream at up to ~1.1 of the probe; on the 2-core Zen 4 test machine
/// one run of the llama-3.2-1b shape came out at 1.34 and 1.44 in its two reps, its readings
/// at 21.6-23.1 GB/s while it decoded at the rate of the runs reading 33-36.
pub const OVERSTATED: f64 = 1.25;

/// The runs `note` has a note on, each as "`what`run i of n (its note)", numbered from 1.
fn named_runs(runs: &[RunReport], what: &str, note: impl Fn(&RunReport) -> Option<String>) -> Vec<String> {
    let n = runs.len();
    runs.iter().zip(1..).filter_map(|(r, i)| Some(format!("{what}run {i} of {n} ({})", note(r)?))).collect()
}

/// The runs whose efficiency exceeds [`OVERSTATED`], each as "`what`run i of n (its
/// efficiency)", numbered from 1.
pub fn overstated_runs(runs: &[RunReport], what: &str) -> Vec<String> {
    named_runs(runs, what, |r| {
        (r.decode_efficiency > OVERSTATED).then(|| format!("{:.2}", r.decode_efficiency))
    })
}

/// The runs that lost [`STOLEN_SHARE`] or more of their CPU time to the host, each as
/// "`what`run i of n (its stolen time and share)", numbered from 1.
pub fn robbed_runs(runs: &[RunReport], what: &str) -> Vec<String> {
    named_runs(runs, what, |r| {
        let share = r.stolen_share.filter(|&s| s >= STOLEN_SHARE)?;
        Some(format!("{:.0} ms, {:.0}%", r.stolen_ms.unwrap_or(0.0), share * 100.0))
    })
}

impl BenchReport {
    /// One line naming the runs whose efficiency exceeds [`OVERSTATED`], if any.
    pub fn overstated_warning(&self) -> Option<String> {
        let all = self.both_sides(true, overstated_runs);
        (!all.is_empty()).then(|| {
            format!(
                "warning: {} decoded faster than {OVERSTATED} of the bandwidth read beside its steps: the readings read slower than the steps ran, so the efficiency overstates the kernels'",
                all.join(" and ")
            )
        })
    }

    /// `named` of the report's runs, then of its baseline's ("baseline run ..."): always where
    /// `always`, else only where the baseline's runs were not these same runs (whole runs in
    /// turn rather than step by step).
    fn both_sides(&self, always: bool, named: fn(&[RunReport], &str) -> Vec<String>) -> Vec<String> {
        let mut all = named(&self.decode.runs, "");
        if let Some(b) = self.baseline.as_ref().filter(|b| always || b.alternated == Alternated::Runs) {
            all.extend(named(&b.decode.runs, "baseline "));
        }
        all
    }

    /// Every warning line of the report, in order.
    pub fn warnings(&self) -> Vec<String> {
        [self.stall_warning(), self.stolen_warning(), self.overstated_warning()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// One line naming the runs that lost [`STOLEN_SHARE`] or more of their CPU time to the
    /// host, if any (the baseline's only where its runs were not the same runs as these).
    pub fn stolen_warning(&self) -> Option<String> {
        let all = self.both_sides(false, robbed_runs);
        (!all.is_empty()).then(|| {
            format!(
                "warning: the host took {}% or more of the CPUs' time during {}, which slows those runs by its doing, not the kernels'",
                STOLEN_SHARE * 100.0,
                all.join(" and ")
            )
        })
    }

    /// One line naming the runs whose bandwidth readings look stalled ([`stalled_runs`]), if
    /// any: their efficiencies say nothing about the kernels.
    pub fn stall_warning(&self) -> Option<String> {
        let stalled = |runs: &[RunReport], what: &str| {
            let gb: Vec<f64> = runs.iter().map(|r| r.measured_gb_per_s).collect();
            let stalled = stalled_runs(&gb, self.best_gb_per_s);
            let list = stalled.iter().map(|i| format!("{i}")).collect::<Vec<_>>().join(", ");
            (!stalled.is_empty()).then(|| format!("{what}run {list} of {}", gb.len()))
        };
        let baseline = self.baseline.as_ref().and_then(|b| stalled(&b.decode.runs, "baseline "));
        let named: Vec<String> = stalled(&self.decode.runs, "").into_iter().chain(baseline).collect();
        (!named.is_empty()).then(|| {
            format!(
                "warning: the bandwidth readings of {} fell under {:.0}% of the fastest read ({:.1} GB/s): the host stalled them, so their efficiency is not the kernels'",
                named.join(" and "),
                STALLED_READS * 100.0,
                self.best_gb_per_s
            )
        })
    }

    /// A readable table.
    pub fn table(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        let d = &self.decode;
        let mut s = format!(
            "gridlm bench: {} ({}, KV cache {}), grid {}x{}, {}/rank, batch {}, prompt {}, {}, {}\n",
            self.model,
            self.weight_dtype,
            self.kv_dtype,
            self.pp,
            self.tp,
            crate::count(self.threads_per_rank, "thread"),
            self.batch,
            crate::count(self.prompt_len, "token"),
            crate::count(self.new_tokens, "new token"),
            crate::count(self.reps, "rep")
        );
        let rows = [
            ("first token", format!("{:.1} ms", d.first_token_ms)),
            ("next token p50 / p90", format!("{:.2} / {:.2} ms", d.next_token_ms_p50, d.next_token_ms_p90)),
            ("decode", format!("{:.1} tokens/s", d.decode_tokens_per_s)),
            ("tokens generated", digest_row(d)),
            ("prefill", format!("{:.1} tokens/s", self.prefill_tokens_per_s)),
            (
                "read per token",
                format!(
                    "{:.1} MB of weights, {:.2} MB of keys and values",
                    mb(d.weight_bytes_per_token),
                    mb(d.kv_bytes_per_token)
                ),
            ),
            (
                "decode bandwidth",
                format!(
                    "{:.1} GB/s of {:.1} GB/s measured {} = {:.2} (fastest read {:.1} GB/s)",
                    d.achieved_gb_per_s,
                    d.measured_gb_per_s,
                    self.bandwidth_reads.replace('_', " the "),
                    d.decode_efficiency,
                    self.best_gb_per_s
                ),
            ),
            (
                "kernel-thread handoff",
                format!("{:.2} µs around the runs (one empty job to every thread and back)", self.handoff_us),
            ),
            ("CPU time stolen", stolen_row(d)),
            (
                "prefill compute",
                format!(
                    "{:.1} GFLOP/s of {:.1} GFLOP/s measured = {:.2}{}",
                    self.prefill_gflops,
                    self.measured_peak_gflops,
                    self.prefill_efficiency,
                    match (self.measured_bf16_peak_gflops, self.prefill_bf16_efficiency) {
                        (Some(g), Some(e)) => format!(" (of the bf16 dot peak, {g:.1} GFLOP/s: {e:.2})"),
                        _ => String::new(),
                    }
                ),
            ),
        ];
        for (k, v) in rows {
            s += &format!("  {k:<24} {v}\n");
        }
        if d.runs.len() > 1 {
            let each = |f: fn(&RunReport) -> String| d.runs.iter().map(f).collect::<Vec<_>>().join(", ");
            s += &format!(
                "  {:<24} {} (read {}: {} GB/s; handoff around each {} µs)\n",
                "decode efficiency by run",
                each(|r| format!("{:.2}", r.decode_efficiency)),
                self.bandwidth_reads.replace('_', " the "),
                each(|r| format!("{:.1}", r.measured_gb_per_s)),
                each(|r| format!("{:.2}", r.handoff_us))
            );
        }
        if let Some(u) = &self.baseline {
            let b = &u.decode;
            let what = match (&u.prefetch, &u.streams) {
                (Some(way), _) => format!("prefetch {way}"),
                (None, Some(way)) => format!("streams {way}"),
                (None, None) if u.batch != self.batch => format!("batch {}", u.batch),
                (None, None) => format!("{} weights", u.weight_dtype),
            };
            let each = |v: &mut dyn Iterator<Item = f64>, places: usize| {
                v.map(|x| format!("{x:.places$}")).collect::<Vec<_>>().join(", ")
            };
            let rows = [
                (
                    format!("baseline: {what}"),
                    format!(
                        "decode {:.1} tokens/s, next token p50 / p90 {:.2} / {:.2} ms, {:.1} MB of weights a token",
                        b.decode_tokens_per_s,
                        b.next_token_ms_p50,
                        b.next_token_ms_p90,
                        mb(b.weight_bytes_per_token)
                    ),
                ),
                (
                    "  decode bandwidth".into(),
                    format!(
                        "{:.1} GB/s of {:.1} GB/s measured {} = {:.2}; by run {} (read {} GB/s)",
                        b.achieved_gb_per_s,
                        b.measured_gb_per_s,
                        self.bandwidth_reads.replace('_', " the "),
                        b.decode_efficiency,
                        each(&mut b.runs.iter().map(|r| r.decode_efficiency), 2),
                        each(&mut b.runs.iter().map(|r| r.measured_gb_per_s), 1)
                    ),
                ),
                ("  tokens generated".into(), digest_row(b)),
                (
                    "speed-up".into(),
                    format!(
                        "{:.2}x the baseline's decode tokens/s (by rep {}); {:.2}x at the same reads; {}",
                        u.speedup,
                        each(&mut u.speedup_by_rep.iter().copied(), 2),
                        u.speedup_at_same_reads,
                        match u.alternated {
                            Alternated::Steps => "run step by step in turn",
                            Alternated::Runs => "whole runs in turn",
                        }
                    ),
                ),
            ];
            for (k, v) in rows {
                s += &format!("  {k:<24} {v}\n");
            }
        }
        for r in &self.ranks {
            let allocs = r.allocations_per_step.map_or("not counted".into(), |a| format!("{a}"));
            s += &format!(
                "  rank {} (stage {}, tp {}): weights {:.1} MB, resident {:.1} MB; per decode step {:.2} ms = compute {:.2} + allreduce {:.2} + allgather {:.2} + send/recv {:.2}, {allocs} allocations; prefetch {} ({}){}, many tokens {} ({}){}; streams {} ({}){}; kernels {}{}\n",
                r.rank,
                r.stage,
                r.tp,
                mb(r.weight_bytes),
                mb(r.rss_bytes),
                r.step_ms,
                r.compute_ms,
                r.allreduce_ms,
                r.allgather_ms,
                r.sendrecv_ms,
                r.prefetch,
                by_timings(&r.prefetch_by, r.prefetch_timings),
                match (&r.baseline_prefetch, &r.baseline_prefetch_by) {
                    (Some(way), Some(by)) => format!(", the baseline's {way} ({by})"),
                    _ => String::new(),
                },
                r.many_prefetch,
                by_timings(&r.many_prefetch_by, r.many_prefetch_timings),
                match (&r.baseline_many_prefetch, &r.baseline_many_prefetch_by, r.baseline_many_prefetch_timings) {
                    (Some(way), Some(by), Some(n)) => format!(", the baseline's {way} ({})", by_timings(by, n)),
                    _ => String::new(),
                },
                r.streams,
                by_timings(&r.streams_by, r.streams_timings),
                match (&r.baseline_streams, &r.baseline_streams_by) {
                    (Some(way), Some(by)) => format!(", the baseline's {way} ({by})"),
                    _ => String::new(),
                },
                r.isa,
                r.int8_kernel.as_ref().map_or(String::new(), |k| format!(", int8 {k}"))
            );
        }
        for w in self.warnings() {
            s += &format!("  {w}\n");
        }
        s
    }
}

/// The table's line on what a side's timed runs generated: their digest, or each run's where
/// they differ.
fn digest_row(d: &DecodeFigures) -> String {
    match &d.tokens_digest {
        Some(digest) => format!("digest {digest} (the same in every rep)"),
        None => {
            let each: Vec<&str> = d.runs.iter().map(|r| r.tokens_digest.as_str()).collect();
            format!("digests {} (they differ between reps)", each.join(", "))
        }
    }
}

/// The table's line on the CPU time a hypervisor took from the ranks' CPUs during a side's
/// timed runs, and each run's where there are several.
fn stolen_row(d: &DecodeFigures) -> String {
    let Some(total) = d.stolen_ms else {
        return "not known (the system does not say)".into();
    };
    let mut row = format!("{total:.0} ms taken by the host during the timed runs");
    if d.runs.len() > 1 {
        let each: Vec<String> =
            d.runs.iter().filter_map(|r| r.stolen_ms).map(|ms| format!("{ms:.0}")).collect();
        row += &format!(" (by run {} ms)", each.join(", "));
    }
    row
}

/// What decided a prefetch way, for the table: `timed twice` where a second timing did.
fn by_timings(by: &str, timings: usize) -> String {
    if timings > 1 {
        format!("{by} twice")
    } else {
        by.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_window_skips_prefill_stalls() {
        // Sequence a decodes while b prefills (a's gap of 100 ms), then both every 10 ms.
        let a = [0.0, 10.0, 110.0, 120.0, 130.0, 140.0];
        let b = [105.0, 115.0, 125.0, 135.0, 145.0, 155.0];
        let (rate, gaps) = decode_window(&[&a, &b]).unwrap();
        // Window 105..140: a's tokens at 110..140 (4), b's at 115..135 (3) in 35 ms.
        assert!((rate - 7.0 / 0.035).abs() < 1e-6, "{rate}");
        assert_eq!(gaps, vec![10.0, 10.0, 10.0, 10.0, 10.0, 10.0]);
        assert!(decode_window(&[&[1.0][..]]).is_none());
    }

    #[test]
    fn a_pause_in_one_reading_between_steps_does_not_move_the_run() {
        // 64 MiB-like readings at 50 GB/s, one of them caught by a 100 ms pause.
        let mut r = vec![(64e6, 64e6 / 50e9); 15];
        r[7].1 += 0.1;
        assert!((median_gb_per_s(&r) - 50.0).abs() < 1e-9, "{}", median_gb_per_s(&r));
        assert!(gb_per_s(&r) < 10.0, "{}", gb_per_s(&r));
        let r = [(1e9, 0.1), (1e9, 0.05), (1e9, 0.02)];
        assert!((median_gb_per_s(&r) - 20.0).abs() < 1e-9);
        assert_eq!(median_gb_per_s(&[]), 0.0);
    }

    #[test]
    fn a_run_is_set_against_each_stretch_of_its_readings() {
        let at = |gb: f64| (64e6, 64e6 / (gb * 1e9));
        let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
        // One spell, one reading paused: the median of the whole, 50.
        let mut r = vec![at(50.0); 127];
        r[60] = at(5.0);
        r[126] = at(5.0);
        assert!(close(run_gb_per_s(&r), 50.0), "{}", run_gb_per_s(&r));
        // Two spells, 64 steps at 60 GB/s and 64 at 30: the steps' time is that of 128 at 40.
        let r: Vec<_> = (0..128).map(|i| at(if i < 64 { 60.0 } else { 30.0 })).collect();
        assert!(close(run_gb_per_s(&r), 40.0), "{}", run_gb_per_s(&r));
        // The whole run's median is one spell's.
        assert!(close(median_gb_per_s(&r), 30.0), "{}", median_gb_per_s(&r));
        // Up to 31 readings, one stretch: the median.
        let r: Vec<_> = (0..31).map(|i| at(if i < 10 { 60.0 } else { 30.0 })).collect();
        assert!(close(run_gb_per_s(&r), 30.0), "{}", run_gb_per_s(&r));
        assert_eq!(run_gb_per_s(&[]), 0.0);
    }

    #[test]
    fn each_run_is_set_against_the_readings_on_either_side() {
        // Readings of 10 GB in 1 s, 0.5 s and 1.5 s: 20 GB over 1.5 s around run 0, 20 GB over
        // 2 s around run 1.
        let gb = gb_per_s_around_runs(&[(10e9, 1.0), (10e9, 0.5), (10e9, 1.5)]);
        assert_eq!(gb.len(), 2);
        assert!((gb[0] - 20.0 / 1.5).abs() < 1e-9 && (gb[1] - 10.0).abs() < 1e-9, "{gb:?}");
        assert!(gb_per_s_around_runs(&[(10e9, 1.0)]).is_empty());
        assert_eq!(mean_around_runs(&[0.1, 0.3, 0.5]), vec![0.2, 0.4]);
        assert!(mean_around_runs(&[0.1]).is_empty());
        assert!((gb_per_s(&[(10e9, 1.0), (10e9, 0.5), (10e9, 1.5)]) - 10.0).abs() < 1e-9);
        // 250 MB per token at 40 and 30 tokens/s: 10 and 7.5 GB/s.
        let by_run = ByRun {
            gb_per_s: vec![12.5, 10.0],
            handoff_us: vec![0.1, 0.6],
            stolen_ms: vec![0.0, 20.0],
            stolen_share: vec![0.0, 0.01],
        };
        let runs = run_reports(&[40.0, 30.0], &[7, 7], &by_run, 250_000_000);
        assert!((runs[0].decode_efficiency - 0.8).abs() < 1e-9, "{runs:?}");
        assert!((runs[1].decode_efficiency - 0.75).abs() < 1e-9, "{runs:?}");
        assert_eq!(runs[1].measured_gb_per_s, 10.0);
        assert_eq!((runs[0].handoff_us, runs[1].handoff_us), (0.1, 0.6));
        assert_eq!((runs[0].stolen_ms, runs[1].stolen_ms), (Some(0.0), Some(20.0)));
        assert_eq!(runs[1].tokens_digest, "0000000000000007");
        // One side's runs, by their places.
        let second = by_run.only(|k| k == 1);
        assert_eq!(
            (second.gb_per_s, second.handoff_us, second.stolen_share),
            (vec![10.0], vec![0.6], vec![0.01])
        );
        // A side's stolen time is its runs' summed, and unknown if any run's is.
        let m =
            Measured { firsts: vec![1.0; 2], rates: vec![40.0, 30.0], digests: vec![7, 7], gaps: vec![25.0] };
        assert_eq!(DecodeFigures::new(&m, 250_000_000, 0, &by_run).stolen_ms, Some(20.0));
        let unknown = ByRun { stolen_ms: vec![0.0, f64::NAN], stolen_share: vec![0.0, f64::NAN], ..by_run };
        let d = DecodeFigures::new(&m, 250_000_000, 0, &unknown);
        assert_eq!((d.stolen_ms, d.runs[1].stolen_ms), (None, None));
    }

    #[test]
    fn the_tokens_digest_sees_every_token_and_where_sequences_end() {
        // FNV-1a 64 of no bytes is its offset basis.
        assert_eq!(tokens_digest(std::iter::empty::<&[u32]>()), 0xcbf2_9ce4_8422_2325);
        let d = |seqs: &[&[u32]]| tokens_digest(seqs.iter().copied());
        let base = d(&[&[1, 2], &[3]]);
        assert_eq!(base, d(&[&[1, 2], &[3]]));
        for other in [d(&[&[1], &[2, 3]]), d(&[&[2, 1], &[3]]), d(&[&[1, 2, 3]]), d(&[&[3], &[1, 2]])] {
            assert_ne!(base, other);
        }
        assert_eq!(digest_hex(0xab), "00000000000000ab");
    }

    #[test]
    fn runs_whose_reads_stalled_are_named() {
        // Fastest read 80 GB/s: a run read at 5.2 is stalled, one at 26 (the slower placement
        // of the cores) is not.
        assert_eq!(stalled_runs(&[75.0, 5.2, 26.0, 19.9], 80.0), vec![2, 4]);
        // Runs that lost 5% of their CPU time or more to the host; unknown shares are not named.
        let run = |ms: f64, share: Option<f64>| RunReport {
            decode_tokens_per_s: 1.0,
            measured_gb_per_s: 1.0,
            decode_efficiency: 1.0,
            handoff_us: 0.1,
            stolen_ms: share.map(|_| ms),
            stolen_share: share,
            tokens_digest: digest_hex(1),
        };
        let runs = [run(260.0, Some(0.09)), run(10.0, Some(0.004)), run(0.0, None), run(70.0, Some(0.05))];
        assert_eq!(
            robbed_runs(&runs, "baseline "),
            vec!["baseline run 1 of 4 (260 ms, 9%)", "baseline run 4 of 4 (70 ms, 5%)"]
        );
        assert!(robbed_runs(&runs[1..3], "").is_empty());
        // Runs above 1.25 of their readings.
        let at = |e: f64| RunReport { decode_efficiency: e, ..run(0.0, None) };
        assert_eq!(overstated_runs(&[at(1.1), at(1.44), at(1.25)], ""), vec!["run 2 of 3 (1.44)"]);
        assert!(stalled_runs(&[75.0, 26.0], 80.0).is_empty());
        assert!(stalled_runs(&[], 80.0).is_empty());
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 5.0);
        assert_eq!(percentile(&v, 0.9), 9.0);
        assert_eq!(percentile(&[3.0], 0.9), 3.0);
    }

    #[test]
    fn kv_positions_are_those_the_decode_window_steps_see() {
        // Tokens 2..=4 of 4 after 10: steps feeding positions 10, 11, 12 see 11, 12, 13.
        assert_eq!(kv_positions_per_token(10, 4, None), 12.0);
        assert_eq!(kv_positions_per_token(10, 4, Some(12)), (11.0 + 12.0 + 12.0) / 3.0);
        // No decode window, no reads counted.
        assert_eq!(kv_positions_per_token(10, 1, None), 0.0);
        assert_eq!(kv_positions_per_token(10, 0, None), 0.0);
        // Gemma 3's layers: the local ones through their window, the global one not.
        let mut cfg = crate::weights::synthetic::shape("gemma3-1b").unwrap();
        (cfg.n_layers, cfg.sliding_window) = (3, Some(12));
        cfg.local_layers = Some(vec![true, false, true]);
        assert_eq!(kv_positions_per_layer_token(&cfg, 10, 4), (2.0 * 35.0 / 3.0 + 12.0) / 3.0);
    }

    #[test]
    fn prefill_flops_counts_linears() {
        let cfg = crate::weights::synthetic::shape("llama-2-7b").unwrap();
        // ~6.5e9 weights in the layers: about 13 GFLOP per token.
        let per_token = prefill_flops(&cfg, 1) - 2.0 * 32000.0 * 4096.0;
        assert!((per_token / 1e9 - 12.95).abs() < 0.2, "{per_token}");
        // Attention: 4 flops per query dimension and (query, key) pair; 1 + 2 + 3 + 4 pairs of 4
        // positions on a global layer's causal triangle, 1 + 2 + 3 + 3 through a window of 3.
        let mut cfg = crate::weights::synthetic::shape("gemma3-1b").unwrap();
        (cfg.n_layers, cfg.sliding_window) = (3, Some(3));
        cfg.local_layers = Some(vec![true, false, true]);
        let (head, qd) = (2.0 * cfg.vocab_size as f64 * cfg.hidden_size as f64, cfg.q_dim() as f64);
        // One token: the Linears, the head and one pair a layer.
        let linear = prefill_flops(&cfg, 1) - head - 3.0 * 4.0 * qd;
        let attention = |n: usize| prefill_flops(&cfg, n) - head - n as f64 * linear;
        assert_eq!(attention(4), 4.0 * qd * (2.0 * 9.0 + 10.0));
    }
}
