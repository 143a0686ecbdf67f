//! How speed scales with ranks: `gridlm bench --json` results of several layouts turned into a
//! Markdown table and an SVG plot. Owns: reading the runs, speedup and parallel efficiency
//! against the single-rank run, whether every layout generated its tokens, and drawing. The
//! runs themselves come from `launch/scale`.

use crate::error::{Error, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

/// One layout's bench result.
#[derive(Debug, Clone)]
pub struct Run {
    pub pp: usize,
    pub tp: usize,
    /// How the ranks were placed (`local`, `sockets`, `emulated-nodes`, ...).
    pub placement: String,
    pub first_token_ms: f64,
    pub next_token_ms: f64,
    pub tokens_per_s: f64,
    /// Largest resident memory of any rank.
    pub rss_bytes: f64,
    /// Largest per-step time any rank spent in communication (ms), and that rank's step.
    pub comm_ms: f64,
    pub step_ms: f64,
    /// The digest of the tokens its runs generated (`tokens_digest`; none in the JSON of
    /// builds before it, or where the reps differed).
    pub tokens_digest: Option<String>,
    /// What it ran, the same for every layout of a sweep: model, weight and KV dtypes, prompt
    /// and new tokens, batch and temperature (those in the JSON, as text).
    pub workload: Vec<(&'static str, String)>,
}

impl Run {
    pub fn ranks(&self) -> usize {
        self.pp * self.tp
    }

    /// `tp only`, `pp only`, `pp × tp`, or `1 rank`.
    pub fn family(&self) -> &'static str {
        match (self.pp, self.tp) {
            (1, 1) => "1 rank",
            (1, _) => "tp only",
            (_, 1) => "pp only",
            _ => "pp × tp",
        }
    }

    /// Reads `gridlm bench --json` output; `placement` labels how it was launched.
    pub fn from_json(v: &Value, placement: &str) -> std::result::Result<Run, String> {
        let num = |k: &str| v[k].as_f64().ok_or_else(|| format!("no number `{k}`"));
        let ranks = v["ranks"].as_array().ok_or("no `ranks` list")?;
        let max_of = |f: &dyn Fn(&Value) -> f64| ranks.iter().map(f).fold(0.0, f64::max);
        let comm = |r: &Value| {
            ["allreduce_ms", "allgather_ms", "sendrecv_ms"]
                .iter()
                .map(|k| r[*k].as_f64().unwrap_or(0.0))
                .sum::<f64>()
        };
        let busiest = ranks.iter().max_by(|a, b| comm(a).total_cmp(&comm(b)));
        Ok(Run {
            pp: num("pp")? as usize,
            tp: num("tp")? as usize,
            placement: placement.to_string(),
            first_token_ms: num("first_token_ms")?,
            next_token_ms: num("next_token_ms_p50")?,
            tokens_per_s: num("decode_tokens_per_s")?,
            rss_bytes: max_of(&|r| r["rss_bytes"].as_f64().unwrap_or(0.0)),
            comm_ms: busiest.map_or(0.0, comm),
            step_ms: busiest.and_then(|r| r["step_ms"].as_f64()).unwrap_or(0.0),
            tokens_digest: v["tokens_digest"].as_str().map(str::to_string),
            workload: WORKLOAD
                .iter()
                .filter(|k| !v[**k].is_null())
                .map(|&k| (k, v[k].as_str().map_or_else(|| v[k].to_string(), str::to_string)))
                .collect(),
        })
    }
}

/// The bench JSON keys that say what a run ran, which every layout of a sweep shares.
const WORKLOAD: [&str; 7] =
    ["model", "weight_dtype", "kv_dtype", "prompt_len", "new_tokens", "batch", "temperature"];

/// Reads the runs of a sweep: files named `PPxTP[@placement].json`, each `gridlm bench --json`
/// output, all of one workload (a file of another, left from an earlier sweep in the same
/// folder say, is an error naming both). Sorted by ranks, then pp.
pub fn read_runs(files: &[impl AsRef<Path>]) -> Result<Vec<Run>> {
    let mut runs = Vec::new();
    for f in files {
        let f = f.as_ref();
        let at = |m: String| Error::Input(format!("{}: {m}", f.display()));
        let text = std::fs::read_to_string(f).map_err(|e| at(format!("cannot read: {e}")))?;
        let v: Value = serde_json::from_str(text.trim()).map_err(|e| at(format!("not bench JSON: {e}")))?;
        let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let placement = stem.split_once('@').map_or("local", |(_, p)| p);
        let run = Run::from_json(&v, placement).map_err(at)?;
        if let (Some(first), Some(f0)) = (runs.first(), files.first()) {
            if let Some((this, that)) = differ(&run, first) {
                let f0 = f0.as_ref().display();
                return Err(at(format!(
                    "a run of {this}, where {f0} ran {that}: a report compares the layouts of one workload"
                )));
            }
        }
        runs.push(run);
    }
    if runs.is_empty() {
        return Err(Error::Input("no bench results to report".into()));
    }
    runs.sort_by_key(|r| (r.ranks(), r.pp, r.placement.clone()));
    Ok(runs)
}

/// The settings of `a`'s workload that `b` gives otherwise (where both give them: older
/// builds' JSON lacks some), as `key=value` lists of each, or `None`.
fn differ(a: &Run, b: &Run) -> Option<(String, String)> {
    let (mut this, mut that) = (Vec::new(), Vec::new());
    for (k, v) in &a.workload {
        if let Some((_, w)) = b.workload.iter().find(|(kb, _)| kb == k).filter(|(_, w)| w != v) {
            this.push(format!("{k}={v}"));
            that.push(format!("{k}={w}"));
        }
    }
    (!this.is_empty()).then(|| (this.join(", "), that.join(", ")))
}

/// Tokens/s of the single-rank run, the base of speedups.
fn base(runs: &[Run]) -> Option<f64> {
    runs.iter().find(|r| r.ranks() == 1).map(|r| r.tokens_per_s)
}

/// Under the table, whether every layout generated the tokens the single-rank run did (by
/// their digests; nothing where that run has none).
fn tokens_line(runs: &[Run]) -> Option<String> {
    let base = runs.iter().find(|r| r.ranks() == 1)?;
    let digest = base.tokens_digest.as_deref()?;
    let name = |r: &Run| match r.placement.as_str() {
        "local" => format!("{}×{}", r.pp, r.tp),
        p => format!("{}×{} {p}", r.pp, r.tp),
    };
    let others: Vec<String> = runs
        .iter()
        .filter(|r| r.tokens_digest.as_deref() != Some(digest))
        .map(|r| format!("{} ({})", name(r), r.tokens_digest.as_deref().unwrap_or("no digest")))
        .collect();
    Some(if others.is_empty() {
        format!("Tokens: every layout generated the tokens {} did (digest {digest}).\n", name(base))
    } else {
        format!(
            "Tokens: {} generated other tokens than {} (digest {digest}). Layouts add their partial sums in another order, so a near-tie between two tokens can part them; more than that is a fault.\n",
            others.join(", "),
            name(base)
        )
    })
}

/// The Markdown table: one row per run, and whether every layout generated the same tokens.
pub fn table(runs: &[Run]) -> String {
    let b = base(runs);
    let mut s = String::from(
        "| layout | placement | ranks | first token (ms) | next token (ms) | tokens/s | speedup | parallel efficiency | resident MB/rank | comm ms/step |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let (speedup, eff) = match b {
            Some(b) if b > 0.0 => {
                let sp = r.tokens_per_s / b;
                (format!("{sp:.2}"), format!("{:.2}", sp / r.ranks() as f64))
            }
            _ => ("–".into(), "–".into()),
        };
        s += &format!(
            "| {}×{} | {} | {} | {:.1} | {:.2} | {:.1} | {} | {} | {:.0} | {:.2} of {:.2} |\n",
            r.pp,
            r.tp,
            r.placement,
            r.ranks(),
            r.first_token_ms,
            r.next_token_ms,
            r.tokens_per_s,
            speedup,
            eff,
            r.rss_bytes / 1e6,
            r.comm_ms,
            r.step_ms
        );
    }
    if let Some(line) = tokens_line(runs) {
        s += "\n";
        s += &line;
    }
    s
}

