//! Scaling: the sweep over layouts end to end, the planner, and `bench --limits`.

use super::*;
use gridlm_reference::{launch_command, repo_root, run_with_timeout};

/// `launch/scale` on a tiny model over 1×1, 1×2 and 2×1: one JSON per layout, a Markdown table
/// with a row per layout (speedups against 1×1) and the line saying all generated the same
/// tokens, and a non-empty SVG plot.
#[test]
fn sweep_writes_table_and_plot() {
    let (tmp, dir) = tiny_llama();
    let out = tmp.path().join("sweep");
    std::env::set_var("GRIDLM_BIN", bin());
    let mut cmd = launch_command(&["scale"]);
    cmd.args(["--layouts", "1x1,1x2,2x1", "--out", path_str(&out), "--"]);
    cmd.args(["--model", path_str(&dir), "--prompt-len", "8", "--new-tokens", "8", "--reps", "1"]);
    cmd.args(["--warmup", "0", "--bandwidth-mib", "16", "--threads", "1"]);
    let res = run_with_timeout(cmd, 300);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{stderr}");
    let table = std::fs::read_to_string(out.join("scaling.md")).unwrap();
    assert_eq!(String::from_utf8_lossy(&res.stdout), table, "the table is printed too");
    let rows: Vec<&str> =
        table.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| layout")).collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(rows[0].starts_with("| 1×1 | local | 1 |") && rows[0].contains("| 1.00 | 1.00 |"), "{table}");
    assert!(
        rows[1].starts_with("| 1×2 | local | 2 |") && rows[2].starts_with("| 2×1 | local | 2 |"),
        "{table}"
    );
    // The same tokens on every layout, by the runs' digests.
    assert!(table.contains("\nTokens: every layout generated the tokens 1×1 did (digest "), "{table}");
    for f in ["1x1.json", "1x2.json", "2x1.json"] {
        assert!(out.join(f).metadata().unwrap().len() > 0, "{f}");
    }
    let svg = std::fs::read_to_string(out.join("scaling.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("parallel efficiency") && svg.len() > 2000, "{svg}");
    // A run of another workload (a file left from another sweep, say) is not set beside them.
    let mut other: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("1x2.json")).unwrap()).unwrap();
    other["prompt_len"] = 9.into();
    let other_file = tmp.path().join("2x2.json");
    std::fs::write(&other_file, other.to_string()).unwrap();
    let res = gridlm(&["report", path_str(&out.join("1x1.json")), path_str(&other_file)]);
    assert_one_line_error(&res, &["2x2.json: a run of prompt_len=9, where", "1x1.json ran prompt_len=8"]);
}

/// The planner lists every layout up to the cluster's slots with memory and predictions; a
/// 70B model needs several sockets' memory.
#[test]
fn planner_lists_feasible_layouts() {
    let out = gridlm(&[
        "plan",
        "--shape",
        "llama-2-70b",
        "--nodes",
        "2",
        "--sockets-per-node",
        "2",
        "--mem-bw",
        "200",
        "--peak-gflops",
        "3000",
        "--mem-gb",
        "96",
        "--net-gbps",
        "25",
        "--net-latency-us",
        "20",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layouts: Vec<(u64, u64, bool)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["pp"].as_u64().unwrap(), p["tp"].as_u64().unwrap(), p["fits"].as_bool().unwrap()))
        .collect();
    // 1..=4 ranks: 1x1, 1x2, 2x1, 1x3, 3x1, 1x4, 2x2, 4x1.
    assert_eq!(layouts.len(), 8, "{layouts:?}");
    assert!(!layouts.iter().find(|l| (l.0, l.1) == (1, 1)).unwrap().2, "140 GB on one 96 GB socket");
    assert!(layouts.iter().find(|l| (l.0, l.1) == (2, 2)).unwrap().2);
    let bad = gridlm(&["plan", "--shape", "smollm2-135m", "--mem-bw", "0", "--peak-gflops", "10"]);
    assert_one_line_error(&bad, &["--mem-bw must be a positive number"]);
    let bad = gridlm(&[
        "plan",
        "--shape",
        "smollm2-135m",
        "--mem-bw",
        "9",
        "--peak-gflops",
        "10",
        "--core-gbps",
        "5",
    ]);
    assert_one_line_error(&bad, &["--cores-per-socket"]);
}

