//! `lazy`: what CRIU's lazy restore (`criu restore --lazy-pages` with a `criu lazy-pages`
//! daemon serving the pages over userfaultfd) would give a fork, measured on CRIU itself before
//! planarian relies on it (#31). A process holding MEM MiB of random data is dumped once, then
//! restored from the same images twice: fully (every page copied before it runs), and lazily
//! (it runs at once; the daemon pushes the rest). For each: the time until the process runs,
//! whether its memory is exact (its own checksum against the one it had), and — the question
//! for Algorithm 1 — how many of its pages are soft-dirty once every page arrived, the bits
//! cleared when it resumed (what planarian's pre-resume hook does): pages installed after that
//! look written, and would make the first snapshot after such a restore as large as a full one.
//!
//! The process is a plain one (no container): this measures CRIU and the kernel, not Podman.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `planarian-bench __hold MIB DIR`: the measured process. Fills MIB MiB with pseudo-random
/// data, writes `PID CHECKSUM` to DIR/ready, then waits for a writer on the FIFO DIR/ask; at each
/// line it reads, writes the checksum of its memory as it is now to DIR/sum.
pub fn hold(args: &[String]) -> i32 {
    let (Some(mib), Some(dir)) = (args.first().and_then(|m| m.parse::<usize>().ok()), args.get(1)) else {
        return 2;
    };
    let dir = PathBuf::from(dir);
    let mut mem = vec![0u64; mib << 17];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for w in mem.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *w = x;
    }
    let put = |name: &str, text: String| {
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, dir.join(name))).is_ok()
    };
    if !put("ready", format!("{} {}", std::process::id(), sum(&mem))) {
        return 1;
    }
    loop {
        // (blocks in open until the bench writes: an idle process, nothing of it runs)
        let Ok(mut f) = std::fs::File::open(dir.join("ask")) else { return 1 };
        let mut line = String::new();
        let _ = f.read_to_string(&mut line);
        put("sum", sum(&mem).to_string());
    }
}

fn sum(mem: &[u64]) -> u64 {
    mem.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, w| (h ^ w).wrapping_mul(0x100_0000_01b3))
}

/// Waits (polling, at most `max`) until `f` says yes.
fn until(max: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + max;
    while !f() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// The checksum process `pid` computes of its memory now.
fn ask_sum(dir: &Path) -> Result<u64, String> {
    let _ = std::fs::remove_file(dir.join("sum"));
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ask"))
        .and_then(|mut f| f.write_all(b"sum\n"))
        .map_err(|e| format!("ask: {e}"))?;
    if !until(Duration::from_secs(600), || dir.join("sum").exists()) {
        return Err("no checksum from the restored process".into());
    }
    std::fs::read_to_string(dir.join("sum")).map_err(|e| e.to_string())?.trim().parse().map_err(|_| "bad sum".into())
}

/// Present and soft-dirty pages of process `pid`'s private writable anonymous mappings.
fn soft_dirty(pid: u32) -> Result<(u64, u64), String> {
    use sys::proc::pagemap::{scan, PRESENT, SOFT_DIRTY};
    use sys::proc::{PROT_READ, PROT_WRITE};
    let me = sys::proc::Proc::of(pid as i32);
    let pagemap = me.open("pagemap").map_err(|e| e.to_string())?;
    let (mut present, mut dirty) = (0, 0);
    let rw = PROT_READ | PROT_WRITE;
    for m in me.maps().map_err(|e| e.to_string())? {
        if !m.path.is_empty() || m.prot & rw != rw || m.shared {
            continue;
        }
        let _ = scan(&pagemap, m.start, m.end, |_, e| {
            if e & PRESENT != 0 {
                present += 1;
                dirty += u64::from(e & SOFT_DIRTY != 0);
            }
            std::ops::ControlFlow::Continue(())
        })
        .map_err(|e| e.to_string())?;
    }
    Ok((present, dirty))
}

fn kill(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    until(Duration::from_secs(60), || !sys::proc::Proc::of(pid as i32).dir().exists());
}

fn criu(args: &[&str]) -> Result<(), String> {
    crate::run_checked("criu", args).map(drop)
}

struct Row {
    mib: usize,
    full: Duration,
    lazy: Duration,
    all_in: Duration,
    present: u64,
    dirty: u64,
    /// Soft-dirty pages after the bits were cleared and one page was written back through
    /// `/proc/PID/mem` (a settling step's write-back): 1 when that marks that page alone.
    redirtied: u64,
    exact: bool,
}

/// The write-back a lazy fork's settling needs, tried on the idle process: its soft-dirty bits
/// cleared, one byte of its largest private anonymous mapping read and written back as it was
/// through `/proc/PID/mem`; how many pages are soft-dirty then.
fn rewrite_one(pid: u32) -> Result<u64, String> {
    use std::os::unix::fs::FileExt;
    let me = sys::proc::Proc::of(pid as i32);
    let m = me
        .maps()
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|m| m.path.is_empty() && !m.shared && m.prot & sys::proc::PROT_WRITE != 0)
        .max_by_key(|m| m.end - m.start)
        .ok_or("no private anonymous mapping")?;
    me.clear_soft_dirty().map_err(|e| e.to_string())?;
    let mem = me.open_mem_rw().map_err(|e| e.to_string())?;
    let mut b = [0u8; 1];
    mem.read_exact_at(&mut b, m.start).map_err(|e| e.to_string())?;
    mem.write_all_at(&b, m.start).map_err(|e| e.to_string())?;
    Ok(soft_dirty(pid)?.1)
}

