//! planarian-bench: prints tables and ratios of planarian against the baselines the issues name.
//!
//!   planarian-bench passthrough [--iterations N] [--planarian PATH] [--crun PATH]
//!
//!   planarian-bench statepoint [--mem MiB] [--files MiB] [--iterations N]
//!
//! `statepoint`: snapshot and rollback latency of a sandbox holding MEM MiB of memory and FILES
//! MiB of files, planarian against the Full-snapshot baseline (Podman's own `container checkpoint
//! --export` + `container restore --import` under runc -- Debian's crun has no CRIU -- which copies everything every time).
//!
//!   planarian-bench chains [--mem MiB] [--files MiB] [--pool POOL]
//!
//! `chains`: the paper's snapshot/rollback/fork cost figure. The same workload (MEM MiB of
//! memory, 1 % of it rewritten as one contiguous run between steps, FILES MiB of files) under
//! three systems, one after the other in the same run: planarian; CRIU-inc (CRIU's own
//! incremental dumps: planarian with the pre-resume hook off, so every dump after a restore is
//! full); Full-snapshot (a full dump and a full copy every time: full-dump interval 1).
//!
//!   planarian-bench files [--files MiB] [--pool POOL]
//!
//! `files`: the paper's file-system workload. A sandbox whose writable files total FILES MiB
//! (1 MiB files of random data), 64 KiB of them rewritten between statepoints; snapshot,
//! rollback and fork latency and bytes copied, the ZFS path (a per-image clone under
//! POOL/bench; POOL defaults to $PLANARIAN_TEST_ZPOOL, which the test guest creates) against the
//! copy-based path (Full-snapshot for files).
//!
//!   planarian-bench mcp [--iterations N] [--proxy PATH]
//!
//! `mcp`: proxied against direct MCP round trips (see bench/src/mcp.rs); runs on the host.
//!
//!   planarian-bench e2e [--scales 1,0.5,0.25|native] [--traces NAME,...]
//!   planarian-bench calibrate
//!
//! `e2e`: agent traces (tool calls with the model's think time between them) replayed on
//! No-snapshot, Planarian (a statepoint after every call, asynchronous) and Full-snapshot; see
//! bench/src/e2e.rs.
//!
//!   planarian-bench lazy [--mem MiB,MiB,...]
//!
//! `lazy`: CRIU's lazy restore against its full one, and whether lazily installed pages are
//! soft-dirty (see bench/src/lazy.rs).
//!
//! `passthrough`: the cost of planarian's pass-through path, `planarian state ID` against
//! `crun state ID` on the same running container (started through Podman), interleaved so
//! that drift affects both alike. Needs the real stack (run it with bench/run).

mod e2e;
mod lazy;
mod mcp;

/// The server binaries of the newest PostgreSQL installed (Debian 12 has 15, Debian 13 17).
fn pg_bin() -> String {
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()).max())
        .unwrap_or_default();
    format!("/usr/lib/postgresql/{}/bin", newest.unwrap_or(15))
}

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("passthrough") => passthrough(&args[1..]),
        Some("statepoint") => statepoint(&args[1..]),
        Some("chains") => chains(&args[1..]),
        Some("files") => files(&args[1..]),
        Some("unchanged") => unchanged(&args[1..]),
        Some("forks") => forks(&args[1..]),
        Some("mcp") => mcp::main(&args[1..]),
        Some("e2e") => e2e::main(&args[1..]),
        Some("calibrate") => e2e::calibrate(),
        Some("lazy") => lazy::main(&args[1..]),
        Some("__hold") => lazy::hold(&args[1..]),
        _ => {
            eprintln!("usage: planarian-bench passthrough [--iterations N] [--planarian PATH] [--crun PATH]");
            eprintln!("       planarian-bench statepoint [--mem MiB] [--files MiB] [--iterations N]");
            eprintln!("       planarian-bench chains [--mem MiB] [--files MiB] [--pool POOL] [--repeat N]");
            eprintln!("       planarian-bench files [--files MiB] [--pool POOL]");
            eprintln!("       planarian-bench unchanged [--mem MiB] [--files MiB] [--iterations N]");
            eprintln!(
                "       planarian-bench forks [--mem MiB,MiB] [--files MiB] [--repeat N] [--count N] [--count-mem MiB]"
            );
            eprintln!("       planarian-bench mcp [--iterations N] [--proxy PATH]");
            eprintln!("       planarian-bench e2e [--scales 1,0.5,0.25|native] [--traces NAME,...]");
            eprintln!("       planarian-bench calibrate");
            eprintln!("       planarian-bench lazy [--mem MiB,MiB,...]");
            2
        }
    };
    std::process::exit(code)
}

