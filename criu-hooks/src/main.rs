//! `planarian-criu-hooks`: the action script planarian passes to `criu restore`.
//!
//! At `pre-resume` (every task restored and still stopped): clear the soft-dirty bits of every
//! restored process, compute E = 1 + the latest start time of the restored threads, wait until
//! the system uptime reaches E, and record E (in clock ticks) in the file named by
//! `PLANARIAN_EPOCH_FILE`. Every other action exits 0 at once.
//!
//! CRIU only logs a failing pre-resume script, so success is the recorded file: the shim treats a
//! restore without it as no valid incremental base and makes the next dump full.

use criu_hooks::{clear_soft_dirty, epoch, restored_tree, uptime_ticks};
use std::path::Path;
use std::time::{Duration, Instant};

fn main() {
    // A tool for the shim and for operators: planarian-criu-hooks set-dump-uptime INVENTORY USEC
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [cmd, path, usec] = &args[..] {
        if cmd == "set-dump-uptime" {
            let r = usec
                .parse::<u64>()
                .map_err(|e| e.to_string())
                .and_then(|u| criu_hooks::rewrite_dump_uptime(Path::new(path), u).map_err(|e| e.to_string()));
            if let Err(e) = r {
                eprintln!("planarian-criu-hooks: {path}: {e}");
                std::process::exit(1);
            }
            return;
        }
    }
    if std::env::var("CRTOOLS_SCRIPT_ACTION").as_deref() != Ok("pre-resume") {
        return;
    }
    if let Err(e) = pre_resume() {
        eprintln!("planarian-criu-hooks: pre-resume: {e}");
        std::process::exit(1);
    }
}

fn pre_resume() -> Result<(), String> {
    let proc = Path::new("/proc");
    let init: i32 = std::env::var("CRTOOLS_INIT_PID")
        .ok()
        .and_then(|p| p.parse().ok())
        .ok_or("CRTOOLS_INIT_PID is not set")?;
    let out = std::env::var_os("PLANARIAN_EPOCH_FILE").ok_or("PLANARIAN_EPOCH_FILE is not set")?;
    let clk = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .ok_or("cannot read CLK_TCK")? as u64;
    let tree = restored_tree(proc, init);
    if tree.is_empty() {
        return Err(format!("no restored process under {init}"));
    }
    for pid in &tree {
        clear_soft_dirty(proc, *pid).map_err(|e| format!("clear_refs of {pid}: {e}"))?;
    }
    let e = epoch(proc, &tree).ok_or("no start time of the restored threads")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while uptime_ticks(proc, clk).ok_or("cannot read /proc/uptime")? < e {
        if Instant::now() > deadline {
            return Err(format!("uptime did not reach E = {e} ticks"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let tmp = Path::new(&out).with_extension("tmp");
    std::fs::write(&tmp, format!("{e} {clk}\n")).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &out).map_err(|e| format!("cannot record E: {e}"))
}
