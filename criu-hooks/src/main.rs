//! `planarian-criu-hooks`: the action script planarian passes to `criu restore`.
//!
//! At `pre-resume` (every task restored and still stopped): clear the soft-dirty bits of every
//! restored process, compute E = 1 + the latest start time of the restored threads, wait until
//! the system uptime reaches E, and record E (in clock ticks) in the file named by
//! `PLANARIAN_EPOCH_FILE`. Every other action exits 0 at once.
//!
//! CRIU only logs a failing pre-resume script, so success is the recorded file: the shim treats a
//! restore without it as no valid incremental base and makes the next dump full.

use std::path::Path;

fn main() {
    // A tool for the shim and for operators: planarian-criu-hooks set-dump-uptime INVENTORY USEC
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [cmd, path, usec] = &args[..] {
        if cmd == "set-dump-uptime" {
            let r = match usec.parse::<u64>() {
                Ok(u) => criu_hooks::rewrite_dump_uptime(Path::new(path), u).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
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

fn pre_resume() -> Result<(), criu_hooks::HookError> {
    use criu_hooks::HookError::NotSet;
    let init: i32 =
        std::env::var("CRTOOLS_INIT_PID").ok().and_then(|p| p.parse().ok()).ok_or(NotSet("CRTOOLS_INIT_PID"))?;
    let out = std::env::var_os("PLANARIAN_EPOCH_FILE").ok_or(NotSet("PLANARIAN_EPOCH_FILE"))?;
    criu_hooks::pre_resume(init, Path::new(&out))
}