pub(crate) fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn run_quiet(program: &str, args: &[&str]) -> Result<String, String> {
    let out = run_checked(program, args)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs a command, failing with its stderr when it fails.
fn run_checked(program: &str, args: &[&str]) -> Result<std::process::Output, String> {
    let out = Command::new(program).args(args).stdin(Stdio::null()).output().map_err(|e| format!("{program}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(out)
}

/// Runs a command that reports its phases on stderr (`planarian rollback`, `fork`): the phases.
fn run_phases(program: &str, args: &[&str]) -> Result<String, String> {
    let out = run_checked(program, args)?;
    Ok(String::from_utf8_lossy(&out.stderr).trim_end().to_string())
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
        &[
            "--runtime",
            "planarian",
            "run",
            "-d",
            "--name",
            &name,
            "localhost/planarian-test/busybox",
            "sleep",
            "100000",
        ],
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

/// A workload: MEM MiB of random memory in a python process, FILES MiB of files, and a little
/// change (1 % of memory, one file) between statepoints; asked (`/tmp/sum`), the checksum of
/// its memory.
const WORKLOAD: &str = r#"
import os, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
open("/tmp/up", "w").close()
while True:
    if os.path.exists("/tmp/dirty"):
        at = int(open("/tmp/dirty").read().strip() or 0)
        os.remove("/tmp/dirty")
        n = len(buf) // 100
        buf[at * n:(at + 1) * n] = os.urandom(n)
        open("/tmp/dirtied", "w").close()
    if os.path.exists("/tmp/sum"):
        import hashlib
        os.remove("/tmp/sum")
        open("/tmp/sum.part", "w").write(hashlib.sha1(buf).hexdigest())
        os.rename("/tmp/sum.part", "/tmp/sum.out")
    time.sleep(0.05)
"#;

fn start_workload(runtime: &str, name: &str, mem: u32, files: u32) -> Result<(), String> {
    start_script(runtime, name, WORKLOAD, mem, files)
}

/// A sandbox running the Python `script` with `mem` MiB, and `files` MiB of files, once its
/// script is up (`/tmp/up`).
fn start_script(runtime: &str, name: &str, script: &str, mem: u32, files: u32) -> Result<(), String> {
    start_script_with(runtime, name, script, mem, files, &[])
}

/// [`start_script`], with more `podman run` options.
fn start_script_with(
    runtime: &str,
    name: &str,
    script: &str,
    mem: u32,
    files: u32,
    extra: &[&str],
) -> Result<(), String> {
    let mem = mem.to_string();
    let mut a = vec!["--runtime", runtime, "run", "-d", "--name", name];
    a.extend_from_slice(extra);
    a.extend_from_slice(&["localhost/planarian-test/debian", "python3", "-c", script, &mem]);
    run_quiet("podman", &a)?;
    run_quiet("podman", &["exec", name, "sh", "-c", &format!(
        "mkdir -p /data && i=0; while [ $i -lt {files} ]; do head -c 1048576 /dev/urandom > /data/f$i; i=$((i+1)); done")])?;
    wait_file(name, "/tmp/up")
}

fn wait_file(name: &str, path: &str) -> Result<(), String> {
    let end = Instant::now() + Duration::from_secs(300);
    while Instant::now() < end {
        if run_quiet("podman", &["exec", name, "test", "-e", path]).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!("{name}: {path} did not appear"))
}

/// The workload's memory checksum, as it computes it now.
fn checksum(name: &str) -> Result<String, String> {
    run_quiet("podman", &["exec", name, "sh", "-c", "rm -f /tmp/sum.out; touch /tmp/sum"])?;
    wait_file(name, "/tmp/sum.out")?;
    run_quiet("podman", &["exec", name, "cat", "/tmp/sum.out"])
}

fn dirty(name: &str) -> Result<(), String> {
    dirty_at(name, 0)
}

/// [`dirty`], the `at`-th 1 % of the workload's memory rewritten.
fn dirty_at(name: &str, at: u32) -> Result<(), String> {
    let _ = run_quiet("podman", &["exec", name, "rm", "-f", "/tmp/dirtied"]);
    let sh = format!(
        "echo {at} > /tmp/dirty.part; mv /tmp/dirty.part /tmp/dirty; head -c 65536 /dev/urandom > /data/changed"
    );
    run_quiet("podman", &["exec", name, "sh", "-c", &sh])?;
    wait_file(name, "/tmp/dirtied")
}

fn timed(f: impl FnOnce() -> Result<(), String>) -> Result<Duration, String> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::symlink_metadata(p) else { return 0 };
    let mut total = md.blocks() * 512;
    if md.is_dir() {
        for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
            total += dir_bytes(&e.path());
        }
    }
    total
}

fn statepoint(args: &[String]) -> i32 {
    let mem: u32 = flag(args, "--mem").and_then(|s| s.parse().ok()).unwrap_or(256);
    let files: u32 = flag(args, "--files").and_then(|s| s.parse().ok()).unwrap_or(64);
    let iterations: usize = flag(args, "--iterations").and_then(|s| s.parse().ok()).unwrap_or(3);
    match statepoint_inner(mem, files, iterations) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("planarian-bench: {e}");
            1
        }
    }
}

fn statepoint_inner(mem: u32, files: u32, iterations: usize) -> Result<(), String> {
    let pid = std::process::id();
    let (pl, full) = (format!("plbench-pl-{pid}"), format!("plbench-full-{pid}"));
    let export = std::env::temp_dir().join(format!("plbench-{pid}.tar"));
    let export_s = export.to_str().unwrap().to_string();
    let cleanup = || {
        for n in [&pl, &full] {
            let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
        }
        let _ = std::fs::remove_file(&export);
    };
    let result = (|| -> Result<(), String> {
        start_workload("planarian", &pl, mem, files)?;
        start_workload("runc", &full, mem, files)?;
        let (mut pl_snap, mut pl_rb, mut full_snap, mut full_rb) = (vec![], vec![], vec![], vec![]);
        let (mut pl_bytes, mut full_bytes) = (0u64, 0u64);
        let store = std::path::Path::new("/var/lib/planarian/containers");
        for i in 0..iterations {
            dirty(&pl)?;
            let mut sp = String::new();
            pl_snap.push(timed(|| {
                sp = run_quiet("/usr/local/bin/planarian", &["snapshot", &pl])?;
                Ok(())
            })?);
            let id = run_quiet("podman", &["inspect", "--format", "{{.Id}}", &pl])?;
            pl_bytes = dir_bytes(&store.join(&id).join("statepoints").join(&sp));
            dirty(&pl)?;
            pl_rb.push(timed(|| run_quiet("/usr/local/bin/planarian", &["rollback", &pl, &sp]).map(|_| ()))?);

            dirty(&full)?;
            full_snap.push(timed(|| {
                run_quiet(
                    "podman",
                    &["container", "checkpoint", "--leave-running", "--compress", "none", "--export", &export_s, &full],
                )
                .map(|_| ())
            })?);
            full_bytes = std::fs::metadata(&export).map(|m| m.len()).unwrap_or(0);
            dirty(&full)?;
            full_rb.push(timed(|| {
                run_quiet("podman", &["rm", "-f", "-t", "0", &full])?;
                run_quiet("podman", &["container", "restore", "--import", &export_s, "--name", &full]).map(|_| ())
            })?);
            if i + 1 < iterations {
                // runc cannot checkpoint a container that --import restored (CRIU fails with
                // "NOTIFY errno 0"): start the next round from a fresh one, untimed. The baseline
                // dumps everything every time, so this costs it nothing.
                run_quiet("podman", &["rm", "-f", "-t", "0", &full])?;
                start_workload("runc", &full, mem, files)?;
            }
            eprintln!("iteration {} of {iterations} done", i + 1);
        }
        let med = |v: &mut Vec<Duration>| -> f64 {
            v.sort();
            v[v.len() / 2].as_secs_f64() * 1e3
        };
        let (ps, pr, fs, fr) = (med(&mut pl_snap), med(&mut pl_rb), med(&mut full_snap), med(&mut full_rb));
        println!("statepoint cost: {mem} MiB memory, {files} MiB files, 1 % of memory + 64 KiB of files changed between statepoints; median of {iterations} (ms)");
        println!("| operation | planarian (copy path, full dumps) | Full-snapshot (podman --export/--import) | Full-snapshot / planarian |");
        println!("|---|---:|---:|---:|");
        println!("| snapshot | {ps:.0} | {fs:.0} | {:.2}x |", fs / ps);
        println!("| rollback | {pr:.0} | {fr:.0} | {:.2}x |", fr / pr);
        println!(
            "| bytes written per snapshot | {} | {} | {:.2}x |",
            pl_bytes,
            full_bytes,
            full_bytes as f64 / pl_bytes.max(1) as f64
        );
        Ok(())
    })();
    cleanup();
    result
}