fn one(mib: usize, base: &Path) -> Result<Row, String> {
    let dir = base.join(format!("{mib}"));
    let img = dir.join("img");
    std::fs::create_dir_all(&img).map_err(|e| e.to_string())?;
    crate::run_checked("mkfifo", &[dir.join("ask").to_str().unwrap_or_default()])?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // (its own session, no terminal, nothing inherited: a tree CRIU dumps as it is)
    Command::new("setsid")
        .arg("--fork")
        .arg(&exe)
        .args(["__hold", &mib.to_string(), dir.to_str().unwrap_or_default()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !until(Duration::from_secs(600), || dir.join("ready").exists()) {
        return Err("the process did not start".into());
    }
    let ready = std::fs::read_to_string(dir.join("ready")).map_err(|e| e.to_string())?;
    let (pid, want) = ready.split_once(' ').ok_or("bad ready file")?;
    let (pid, want): (u32, u64) = (pid.parse().map_err(|_| "pid")?, want.trim().parse().map_err(|_| "sum")?);
    let i = img.to_str().unwrap_or_default();
    criu(&["dump", "-t", &pid.to_string(), "-D", i, "-o", "dump.log"])?;
    until(Duration::from_secs(60), || !sys::proc::Proc::of(pid as i32).dir().exists());

    // Fully: every page copied before the process runs.
    let pidfile = dir.join("pid");
    let p = pidfile.to_str().unwrap_or_default();
    let t = Instant::now();
    criu(&["restore", "-D", i, "-d", "--pidfile", p, "-o", "restore-full.log"])?;
    let full = t.elapsed();
    let exact_full = ask_sum(&dir)? == want;
    kill(pid);

    // Lazily: the daemon serves the pages; the process runs before they are all there.
    let _ = std::fs::remove_file(&pidfile);
    let mut daemon = Command::new("criu")
        .args(["lazy-pages", "-D", i, "-o", "lazy-pages.log"])
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    if !until(Duration::from_secs(60), || img.join("lazy-pages.socket").exists()) {
        let _ = daemon.kill();
        return Err("criu lazy-pages did not listen".into());
    }
    let t = Instant::now();
    let restored = criu(&["restore", "-D", i, "--lazy-pages", "-d", "--pidfile", p, "-o", "restore-lazy.log"]);
    let lazy = t.elapsed();
    if let Err(e) = restored {
        let _ = daemon.kill();
        return Err(e);
    }
    // (what the pre-resume hook does, as soon as it runs)
    let _ = sys::proc::Proc::of(pid as i32).clear_soft_dirty();
    let _ = daemon.wait();
    let all_in = t.elapsed();
    let (present, dirty) = soft_dirty(pid)?;
    let redirtied = rewrite_one(pid)?;
    let exact_lazy = ask_sum(&dir)? == want;
    kill(pid);
    Ok(Row { mib, full, lazy, all_in, present, dirty, redirtied, exact: exact_full && exact_lazy })
}

pub fn main(args: &[String]) -> i32 {
    let mems: Vec<usize> =
        crate::flag(args, "--mem").unwrap_or("64,1024").split(',').filter_map(|m| m.trim().parse().ok()).collect();
    let base = PathBuf::from(format!("/var/tmp/plbench-lazy-{}", std::process::id()));
    let version = crate::run_quiet("criu", &["--version"]).unwrap_or_default();
    println!("CRIU {} on kernel {}", version.lines().next().unwrap_or("?").trim_start_matches("Version: "), {
        crate::run_quiet("uname", &["-r"]).unwrap_or_default()
    });
    println!(
        "{:>6} {:>14} {:>14} {:>17} {:>16} {:>11} {:>7}",
        "MiB", "full: runs s", "lazy: runs s", "lazy: all in s", "soft-dirty/in", "re-dirtied", "exact"
    );
    let mut rows = Vec::new();
    for mib in mems {
        match one(mib, &base) {
            Ok(r) => {
                println!(
                    "{:>6} {:>14.2} {:>14.2} {:>17.2} {:>16} {:>11} {:>7}",
                    r.mib,
                    r.full.as_secs_f64(),
                    r.lazy.as_secs_f64(),
                    r.all_in.as_secs_f64(),
                    format!("{}/{}", r.dirty, r.present),
                    r.redirtied,
                    if r.exact { "yes" } else { "NO" }
                );
                rows.push(r);
            }
            Err(e) => {
                eprintln!("planarian-bench lazy: {mib} MiB: {e}");
                let _ = std::fs::remove_dir_all(&base);
                return 1;
            }
        }
    }
    if let (Some(a), Some(b)) = (rows.first(), rows.last()) {
        if rows.len() > 1 {
            println!(
                "{} MiB against {} MiB: full restore {:.2}×, lazy restore {:.2}× (until it runs)",
                b.mib,
                a.mib,
                b.full.as_secs_f64() / a.full.as_secs_f64(),
                b.lazy.as_secs_f64() / a.lazy.as_secs_f64()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&base);
    if rows.iter().all(|r| r.exact) {
        0
    } else {
        1
    }
}
