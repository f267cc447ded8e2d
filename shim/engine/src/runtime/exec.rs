//! A tool call's processes in a session of the container's own.
//!
//! crun gives a process started by `exec` a session of its own only when it has a terminal;
//! otherwise it stays in conmon's session, whose leader is outside the container's PID
//! namespace. Whatever it leaves running in the background (a server an agent started, a
//! build's daemon) or as a zombie is then in that session too, and CRIU refuses to dump any such
//! process ("A session leader of N(M) is outside of its pid namespace"): one background process
//! started through `podman exec` would make every later statepoint fail.
//!
//! crun 1.20 and later call setsid(2) for every exec themselves ([`runtime_gives_exec_a_session`]):
//! nothing is wrapped then. With an older crun, for a non-terminal `exec` whose command the
//! container can run, planarian starts it
//! through the container's own `setsid` (busybox's or util-linux's; as the process is no
//! process-group leader, `setsid` calls setsid(2) and execs the command: same PID, same exit
//! code, same output). Nothing changes when any of that is in doubt — no `setsid` in the
//! container, a command that does not resolve (crun reports it, in crun's words), a user other
//! than root, a process file planarian cannot read — the exec then runs exactly as crun runs it.

use nix::unistd::{access, chdir, chroot, fork, AccessFlags, ForkResult};
use serde_json::Value;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Where images keep `setsid`.
const SETSID: [&str; 4] = ["/usr/bin/setsid", "/bin/setsid", "/usr/sbin/setsid", "/sbin/setsid"];
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What to run instead of the process's own `args`, if anything: `[setsid, args…]`.
pub fn in_own_session(process: &Value, init_pid: i32) -> Option<Vec<Value>> {
    if process["terminal"].as_bool() == Some(true) || process["user"]["uid"].as_u64().unwrap_or(0) != 0 {
        return None;
    }
    let args = process["args"].as_array()?;
    let command = args.first()?.as_str()?;
    if command.is_empty() || SETSID.iter().any(|s| Path::new(s).file_name() == Path::new(command).file_name()) {
        return None;
    }
    let path_var = process["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH);
    let candidates: Vec<PathBuf> = if command.contains('/') {
        vec![PathBuf::from(command)]
    } else {
        path_var.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(command)).collect()
    };
    let cwd = process["cwd"].as_str().unwrap_or("/");
    let setsid = resolve_in(&sys::proc::Proc::of(init_pid).root(), cwd, &candidates)?;
    let mut out = vec![Value::from(setsid)];
    out.extend(args.iter().cloned());
    Some(out)
}

/// In a child chrooted into the container's root (its mounts as the container sees them):
/// whether one of `candidates` is an executable file, and which `setsid` is there. The answer is
/// the child's exit code: the index of the `setsid` found, plus one; 0 for no.
fn resolve_in(root: &Path, cwd: &str, candidates: &[PathBuf]) -> Option<&'static str> {
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).ok();
    let root_c = c(root)?;
    let cwd_c = c(Path::new(cwd))?;
    let cands: Vec<CString> = candidates.iter().filter_map(|p| c(p)).collect();
    let setsids: Vec<CString> = SETSID.iter().filter_map(|s| c(Path::new(s))).collect();
    // SAFETY: the child only makes system calls (chroot, chdir, access, stat) on strings made
    // before the fork, and leaves by _exit.
    match unsafe { fork() }.ok()? {
        ForkResult::Child => {
            let runnable = |p: &CString| access(p.as_c_str(), AccessFlags::X_OK).is_ok() && is_file(p);
            let code = if chroot(root_c.as_c_str()).is_err()
                || chdir(cwd_c.as_c_str()).is_err()
                || !cands.iter().any(runnable)
            {
                0
            } else {
                setsids.iter().position(runnable).map_or(0, |i| i as i32 + 1)
            };
            // SAFETY: leaving the forked child without running the parent's exit handlers.
            unsafe { nix::libc::_exit(code) }
        }
        ForkResult::Parent { child } => match nix::sys::wait::waitpid(child, None).ok()? {
            nix::sys::wait::WaitStatus::Exited(_, code) if code > 0 => SETSID.get(code as usize - 1).copied(),
            _ => None,
        },
    }
}

fn is_file(p: &CString) -> bool {
    nix::sys::stat::stat(p.as_c_str()).is_ok_and(|st| st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFREG)
}