/// One measured operation: wall time, bytes the statepoint store gained, memory pages written.
#[derive(Default, Clone)]
struct Cost {
    ms: f64,
    bytes: u64,
    pages: u64,
    /// Why a dump was full, as its manifest says.
    full_reason: Option<String>,
    /// Bytes of files the statepoint copied.
    rootfs_bytes: u64,
    /// Inside a snapshot, from its manifest: CRIU's dump alone, and how long the sandbox was frozen.
    criu_ms: f64,
    frozen_ms: f64,
}

const PLANARIAN: &str = "/usr/local/bin/planarian";

fn manifest(ctr: &str, sp: &str) -> Result<serde_json::Value, String> {
    let out = run_quiet(PLANARIAN, &["statepoint", "show", ctr, sp])?;
    serde_json::from_str(&out).map_err(|e| format!("statepoint show {ctr} {sp}: {e}"))
}

fn snapshot_cost(ctr: &str) -> Result<(String, Cost), String> {
    let t = Instant::now();
    let sp = run_quiet(PLANARIAN, &["snapshot", ctr])?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let m = manifest(ctr, &sp)?;
    let meas = &m["measurements"];
    let bytes = meas["criu-bytes"].as_u64().unwrap_or(0) + meas["rootfs-bytes"].as_u64().unwrap_or(0);
    let full_reason = m["chain"]["full-reason"].as_str().map(String::from);
    let rootfs_bytes = meas["rootfs-bytes"].as_u64().unwrap_or(0);
    let (criu_ms, frozen_ms) =
        (meas["criu-dump-ms"].as_f64().unwrap_or(0.0), meas["frozen-ms"].as_f64().unwrap_or(0.0));
    Ok((
        sp,
        Cost {
            ms,
            bytes,
            pages: meas["pages-written"].as_u64().unwrap_or(0),
            full_reason,
            rootfs_bytes,
            criu_ms,
            frozen_ms,
        },
    ))
}

/// How long `f` takes.
fn timed_cost(f: &mut dyn FnMut() -> Result<(), String>) -> Result<Cost, String> {
    let t = Instant::now();
    f()?;
    Ok(Cost { ms: t.elapsed().as_secs_f64() * 1e3, ..Cost::default() })
}

/// Second snapshot, rollback, first snapshot after the rollback, fork, first snapshot in the fork;
/// and where the rollback's and the fork's time went (their phases, as they report them). With
/// `spare`, also a spare of the fork's statepoint made (6th: its cost) and a fork that takes it
/// (7th).
/// The chains measured for one system: the operations ([`chains_system`]), their phases, and,
/// repeated, an incremental snapshot and a rollback to the first statepoint (ms each).
struct Chains {
    costs: [Cost; 8],
    phases: String,
    repeated: Vec<(f64, f64)>,
    /// With `compare_ahead`, beside each repeated pair a pair of its own (the same history: memory
    /// rewritten, a snapshot, other memory rewritten, the rollback) whose rollback writes pages
    /// ahead of the files' comparison (`checkpoint.write_ahead = true`): snapshot ms, rollback ms.
    with_ahead: Vec<(f64, f64)>,
}

/// The drop-in that turns pages written ahead on (off by default), while a rollback with them is
/// measured.
const AHEAD: &str = "/etc/planarian/planarian.conf.d/zz-plbench-ahead.conf";

/// A drop-in of planarian's configuration (its path) for as long as it lives.
struct DropIn(std::path::PathBuf);

impl DropIn {
    fn new(path: &str, text: &str) -> Result<DropIn, String> {
        let p = std::path::PathBuf::from(path);
        std::fs::create_dir_all(p.parent().unwrap_or(std::path::Path::new("/"))).map_err(|e| e.to_string())?;
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(DropIn(p))
    }
}

