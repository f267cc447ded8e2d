//! planarian-bench: prints tables and ratios of planarian against the baselines the issues name.
//!
//!   planarian-bench passthrough [--iterations N] [--planarian PATH] [--crun PATH]
//!
//! `passthrough`: the cost of planarian's pass-through path, `planarian state ID` against
//! `crun state ID` on the same running container (started through Podman), interleaved so
//! that drift affects both alike. Needs the real stack (run it with bench/run).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("passthrough") => passthrough(&args[1..]),
        _ => {
            eprintln!("usage: planarian-bench passthrough [--iterations N] [--planarian PATH] [--crun PATH]");
            2
        }
    };
    std::process::exit(code)
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn run_quiet(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

struct Stats {
    mean: Duration,
    median: Duration,
    p95: Duration,
    min: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let n = v.len();
    Stats {
        mean: v.iter().sum::<Duration>() / n as u32,
        median: v[n / 2],
        p95: v[(n * 95 / 100).min(n - 1)],
        min: v[0],
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn time_once(program: &str, args: &[&str]) -> Duration {
    let t = Instant::now();
    let st = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("spawn");
    let d = t.elapsed();
    assert!(st.success(), "{program} {args:?} failed");
    d
}

fn passthrough(args: &[String]) -> i32 {
    let iterations: usize = flag(args, "--iterations").and_then(|s| s.parse().ok()).unwrap_or(200);
    let planarian = flag(args, "--planarian").unwrap_or("/usr/local/bin/planarian");
    let crun = flag(args, "--crun").unwrap_or("/usr/bin/crun");
    let name = format!("plbench-{}", std::process::id());
    let id = match run_quiet(
        "podman",
        &["--runtime", "planarian", "run", "-d", "--name", &name, "localhost/planarian-test/busybox", "sleep", "100000"],
    ) {
        Ok(id) => id,
        Err(e) => {
            eprintln!("planarian-bench: cannot start the benchmark container: {e}");
            return 1;
        }
    };
    let empty = std::env::temp_dir().join(format!("plbench-root-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("temp dir");
    let empty = empty.to_str().expect("utf-8 temp dir");
    let cmds: [(&str, &str, Vec<&str>); 6] = [
        ("crun state ID", crun, vec!["state", &id]),
        ("planarian state ID", planarian, vec!["state", &id]),
        ("crun --root EMPTY list", crun, vec!["--root", empty, "list"]),
        ("planarian --root EMPTY list", planarian, vec!["--root", empty, "list"]),
        ("planarian --help (start-up alone)", planarian, vec!["--help"]),
        ("/bin/true (spawn floor)", "/bin/true", vec![]),
    ];
    // Warm up the page cache.
    for (_, p, a) in &cmds {
        for _ in 0..5 {
            time_once(p, a);
        }
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); cmds.len()];
    for _ in 0..iterations {
        for (i, (_, p, a)) in cmds.iter().enumerate() {
            samples[i].push(time_once(p, a));
        }
    }
    let _ = run_quiet("podman", &["rm", "-f", "-t", "0", &name]);
    let s: Vec<Stats> = samples.into_iter().map(stats).collect();
    println!("pass-through overhead: {iterations} runs each, interleaved, on a running container (ms)");
    println!("| command | mean | median | p95 | min |");
    println!("|---|---:|---:|---:|---:|");
    for ((label, _, _), st) in cmds.iter().zip(&s) {
        println!("| {label} | {} | {} | {} | {} |", ms(st.mean), ms(st.median), ms(st.p95), ms(st.min));
    }
    println!();
    for (verb, c, p) in [("state", &s[0], &s[1]), ("list", &s[2], &s[3])] {
        println!(
            "planarian/crun {verb}: median {:.2}x (+{} ms), mean {:.2}x (+{} ms)",
            p.median.as_secs_f64() / c.median.as_secs_f64(),
            ms(p.median.saturating_sub(c.median)),
            p.mean.as_secs_f64() / c.mean.as_secs_f64(),
            ms(p.mean.saturating_sub(c.mean)),
        );
    }
    let _ = std::fs::remove_dir(empty);
    0
}