/// Whether `crun` itself gives every exec'd process a session of its own: crun 1.20 and later
/// call setsid(2) for every `crun exec` (before, only with a terminal). Then the wrapper is not
/// needed — and must not be used: `setsid` of a process that already leads its session forks,
/// and its parent's exit status (0) would become the exec's. The answer is kept per boot under
/// /run/planarian, by the binary's identity, so the pass-through asks crun once.
pub fn runtime_gives_exec_a_session(crun: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(crun) else { return false };
    let key = format!("{}-{}-{}", meta.ino(), meta.size(), meta.mtime());
    let cache = Path::new(CACHE_DIR).join(format!("crun-exec-setsid-{key}"));
    if let Ok(v) = std::fs::read_to_string(&cache) {
        return v.trim() == "1";
    }
    let Ok(out) = std::process::Command::new(crun).arg("--version").output() else { return false };
    let gives = crun_version(&String::from_utf8_lossy(&out.stdout)).is_some_and(|v| v >= (1, 20));
    if std::fs::create_dir_all(CACHE_DIR).is_ok() {
        let _ = sys::write_atomic(&cache, if gives { b"1" } else { b"0" }, 0o644);
    }
    gives
}

const CACHE_DIR: &str = "/run/planarian";

/// `crun version 1.21` (the first line of `crun --version`) → (1, 21).
fn crun_version(text: &str) -> Option<(u32, u32)> {
    let v = text.lines().next()?.strip_prefix("crun version ")?;
    let mut parts = v.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Rewrites the process file of an `exec` (Podman's `--process FILE`) so that its command runs
/// in a session of its own; leaves it untouched when it cannot. Says whether it did.
pub fn rewrite_process_file(file: &Path, init_pid: i32) -> bool {
    let Ok(bytes) = std::fs::read(file) else { return false };
    let Ok(mut process) = serde_json::from_slice::<Value>(&bytes) else { return false };
    let Some(args) = in_own_session(&process, init_pid) else { return false };
    process["args"] = Value::Array(args);
    let Ok(text) = serde_json::to_vec(&process) else { return false };
    // (Podman wrote it for this one exec; crun reads it once planarian has exec'd it)
    std::fs::write(file, text).is_ok()
}

/// The command of an exec's process file, as one line (for messages).
pub fn command_line(file: &Path) -> String {
    let Ok(bytes) = std::fs::read(file) else { return String::new() };
    let Ok(process) = serde_json::from_slice::<Value>(&bytes) else { return String::new() };
    let args: Vec<&str> = process["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    // (the setsid planarian put in front is not the user's)
    let args = match args.first() {
        Some(a) if SETSID.contains(a) => &args[1..],
        _ => &args[..],
    };
    args.join(" ").chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn crun_versions_read() {
        assert_eq!(crun_version("crun version 1.21\ncommit: x\n"), Some((1, 21)));
        assert_eq!(crun_version("crun version 1.8.1\n"), Some((1, 8)));
        assert_eq!(crun_version("runc version 1.1.0\n"), None);
        assert!(crun_version("crun version 1.20\n").unwrap() >= (1, 20));
        assert!(crun_version("crun version 1.8.1\n").unwrap() < (1, 20));
    }

    #[test]
    fn only_a_root_process_without_a_terminal_is_wrapped() {
        // This test process's own root stands in for a container's (the host has a setsid).
        let me = std::process::id() as i32;
        let p = |extra: Value| {
            let mut v = json!({"args": ["sh", "-c", "sleep 1 &"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0}});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            v
        };
        if !SETSID.iter().any(|s| Path::new(s).exists()) || !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root and a setsid on this host");
            return;
        }
        let args = in_own_session(&p(json!({})), me).expect("wrapped");
        assert!(args[0].as_str().unwrap().ends_with("/setsid"), "{args:?}");
        assert_eq!(&args[1..], &[json!("sh"), json!("-c"), json!("sleep 1 &")]);
        assert_eq!(in_own_session(&p(json!({"terminal": true})), me), None);
        assert_eq!(in_own_session(&p(json!({"user": {"uid": 1000, "gid": 1000}})), me), None);
        // A command the container cannot run is crun's to report.
        assert_eq!(in_own_session(&p(json!({"args": ["no-such-command-here"]})), me), None);
        assert_eq!(in_own_session(&p(json!({"args": ["/etc/passwd"]})), me), None);
        assert_eq!(in_own_session(&p(json!({"cwd": "/no/such/dir"})), me), None);
        assert_eq!(in_own_session(&p(json!({"args": ["setsid", "x"]})), me), None);
    }
}