impl Drop for DropIn {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn chains_system(
    tag: &str,
    annotations: &[String],
    mem: u32,
    files: u32,
    spare: bool,
    repeat: usize,
    compare_ahead: bool,
) -> Result<Chains, String> {
    let pid = std::process::id();
    let (ctr, fork) = (format!("plbench-{tag}-{pid}"), format!("plbench-{tag}-fork-{pid}"));
    let fork2 = format!("plbench-{tag}-fork2-{pid}");
    let mut run = vec!["--runtime", "planarian", "run", "-d", "--name", &ctr];
    for a in annotations {
        run.extend(["--annotation", a.as_str()]);
    }
    let mem_s = mem.to_string();
    run.extend(["localhost/planarian-test/debian", "python3", "-c", WORKLOAD, &mem_s]);
    let result = (|| -> Result<Chains, String> {
        run_quiet("podman", &run)?;
        run_quiet("podman", &["exec", &ctr, "sh", "-c", &format!(
            "mkdir -p /data && i=0; while [ $i -lt {files} ]; do head -c 1048576 /dev/urandom > /data/f$i; i=$((i+1)); done")])?;
        wait_file(&ctr, "/tmp/up")?;
        let (sp1, _) = snapshot_cost(&ctr)?;
        dirty(&ctr)?;
        let (_, second) = snapshot_cost(&ctr)?;
        dirty(&ctr)?;
        let t = Instant::now();
        let rollback_phases = run_phases(PLANARIAN, &["rollback", &ctr, &sp1])?;
        let mut rollback = Cost { ms: t.elapsed().as_secs_f64() * 1e3, ..Cost::default() };
        // Pages a rollback in place wrote, from the restore context it left.
        let how = run_quiet(PLANARIAN, &["statepoint", "context", &ctr, "--json"])
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        if let Some(how) = how.as_ref().map(|c| &c["how"]) {
            rollback.pages = how["pages-written"].as_u64().unwrap_or(0);
            if how["path"] == "stop-and-restore" {
                rollback.full_reason = how["not-in-place"].as_str().map(|w| format!("stop and restore: {w}"));
            }
        }
        dirty(&ctr)?;
        let (sp3, after_rollback) = snapshot_cost(&ctr)?;
        let t = Instant::now();
        let fork_phases = run_phases(PLANARIAN, &["fork", &ctr, &sp3, "--name", &fork])?;
        let fork_cost = Cost { ms: t.elapsed().as_secs_f64() * 1e3, ..Cost::default() };
        dirty(&fork)?;
        let (_, after_fork) = snapshot_cost(&fork)?;
        let (mut spare_cost, mut spare_fork, mut spare_own) = (Cost::default(), Cost::default(), Cost::default());
        if spare {
            spare_cost = timed_cost(&mut || run_quiet(PLANARIAN, &["spare", &ctr, &sp3, "--count", "1"]).map(drop))?;
            spare_fork = timed_cost(&mut || run_quiet(PLANARIAN, &["fork", &ctr, &sp3, "--name", &fork2]).map(drop))?;
            wait_file(&fork2, "/tmp/up")?;
            // Another, taken under its own name (no --name: an unpause, no rename).
            run_quiet(PLANARIAN, &["spare", &ctr, &sp3, "--count", "1"])?;
            spare_own = timed_cost(&mut || run_quiet(PLANARIAN, &["fork", &ctr, &sp3]).map(drop))?;
        }
        // Snapshot and roll back again and again, under the same conditions: one measurement
        // under emulation moves by tens of percent.
        let mut repeated = Vec::new();
        let mut with_ahead = Vec::new();
        // (the timeline of the last rollback with pages written ahead, and of the last without)
        let timelines = std::cell::RefCell::new([None, None]);
        // One pair: memory rewritten, a snapshot, other memory rewritten, the rollback (ms of
        // each): the rollback writes back what changed before the snapshot and after it, as an
        // agent's does past the statepoints taken since its target.
        let pair = || -> Result<(f64, f64), String> {
            dirty_at(&ctr, 1)?;
            let (_, snap) = snapshot_cost(&ctr)?;
            dirty(&ctr)?;
            let ms = timed_cost(&mut || run_quiet(PLANARIAN, &["rollback", &ctr, &sp1]).map(drop))?.ms;
            let ahead = std::path::Path::new(AHEAD).exists();
            timelines.borrow_mut()[usize::from(!ahead)] =
                logged("rollback timeline (ms): ", "rollback timeline (ms): ");
            Ok((snap.ms, ms))
        };
        // (with `compare_ahead`, a pair with pages written ahead beside each, first and second in
        // turn: the machine's drift moves both alike)
        let with_ahead_on = || -> Result<(f64, f64), String> {
            let _on = DropIn::new(AHEAD, "[checkpoint]\nwrite_ahead = true\n")?;
            pair()
        };
        for i in 0..repeat {
            if compare_ahead && i % 2 == 1 {
                with_ahead.push(with_ahead_on()?);
            }
            repeated.push(pair()?);
            if compare_ahead && i % 2 == 0 {
                with_ahead.push(with_ahead_on()?);
            }
        }
        let costs = [second, rollback, after_rollback, fork_cost, after_fork, spare_cost, spare_fork, spare_own];
        let mut phases = format!("{rollback_phases}\n{fork_phases}");
        for (what, t) in ["with pages written ahead", "without"].iter().zip(timelines.into_inner()) {
            if let Some(t) = t {
                phases.push_str(&format!("\nlast repeated rollback {what}, timeline (ms): {t}"));
            }
        }
        Ok(Chains { costs, phases, repeated, with_ahead })
    })();
    // (a spare left when the fork that should have taken it failed)
    let spares =
        run_quiet("podman", &["ps", "-a", "--filter", &format!("name={ctr}-spare-"), "--format", "{{.Names}}"])
            .unwrap_or_default();
    for n in spares.lines().map(str::to_string).chain([fork2, fork, ctr.clone()]) {
        let n = &n;
        if let Ok(id) = run_quiet("podman", &["inspect", "--format", "{{.Id}}", n]) {
            let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
            let _ = run_quiet(PLANARIAN, &["gc"]);
            let _ = std::fs::remove_dir_all(std::path::Path::new("/var/lib/planarian/containers").join(id));
        }
    }
    result
}

fn chains(args: &[String]) -> i32 {
    let mem: u32 = flag(args, "--mem").and_then(|s| s.parse().ok()).unwrap_or(256);
    // How many more times planarian snapshots and rolls back in place, for the medians.
    let repeat: usize = flag(args, "--repeat").and_then(|s| s.parse().ok()).unwrap_or(5);
    let files: u32 = flag(args, "--files").and_then(|s| s.parse().ok()).unwrap_or(64);
    // With a ZFS pool, planarian and CRIU-inc keep their files on datasets (snapshots are
    // zero-copy); Full-snapshot always copies the files, as a full snapshot does.
    let pool = flag(args, "--pool").map(String::from).or_else(|| std::env::var("PLANARIAN_TEST_ZPOOL").ok());
    let mut on_zfs = Vec::new();
    if let Some(pool) = &pool {
        let parent = format!("{pool}/bench");
        if run_quiet("zfs", &["list", &parent]).is_err() {
            if let Err(e) = run_quiet("zfs", &["create", &parent]) {
                eprintln!("planarian-bench chains: {e}");
                return 1;
            }
        }
        on_zfs.push(format!("io.planarian.zfs.parent_dataset={parent}"));
    }
    let with = |extra: &str| on_zfs.iter().cloned().chain([extra.to_string()]).collect::<Vec<_>>();
    // planarian twice: rolling back in place (its default) and by stopping and restoring.
    // CRIU-inc and Full-snapshot restore, as CRIU alone does.
    let restore = "io.planarian.checkpoint.rollback_in_place=false";
    let systems = [
        ("planarian", on_zfs.clone()),
        ("planarian-restore", with(restore)),
        (
            "CRIU-inc",
            with("io.planarian.checkpoint.pre_resume_hook=false").into_iter().chain([restore.to_string()]).collect(),
        ),
        ("Full-snapshot", vec!["io.planarian.checkpoint.full_dump_interval=1".to_string(), restore.to_string()]),
    ];
    // `--in-place-only`: planarian's snapshots and rollbacks in place alone (the baselines
    // restore, and cost most of the run's time).
    let in_place_only = args.iter().any(|a| a == "--in-place-only");
    let systems = &systems[..if in_place_only { 1 } else { systems.len() }];
    let mut results = Vec::new();
    let mut phases = Vec::new();
    let mut repeated = Vec::new();
    let mut with_ahead = Vec::new();
    for (tag, annotations) in systems {
        eprintln!("measuring {tag} ...");
        let first = *tag == "planarian";
        let spare = first && !in_place_only;
        let repeat = if first { repeat } else { 0 };
        match chains_system(&tag.to_lowercase(), annotations, mem, files, spare, repeat, in_place_only) {
            Ok(c) => {
                results.push(c.costs);
                phases.push(c.phases);
                repeated.extend(c.repeated);
                with_ahead.extend(c.with_ahead);
            }
            Err(e) => {
                eprintln!("planarian-bench: {tag}: {e}");
                return 1;
            }
        }
    }
    if in_place_only {
        let repeated = Repeated { pairs: &repeated, with_ahead: &with_ahead };
        return in_place_summary(mem, files, pool.is_some(), &results[0], &repeated, &phases[0]);
    }
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    let where_files = if pool.is_some() {
        "files on ZFS for planarian and CRIU-inc, copied for Full-snapshot"
    } else {
        "files copied (no ZFS pool)"
    };
    println!("snapshot/rollback/fork cost: {mem} MiB memory ({} pages), {files} MiB files ({where_files}); 1 % of memory rewritten (one contiguous run) + 64 KiB of files between steps", (mem as u64) << 8);
    println!("| operation | planarian ms | planarian, stop+restore ms | CRIU-inc ms | Full-snapshot ms | CRIU-inc / planarian | Full / planarian | pages written (pl / pl-restore / inc / full) | MiB written (pl / inc / full) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let names = ["second snapshot", "rollback", "first snapshot after rollback", "fork", "first snapshot in the fork"];
    for (i, n) in names.iter().enumerate() {
        let (p, r, c, f) = (&results[0][i], &results[1][i], &results[2][i], &results[3][i]);
        let pages = if p.pages + r.pages + c.pages + f.pages > 0 {
            format!("{} / {} / {} / {}", p.pages, r.pages, c.pages, f.pages)
        } else {
            "-".into()
        };
        let bytes = if p.bytes + c.bytes + f.bytes > 0 {
            format!("{:.1} / {:.1} / {:.1}", mb(p.bytes), mb(c.bytes), mb(f.bytes))
        } else {
            "-".into()
        };
        println!(
            "| {n} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2}x | {:.2}x | {pages} | {bytes} |",
            p.ms,
            r.ms,
            c.ms,
            f.ms,
            c.ms / p.ms,
            f.ms / p.ms
        );
    }
    // The issue's targets: a rollback within 2x of an incremental snapshot of the same sandbox,
    // 10x faster than Full-snapshot's.
    let (p, r, f) = (&results[0], &results[1], &results[3]);
    println!();
    println!("rollback in place: {:.0} ms, {} pages written; rollback / incremental snapshot = {:.2}x (stop and restore: {:.2}x); Full-snapshot's rollback / in place = {:.1}x; stop and restore / in place = {:.1}x",
        p[1].ms, p[1].pages, p[1].ms / p[0].ms, r[1].ms / r[0].ms, f[1].ms / p[1].ms, r[1].ms / p[1].ms);
    // A fork on the caller's critical path: one that takes a spare made beforehand (while the
    // model is asked, say), against an incremental snapshot.
    println!(
        "fork from a spare: {:.0} ms (the spare, made beforehand: {:.0} ms; a fork made on the spot: {:.0} ms); fork from a spare / incremental snapshot = {:.2}x; under the spare's own name (no --name: a thaw): {:.0} ms = {:.2}x",
        p[6].ms, p[5].ms, p[3].ms, p[6].ms / p[0].ms, p[7].ms, p[7].ms / p[0].ms
    );
    if !repeated.is_empty() {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let ratios: Vec<String> = repeated.iter().map(|(s, r)| format!("{:.2}x", r / s)).collect();
        let (snap, back) =
            (median(repeated.iter().map(|r| r.0).collect()), median(repeated.iter().map(|r| r.1).collect()));
        println!(
            "repeated {} times (snapshot, then a rollback in place to the first statepoint): median snapshot {snap:.0} ms, median rollback {back:.0} ms = {:.2}x; each pair: {}",
            repeated.len(),
            back / snap,
            ratios.join(" ")
        );
    }
    for (s, (tag, _)) in results.iter().zip(systems) {
        for (i, c) in s.iter().take(names.len()).enumerate() {
            if let Some(why) = &c.full_reason {
                let what = if why.starts_with("stop and restore") { "" } else { "full dump: " };
                println!("  {tag}, {}: {what}{why}", names[i]);
            }
        }
    }
    // End to end, a snapshot is also the CLI, podman's lock, the freeze, the files and the
    // manifest: under emulation a fixed cost of seconds. CRIU's dump alone shows the memory part.
    println!();
    println!("inside each snapshot, from its manifest: CRIU dump ms and frozen ms");
    println!("| snapshot | CRIU dump (pl / inc / full) | CRIU-inc / planarian | Full / planarian | frozen (pl / inc / full) |");
    println!("|---|---:|---:|---:|---:|");
    for i in [0, 2, 4] {
        let (p, c, f) = (&results[0][i], &results[2][i], &results[3][i]);
        println!(
            "| {} | {:.0} / {:.0} / {:.0} | {:.2}x | {:.2}x | {:.0} / {:.0} / {:.0} |",
            names[i],
            p.criu_ms,
            c.criu_ms,
            f.criu_ms,
            c.criu_ms / p.criu_ms,
            f.criu_ms / p.criu_ms,
            p.frozen_ms,
            c.frozen_ms,
            f.frozen_ms
        );
    }
    let p = &results[0];
    println!(
        "planarian: first snapshot after rollback / second snapshot = {:.2}x; first in fork / second = {:.2}x",
        p[2].ms / p[0].ms,
        p[4].ms / p[0].ms
    );
    // Where a rollback's and a fork's time goes: their own phases (the restore's split from
    // `podman container restore --print-stats`).
    for (ph, (tag, _)) in phases.iter().zip(systems) {
        println!();
        println!("{tag}: rollback and fork, phase by phase");
        println!("```\n{ph}\n```");
    }
    0
}

/// The repeated pairs of `chains --in-place-only` (snapshot ms, rollback in place ms), and beside
/// each a pair whose rollback writes pages ahead (ms).
struct Repeated<'a> {
    pairs: &'a [(f64, f64)],
    with_ahead: &'a [(f64, f64)],
}

/// `chains --in-place-only`: planarian's incremental snapshot against its rollback in place, once
/// and then `repeated` pairs (each beside a pair whose rollback writes pages ahead), with the
/// rollback's phases.
fn in_place_summary(mem: u32, files: u32, zfs: bool, p: &[Cost; 8], r: &Repeated, phases: &str) -> i32 {
    let repeated = r.pairs;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let on = if zfs { "files on ZFS" } else { "files copied (no ZFS pool)" };
    println!("rollback in place against an incremental snapshot: {mem} MiB memory, {files} MiB files ({on}); 1 % of memory rewritten + 64 KiB of files between steps");
    println!("| | snapshot ms | rollback in place ms | rollback / snapshot | with pages written ahead: snapshot ms | rollback ms | rollback / snapshot |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "| first pair ({} pages written) | {:.0} | {:.0} | {:.2}x | | | |",
        p[1].pages,
        p[0].ms,
        p[1].ms,
        p[1].ms / p[0].ms
    );
    let with = |i: usize| r.with_ahead.get(i).copied();
    for (i, (snap, back)) in repeated.iter().enumerate() {
        let w = with(i).map_or("| | | |".to_string(), |(s, w)| format!("| {s:.0} | {w:.0} | {:.2}x |", w / s));
        println!("| pair {} | {snap:.0} | {back:.0} | {:.2}x {w}", i + 1, back / snap);
    }
    if !repeated.is_empty() {
        let (snap, back) =
            (median(repeated.iter().map(|r| r.0).collect()), median(repeated.iter().map(|r| r.1).collect()));
        let ratio = median(repeated.iter().map(|r| r.1 / r.0).collect());
        let w = match r.with_ahead.len() == repeated.len() {
            true => {
                let s = median(r.with_ahead.iter().map(|w| w.0).collect());
                let w = median(r.with_ahead.iter().map(|w| w.1).collect());
                let wr = median(r.with_ahead.iter().map(|w| w.1 / w.0).collect());
                format!("| {s:.0} | {w:.0} | {wr:.2}x |")
            }
            false => "| | | |".to_string(),
        };
        println!("| median of {} pairs | {snap:.0} | {back:.0} | {ratio:.2}x {w}", repeated.len());
    }
    if let Some(why) = &p[1].full_reason {
        println!("  the rollback: {why}");
    }
    println!(
        "first snapshot after the rollback / second snapshot = {:.2}x (incremental after a rollback in place)",
        p[2].ms / p[0].ms
    );
    println!();
    println!("the rollback, phase by phase\n```\n{phases}\n```");
    // Where the last rollback's time went, as planarian's log has it (each step's milliseconds
    // since the one before; the page plan and the files' comparison run side by side).
    for key in ["rollback timeline (ms): ", "in place on ZFS: "] {
        if let Some(t) = logged(key, key) {
            println!("{key}{t}");
        }
    }
    0
}

/// What the last line of planarian's own log that holds `holding` says after `after`.
fn logged(holding: &str, after: &str) -> Option<String> {
    let log = std::fs::read_to_string("/var/log/planarian.log").ok()?;
    let line = log.lines().rev().find(|l| l.contains(holding))?;
    let t = line.split_once(after).map_or(line, |(_, t)| t);
    Some(t.trim_end_matches('"').to_string())
}

/// Snapshot, second snapshot, rollback, fork of a sandbox with `files` MiB of files.
fn files_system(tag: &str, annotation: Option<&str>, files: u32) -> Result<[Cost; 4], String> {
    let pid = std::process::id();
    let (ctr, fork) = (format!("plbench-{tag}-{pid}"), format!("plbench-{tag}-fork-{pid}"));
    let mut run = vec!["--runtime", "planarian", "run", "-d", "--name", &ctr];
    if let Some(a) = annotation {
        run.extend(["--annotation", a]);
    }
    run.extend(["localhost/planarian-test/busybox", "sh", "-c", "touch /tmp/up; while :; do sleep 1; done"]);
    let result = (|| -> Result<[Cost; 4], String> {
        run_quiet("podman", &run)?;
        run_quiet("podman", &["exec", &ctr, "sh", "-c", &format!(
            "mkdir -p /data && i=0; while [ $i -lt {files} ]; do head -c 1048576 /dev/urandom > /data/f$i; i=$((i+1)); done")])?;
        wait_file(&ctr, "/tmp/up")?;
        let (sp1, first) = snapshot_cost(&ctr)?;
        run_quiet("podman", &["exec", &ctr, "sh", "-c", "head -c 65536 /dev/urandom > /data/f0"])?;
        let (_, second) = snapshot_cost(&ctr)?;
        run_quiet("podman", &["exec", &ctr, "sh", "-c", "head -c 65536 /dev/urandom > /data/f1"])?;
        let rollback = timed_cost(&mut || run_quiet(PLANARIAN, &["rollback", &ctr, &sp1]).map(drop))?;
        let fork_cost = timed_cost(&mut || run_quiet(PLANARIAN, &["fork", &ctr, &sp1, "--name", &fork]).map(drop))?;
        let sum = run_quiet("podman", &["exec", &fork, "sh", "-c", "cat /data/* | md5sum"])?;
        let want = run_quiet("podman", &["exec", &ctr, "sh", "-c", "cat /data/* | md5sum"])?;
        if sum != want {
            return Err(format!("{tag}: the fork's files differ from the statepoint's"));
        }
        Ok([first, second, rollback, fork_cost])
    })();
    for n in [&fork, &ctr] {
        if let Ok(id) = run_quiet("podman", &["inspect", "--format", "{{.Id}}", n]) {
            let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
            let _ = run_quiet(PLANARIAN, &["gc"]);
            let _ = std::fs::remove_dir_all(std::path::Path::new("/var/lib/planarian/containers").join(id));
        }
    }
    result
}

fn files(args: &[String]) -> i32 {
    let files: u32 = flag(args, "--files").and_then(|s| s.parse().ok()).unwrap_or(64);
    let pool = flag(args, "--pool").map(String::from).or_else(|| std::env::var("PLANARIAN_TEST_ZPOOL").ok());
    let Some(pool) = pool else {
        eprintln!("planarian-bench files: no ZFS pool (--pool POOL, or PLANARIAN_TEST_ZPOOL)");
        return 2;
    };
    let parent = format!("{pool}/bench");
    if run_quiet("zfs", &["list", &parent]).is_err() {
        if let Err(e) = run_quiet("zfs", &["create", &parent]) {
            eprintln!("planarian-bench files: {e}");
            return 1;
        }
    }
    let zfs_annotation = format!("io.planarian.zfs.parent_dataset={parent}");
    let systems: [(&str, Option<&str>); 2] = [("zfs", Some(&zfs_annotation)), ("copy", None)];
    let mut results = Vec::new();
    for (tag, annotation) in systems {
        eprintln!("measuring {tag} ...");
        match files_system(tag, annotation, files) {
            Ok(r) => results.push(r),
            Err(e) => {
                eprintln!("planarian-bench: {tag}: {e}");
                return 1;
            }
        }
    }
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    println!("file statepoints: {files} MiB of files (1 MiB files), 64 KiB rewritten between steps; a small busybox sandbox (its memory dump is in the times)");
    println!("| operation | ZFS ms | copy ms | copy / ZFS | files copied, MiB (ZFS / copy) |");
    println!("|---|---:|---:|---:|---:|");
    let names = ["first snapshot", "second snapshot", "rollback", "fork"];
    for (i, n) in names.iter().enumerate() {
        let (z, c) = (&results[0][i], &results[1][i]);
        let copied = if i < 2 { format!("{:.1} / {:.1}", mb(z.rootfs_bytes), mb(c.rootfs_bytes)) } else { "-".into() };
        println!("| {n} | {:.0} | {:.0} | {:.2}x | {copied} |", z.ms, c.ms, c.ms / z.ms);
    }
    0
}

/// A sandbox that holds memory and then waits, doing nothing (an agent's between tool calls).
const IDLE: &str = r#"
import os, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
open("/tmp/up", "w").close()
time.sleep(1e9)
"#;

/// Forks of one statepoint, with memory restored whole (eager) and on demand (lazy,
/// `checkpoint.lazy_pages`), side by side in one run: the time until a fork answers `podman
/// exec` at each size of `--mem` (and the largest against the smallest), and the same for a
/// rollback that has to restore (`checkpoint.rollback_in_place=false`: the sandbox changed 1 %
/// since the statepoint, stopped and restored); each the median of `--repeat` runs, eager and
/// lazy alternating. Then one fork against `fork --count N` at `--count-mem` (`--count 0`: not).
/// Each fork or rolled back sandbox is checked at the statepoint (the workload's memory checksum)
/// after it was timed, and snapshotted (a lazy one's pages all in and settled) before anything else
/// is timed: its server would otherwise run beside it.
fn forks(args: &[String]) -> i32 {
    let mems: Vec<u32> =
        flag(args, "--mem").unwrap_or("64,1024").split(',').filter_map(|m| m.trim().parse().ok()).collect();
    let files: u32 = flag(args, "--files").and_then(|s| s.parse().ok()).unwrap_or(16);
    let count: usize = flag(args, "--count").and_then(|s| s.parse().ok()).unwrap_or(8);
    let count_mem: u32 = flag(args, "--count-mem").and_then(|s| s.parse().ok()).unwrap_or(256);
    let repeat: usize = flag(args, "--repeat").and_then(|s| s.parse().ok()).unwrap_or(3).max(1);
    let tag = std::process::id();
    let mut made: Vec<String> = Vec::new();
    let result = (|| -> Result<(), String> {
        // Per size: (fork eager, fork lazy, rollback eager, rollback lazy), each run's seconds.
        let mut single: Vec<(u32, [Vec<f64>; 4])> = Vec::new();
        for &mem in &mems {
            let e = ForkSource::start(&format!("plbench-forks-{tag}-e{mem}"), mem, files, false, &mut made)?;
            let l = ForkSource::start(&format!("plbench-forks-{tag}-l{mem}"), mem, files, true, &mut made)?;
            let mut runs: [Vec<f64>; 4] = Default::default();
            for k in 1..=repeat {
                runs[0].push(e.forks(&format!("{}-f{k}-", e.name), 1, &mut made)?);
                runs[1].push(l.forks(&format!("{}-f{k}-", l.name), 1, &mut made)?);
                runs[2].push(e.rollback_restored()?);
                runs[3].push(l.rollback_restored()?);
            }
            single.push((mem, runs));
            for n in [&e.name, &l.name] {
                let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
            }
        }
        let median = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        for (i, what) in [(0, "one fork"), (2, "a rollback that has to restore (1 % changed since the statepoint)")] {
            println!(
                "{what}, until it answers `podman exec` ({files} MiB of files; each checked at the statepoint's memory checksum; median of {repeat}):"
            );
            println!("{:<10} {:>12} {:>12} {:>14}   runs eager | lazy", "memory", "eager s", "lazy s", "lazy / eager");
            for (mem, runs) in &single {
                let (e, l) = (median(&runs[i]), median(&runs[i + 1]));
                let each = |v: &[f64]| v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" ");
                println!(
                    "{:<10} {e:>12.1} {l:>12.1} {:>14.2}   {} | {}",
                    format!("{mem} MiB"),
                    l / e,
                    each(&runs[i]),
                    each(&runs[i + 1])
                );
            }
            if let (Some(a), Some(b)) = (single.first(), single.last()) {
                if a.0 != b.0 {
                    let r = |j: usize| median(&b.1[j]) / median(&a.1[j]);
                    println!("{} MiB against {} MiB: eager {:.2}×, lazy {:.2}×", b.0, a.0, r(i), r(i + 1));
                }
            }
            println!();
        }
        if count == 0 {
            return Ok(());
        }
        let e = ForkSource::start(&format!("plbench-forks-{tag}-ce"), count_mem, files, false, &mut made)?;
        let l = ForkSource::start(&format!("plbench-forks-{tag}-cl"), count_mem, files, true, &mut made)?;
        let e1 = e.forks(&format!("{}-one", e.name), 1, &mut made)?;
        let l1 = l.forks(&format!("{}-one", l.name), 1, &mut made)?;
        let en = e.forks(&format!("{}-n", e.name), count, &mut made)?;
        let ln = l.forks(&format!("{}-n", l.name), count, &mut made)?;
        println!(
            "fork --count {count} of {count_mem} MiB ({files} MiB of files), until every fork answers `podman exec`:"
        );
        println!("{:<10} {:>12} {:>16} {:>14}", "", "one fork s", format!("--count {count} s"), "× one fork");
        for (what, one, n) in [("eager", e1, en), ("lazy", l1, ln)] {
            println!("{what:<10} {one:>12.1} {n:>16.1} {:>14.2}", n / one);
        }
        println!("lazy --count {count} against eager --count {count}: {:.2}", ln / en);
        Ok(())
    })();
    for n in made.iter().rev() {
        let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
    }
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("planarian-bench forks: {e}");
            1
        }
    }
}