/// Draws tokens/s (left) and parallel efficiency (right) against ranks, one line per layout
/// family (each starting from the single-rank run), into an SVG file.
pub fn plot(runs: &[Run], path: &Path, title: &str) -> Result<()> {
    let err = |e: String| Error::Input(format!("{}: cannot draw the plot: {e}", path.display()));
    let b = base(runs).unwrap_or(0.0);
    let max_ranks = runs.iter().map(Run::ranks).max().unwrap_or(1).max(2);
    let max_tps = runs.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max) * 1.15;
    let families = ["tp only", "pp only", "pp × tp"];
    let colors = [RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44)];
    let series = |fam: &str, eff: bool| -> Vec<(f64, f64)> {
        runs.iter()
            .filter(|r| r.family() == fam || r.ranks() == 1)
            .map(|r| {
                let y = if eff && b > 0.0 { r.tokens_per_s / b / r.ranks() as f64 } else { r.tokens_per_s };
                (r.ranks() as f64, y)
            })
            .collect()
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let root = root.titled(title, ("sans-serif", 18)).map_err(|e| err(e.to_string()))?;
        let panels = root.split_evenly((1, 2));
        for (panel, eff) in panels.iter().zip([false, true]) {
            let (caption, ymax) =
                if eff { ("parallel efficiency", 1.2) } else { ("decode tokens/s", max_tps) };
            let mut chart = ChartBuilder::on(panel)
                .caption(caption, ("sans-serif", 15))
                .margin(12)
                .x_label_area_size(35)
                .y_label_area_size(50)
                .build_cartesian_2d(0.5f64..max_ranks as f64 + 0.5, 0f64..ymax)
                .map_err(|e| err(e.to_string()))?;
            chart
                .configure_mesh()
                .x_desc("ranks")
                .x_labels(max_ranks + 1)
                .x_label_formatter(&|x| format!("{x:.0}"))
                .light_line_style(WHITE)
                .draw()
                .map_err(|e| err(e.to_string()))?;
            for (fam, color) in families.iter().zip(colors) {
                let pts = series(fam, eff);
                if pts.len() < 2 && !pts.iter().any(|p| p.0 > 1.0) {
                    continue;
                }
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(|e| err(e.to_string()))?
                    .label(*fam)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(|e| err(e.to_string()))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerLeft)
                .border_style(BLACK)
                .background_style(WHITE.mix(0.8))
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    crate::write_whole(path, svg.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pp: usize, tp: usize, tps: f64) -> Run {
        Run {
            pp,
            tp,
            placement: "local".into(),
            first_token_ms: 10.0,
            next_token_ms: 1e3 / tps,
            tokens_per_s: tps,
            rss_bytes: 1e8,
            comm_ms: 0.5,
            step_ms: 5.0,
            tokens_digest: Some("00000000000000aa".into()),
            workload: Vec::new(),
        }
    }

    /// Two runs' workloads differ only in settings both give (older builds' JSON lacks some).
    #[test]
    fn workloads_differ_by_the_settings_both_give() {
        let (mut a, mut b) = (run(1, 1, 50.0), run(1, 2, 80.0));
        a.workload = vec![("model", "m".into()), ("prompt_len", "8".into()), ("temperature", "0.0".into())];
        b.workload = vec![("model", "m".into()), ("prompt_len", "8".into())];
        assert_eq!(differ(&a, &b), None);
        b.workload[1].1 = "9".into();
        b.workload.push(("temperature", "0.7".into()));
        let want = ("prompt_len=8, temperature=0.0".to_string(), "prompt_len=9, temperature=0.7".to_string());
        assert_eq!(differ(&a, &b), Some(want));
    }

    #[test]
    fn table_and_plot() {
        let runs = vec![run(1, 1, 50.0), run(1, 2, 80.0), run(2, 1, 45.0), run(2, 2, 120.0)];
        let t = table(&runs);
        assert_eq!(t.lines().count(), 2 + 4 + 2, "{t}");
        assert!(t.contains("| 1×2 | local | 2 | 10.0 | 12.50 | 80.0 | 1.60 | 0.80 |"), "{t}");
        assert!(
            t.ends_with("\nTokens: every layout generated the tokens 1×1 did (digest 00000000000000aa).\n"),
            "{t}"
        );
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("s.svg");
        plot(&runs, &svg, "test").unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg") && text.contains("tp only") && text.contains("pp × tp"), "{text}");
    }

    #[test]
    fn layouts_whose_tokens_differ_are_named() {
        let mut runs = vec![run(1, 1, 50.0), run(1, 2, 80.0), run(2, 1, 45.0), run(2, 2, 120.0)];
        runs[1].tokens_digest = Some("00000000000000bb".into());
        runs[3].placement = "emulated-nodes".into();
        runs[3].tokens_digest = None;
        let t = table(&runs);
        let line = "Tokens: 1×2 (00000000000000bb), 2×2 emulated-nodes (no digest) generated other tokens than 1×1 (digest 00000000000000aa).";
        assert!(t.contains(line), "{t}");
        // Without a single-rank run, or its digest, nothing to compare with.
        assert!(!table(&runs[1..]).contains("Tokens:"));
        runs[0].tokens_digest = None;
        assert!(!table(&runs).contains("Tokens:"));
    }
}