/// The JSON output of `gridlm plan --limits FILE`, `limits` the file's text and `args` after it.
fn plan_with_limits(limits: &str, args: &[&str]) -> serde_json::Value {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("limits.json");
    std::fs::write(&f, limits).unwrap();
    let out = gridlm(&[&["plan", "--limits", path_str(&f), "--json"], args].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The layout `pp`×`tp` of a plan's JSON output.
fn layout(plan: &serde_json::Value, pp: u64, tp: u64) -> &serde_json::Value {
    let found = plan.as_array().unwrap().iter().find(|p| p["pp"] == pp && p["tp"] == tp);
    found.unwrap_or_else(|| panic!("no layout {pp}x{tp} in {plan}"))
}

/// `plan --limits` takes one core's bandwidth and the cores from `bench --limits --json`: at
/// batch 1 a 2-stage pipeline's ranks, sharing a socket, take turns, and each reads at what
/// its core reads alone rather than at half the socket's; files without it plan as before.
#[test]
fn planner_takes_the_core_bandwidth_from_the_limits() {
    let plan = |limits: &str| {
        let v = plan_with_limits(limits, &["--shape", "smollm2-135m", "--ranks-per-socket", "2"]);
        let next = |pp, tp| layout(&v, pp, tp)["next_token_ms"].as_f64().unwrap();
        (next(1, 2), next(2, 1))
    };
    let old = r#"{"measured_gb_per_s":40,"measured_peak_gflops":200,"threads_per_rank":2,"ranks":[{}]}"#;
    let new = r#"{"measured_gb_per_s":40,"measured_peak_gflops":200,"core_gb_per_s":30,"threads_per_rank":2,"ranks":[{}]}"#;
    let ((tp_old, pp_old), (tp_new, pp_new)) = (plan(old), plan(new));
    // Two tp ranks read at once: their share either way. Two stages in turn: 30 GB/s each, not 20.
    assert_eq!(tp_old, tp_new);
    assert!((pp_new / pp_old - 20.0 / 30.0).abs() < 0.02, "{pp_new} {pp_old}");
}

/// `plan --limits` takes the bf16 dot-product peak where the file has one: bf16 weights
/// prefill then computes at it; f16 weights, and files without it (or with null), at the f32
/// peak.
#[test]
fn planner_takes_the_bf16_peak_from_the_limits() {
    let first_token = |limits: &str, dtype: &str| {
        let args = ["--shape", "llama-3.2-1b", "--dtype", dtype, "--prompt-len", "512"];
        layout(&plan_with_limits(limits, &args), 1, 1)["first_token_ms"].as_f64().unwrap()
    };
    let base = r#""measured_gb_per_s":40,"measured_peak_gflops":200,"threads_per_rank":2,"ranks":[{}]"#;
    let (without, null, with) = (
        format!("{{{base}}}"),
        format!(r#"{{{base},"measured_bf16_peak_gflops":null}}"#),
        format!(r#"{{{base},"measured_bf16_peak_gflops":400}}"#),
    );
    let f32_peak = first_token(&without, "bf16");
    assert_eq!(first_token(&null, "bf16"), f32_peak);
    let bf16_peak = first_token(&with, "bf16");
    assert!((bf16_peak / f32_peak - 0.5).abs() < 0.02, "{bf16_peak} {f32_peak}");
    assert_eq!(first_token(&with, "f16"), first_token(&without, "f16"));
}

#[test]
fn bench_limits_alone() {
    let out = gridlm(&["bench", "--limits", "--bandwidth-mib", "32", "--threads", "1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["measured_gb_per_s"].as_f64().unwrap() > 0.0 && v["measured_peak_gflops"].as_f64().unwrap() > 0.0
    );
    // One thread hands nothing to another; its read is one core's.
    assert_eq!(v["handoff_us"].as_f64(), Some(0.0), "{v}");
    assert_eq!(v["core_gb_per_s"], v["measured_gb_per_s"], "{v}");
    // The bf16 dot-product peak where the bf16 kernels use `vdpbf16ps`, null elsewhere.
    let bf16 = &v["measured_bf16_peak_gflops"];
    if gridlm::kernels::dot::detect() == gridlm::kernels::dot::Isa::Avx512Bf16 {
        assert!(bf16.as_f64().is_some_and(|g| g > 0.0), "{v}");
    } else {
        assert!(bf16.is_null(), "{v}");
    }
    assert!(repo_root().join("launch/scale").exists());
}

/// `plan --model` counts a folder's weights in the dtype generate would load them in: as stored
/// (SmolLM2 in f32 and in bf16: twice the bytes a rank), from config.json's `torch_dtype` where
/// the folder holds nothing else yet, and as `--dtype` says where given.
#[test]
fn plan_counts_a_folder_in_its_stored_dtype() {
    let mem = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["plan", "--model", path_str(dir), "--mem-bw", "50", "--peak-gflops", "200"];
        args.extend(["--net-gbps", "10", "--net-latency-us", "10", "--json"]);
        args.extend(extra);
        let out = gridlm(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0]["mem_per_rank"].as_f64().unwrap()
    };
    let (f32_dir, bf16_dir) = (smollm2("f32"), smollm2("bf16"));
    let (stored_f32, stored_bf16) = (mem(&f32_dir, &[]), mem(&bf16_dir, &[]));
    assert!((1.9..2.0).contains(&(stored_f32 / stored_bf16)), "{stored_f32} against {stored_bf16}");
    assert_eq!(mem(&f32_dir, &["--dtype", "bf16"]), stored_bf16);
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(f32_dir.join("config.json")).unwrap()).unwrap();
    for (torch_dtype, want) in [("float32", stored_f32), ("bfloat16", stored_bf16)] {
        cfg["torch_dtype"] = torch_dtype.into();
        std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
        assert_eq!(mem(tmp.path(), &[]), want, "{torch_dtype}");
    }
}