/// A sandbox and a statepoint of it to fork, restored eagerly or lazily.
struct ForkSource {
    name: String,
    sp: String,
    want: String,
}

impl ForkSource {
    /// `name` with `mem` MiB: a full statepoint, 1 % of memory and a file changed, and the
    /// statepoint forked then taken (an incremental one, as an agent's usually is).
    fn start(name: &str, mem: u32, files: u32, lazy: bool, made: &mut Vec<String>) -> Result<ForkSource, String> {
        made.push(name.to_string());
        // (lazy: on demand at every size, the threshold too, to measure both sides at each)
        let on =
            if lazy { "io.planarian.checkpoint.lazy_pages=true" } else { "io.planarian.checkpoint.lazy_pages=false" };
        // (a rollback of it restores: the case of a fork's restore that #31 names beside forks)
        let extra: &[&str] = &[
            "--annotation",
            on,
            "--annotation",
            "io.planarian.checkpoint.lazy_pages_min_mib=0",
            "--annotation",
            "io.planarian.checkpoint.rollback_in_place=false",
        ];
        start_script_with("planarian", name, WORKLOAD, mem, files, extra)?;
        run_quiet(PLANARIAN, &["snapshot", name])?;
        dirty(name)?;
        let sp = run_quiet(PLANARIAN, &["snapshot", name])?;
        let want = checksum(name)?;
        Ok(ForkSource { name: name.to_string(), sp, want })
    }

    /// The sandbox changed 1 % since the statepoint, then rolled back to it by a restore, until it
    /// answers `podman exec`: seconds. Then it is checked and snapshotted.
    fn rollback_restored(&self) -> Result<f64, String> {
        dirty(&self.name)?;
        let t = Instant::now();
        run_quiet(PLANARIAN, &["rollback", self.name.as_str(), self.sp.as_str()])?;
        run_quiet("podman", &["exec", self.name.as_str(), "true"])?;
        let secs = t.elapsed().as_secs_f64();
        let got = checksum(&self.name)?;
        if got != self.want {
            return Err(format!("{} rolled back: memory checksum {got}, the statepoint's is {}", self.name, self.want));
        }
        run_quiet(PLANARIAN, &["snapshot", self.name.as_str()])?;
        Ok(secs)
    }

    /// `n` forks in one call, until each answers `podman exec`: seconds. Then each is checked,
    /// snapshotted and removed.
    fn forks(&self, prefix: &str, n: usize, made: &mut Vec<String>) -> Result<f64, String> {
        let names: Vec<String> = (1..=n).map(|k| format!("{prefix}{k}")).collect();
        made.extend(names.iter().cloned());
        let t = Instant::now();
        let count = n.to_string();
        let mut a = vec!["fork", self.name.as_str(), self.sp.as_str(), "--count", count.as_str()];
        for name in &names {
            a.extend(["--name", name.as_str()]);
        }
        run_quiet(PLANARIAN, &a)?;
        for name in &names {
            run_quiet("podman", &["exec", name, "true"])?;
        }
        let secs = t.elapsed().as_secs_f64();
        for name in &names {
            let got = checksum(name)?;
            if got != self.want {
                return Err(format!("{name}: memory checksum {got}, the statepoint's is {}", self.want));
            }
            run_quiet(PLANARIAN, &["snapshot", name])?;
            run_quiet("podman", &["rm", "-f", "-t", "0", name])?;
        }
        Ok(secs)
    }
}

/// A statepoint of a sandbox that did nothing since its last one, against an incremental
/// statepoint of the same sandbox after a 1 % change (both measured here, one after the other,
/// the same memory and files): the ratio #31 asks to be at most 0.1.
fn unchanged(args: &[String]) -> i32 {
    let mem: u32 = flag(args, "--mem").and_then(|s| s.parse().ok()).unwrap_or(256);
    let files: u32 = flag(args, "--files").and_then(|s| s.parse().ok()).unwrap_or(16);
    let iterations: usize = flag(args, "--iterations").and_then(|s| s.parse().ok()).unwrap_or(5);
    let pid = std::process::id();
    let (idle, busy) = (format!("plbench-idle-{pid}"), format!("plbench-busy-{pid}"));
    let result = (|| -> Result<(), String> {
        start_workload("planarian", &busy, mem, files)?;
        start_script("planarian", &idle, IDLE, mem, files)?;
        let (mut free, mut inc) = (Vec::new(), Vec::new());
        snapshot_cost(&idle)?;
        snapshot_cost(&busy)?;
        for _ in 0..iterations {
            let (sp, c) = snapshot_cost(&idle)?;
            if manifest(&idle, &sp)?["chain"]["same-as"].is_null() {
                return Err(format!("{idle} {sp} was dumped (see /var/log/planarian.log for why)"));
            }
            free.push(c);
            dirty(&busy)?;
            let (sp, c) = snapshot_cost(&busy)?;
            if c.full_reason.is_some() || !manifest(&busy, &sp)?["chain"]["same-as"].is_null() {
                return Err(format!("{busy} {sp} is not an incremental dump"));
            }
            inc.push(c);
        }
        let median = |v: &[Cost], f: fn(&Cost) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            x.sort_by(|a, b| a.total_cmp(b));
            x[x.len() / 2]
        };
        println!("statepoint of a sandbox that did nothing vs an incremental one ({mem} MiB, {files} MiB of files, median of {iterations}):");
        println!("{:<34} {:>10} {:>10} {:>10} {:>9}", "", "total ms", "frozen ms", "CRIU ms", "pages");
        for (what, v) in [("unchanged (no dump)", &free), ("incremental (1 % of memory changed)", &inc)] {
            println!(
                "{:<34} {:>10.0} {:>10.0} {:>10.0} {:>9.0}",
                what,
                median(v, |c| c.ms),
                median(v, |c| c.frozen_ms),
                median(v, |c| c.criu_ms),
                median(v, |c| c.pages as f64)
            );
        }
        let (f, i) = (median(&free, |c| c.ms), median(&inc, |c| c.ms));
        println!("ratio unchanged / incremental: {:.2}", f / i);
        // What any planarian command costs here before it does anything: its process started and
        // ended, which both statepoints pay. (`snapshot --help`: one process that reads nothing;
        // `--version` would also run crun's.)
        let mut floor = Vec::new();
        for _ in 0..iterations {
            floor.push(timed_cost(&mut || run_quiet(PLANARIAN, &["snapshot", "--help"]).map(|_| ()))?);
        }
        let floor = median(&floor, |c| c.ms);
        println!(
            "a planarian command that does nothing (`planarian snapshot --help`, median of {iterations}): {floor:.0} ms; the ratio without it: {:.2}",
            (f - floor) / (i - floor)
        );
        // Where the last of each went, as planarian's log has it.
        for (what, n) in [("unchanged", &idle), ("incremental", &busy)] {
            let id = run_quiet("podman", &["inspect", "--format", "{{.Id}}", n])?;
            let short = &id[..12.min(id.len())];
            if let Some(t) = logged(&format!(" of {short} timeline"), "timeline (ms): ") {
                println!("{what}: {t}");
            }
        }
        Ok(())
    })();
    for n in [&idle, &busy] {
        let _ = run_quiet("podman", &["rm", "-f", "-t", "0", n]);
    }
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("planarian-bench unchanged: {e}");
            1
        }
    }
}
