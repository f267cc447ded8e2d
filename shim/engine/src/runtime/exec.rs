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
//!
//! A command started with `podman exec -d` ([`in_background`]) is no tool call: it is started by
//! the container's shell in the background, so that it is orphaned to the container's init and
//! in the tree every statepoint dumps.

use nix::unistd::{access, chdir, chroot, fork, AccessFlags, ForkResult};
use serde_json::Value;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Where images keep `setsid`.
const SETSID: [&str; 4] = ["/usr/bin/setsid", "/bin/setsid", "/usr/sbin/setsid", "/sbin/setsid"];
/// Where images keep a shell.
const SH: [&str; 2] = ["/bin/sh", "/usr/bin/sh"];
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// What a detached command is started through ([`in_background`]): the shell starts it (`"$@"`)
/// with none of conmon's stdio, and ends.
const BACKGROUND: &str = "\"$@\" </dev/null >/dev/null 2>&1 &";

/// What to run instead of the process's own `args`, if anything: `[setsid, args…]`.
pub fn in_own_session(process: &Value, init_pid: i32) -> Option<Vec<Value>> {
    let (args, setsid) = wrappable(process, init_pid, &SETSID)?;
    let mut out = vec![Value::from(setsid)];
    out.extend(args.iter().cloned());
    Some(out)
}

/// For a command started with `podman exec -d`: what to run instead of its `args` so that it
/// becomes a child of the container's init, in the container's process tree — which every
/// statepoint dumps, while a process whose parent is conmon (outside the container) is in no
/// tree CRIU can dump, and would be missing from every statepoint. A shell of the container
/// starts the command in the background, its stdio `/dev/null` (conmon, whose pipes they were,
/// leaves once the shell ended; no one reads a detached command's output), and ends: the
/// command is orphaned to init, as `sh -c 'server &'` through an attached exec would be. In a
/// session of its own (`setsid` first) unless crun gives it one (`own_session` false). `None`,
/// nothing changed, when in doubt (see [`in_own_session`]); the shell of a non-interactive
/// background job ignores SIGINT and SIGQUIT, as for any `server &`.
pub fn in_background(process: &Value, init_pid: i32, own_session: bool) -> Option<Vec<Value>> {
    let (args, sh) = wrappable(process, init_pid, &SH)?;
    let mut out = Vec::new();
    if own_session {
        out.push(Value::from(wrappable(process, init_pid, &SETSID)?.1));
    }
    out.extend([Value::from(sh), Value::from("-c"), Value::from(BACKGROUND), Value::from("sh")]);
    out.extend(args.iter().cloned());
    Some(out)
}

/// The process's `args`, and the first of `tools` its container has, when its command can be
/// wrapped: no terminal, root, a command the container can run from its working directory (one
/// it cannot is crun's to report, in crun's words) that is no `setsid` itself.
fn wrappable<'a>(process: &'a Value, init_pid: i32, tools: &[&'static str]) -> Option<(&'a Vec<Value>, &'static str)> {
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
    let tool = resolve_in(&sys::proc::Proc::of(init_pid).root(), cwd, &candidates, tools)?;
    Some((args, tool))
}

/// In a child chrooted into the container's root (its mounts as the container sees them):
/// whether one of `candidates` is an executable file, and which of `tools` is there first. The
/// answer is the child's exit code: the index of the tool found, plus one; 0 for no.
fn resolve_in(root: &Path, cwd: &str, candidates: &[PathBuf], tools: &[&'static str]) -> Option<&'static str> {
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).ok();
    let root_c = c(root)?;
    let cwd_c = c(Path::new(cwd))?;
    let cands: Vec<CString> = candidates.iter().filter_map(|p| c(p)).collect();
    let tools_c: Vec<CString> = tools.iter().filter_map(|s| c(Path::new(s))).collect();
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
                tools_c.iter().position(runnable).map_or(0, |i| i as i32 + 1)
            };
            // SAFETY: leaving the forked child without running the parent's exit handlers.
            unsafe { nix::libc::_exit(code) }
        }
        ForkResult::Parent { child } => match nix::sys::wait::waitpid(child, None).ok()? {
            nix::sys::wait::WaitStatus::Exited(_, code) if code > 0 => tools.get(code as usize - 1).copied(),
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

/// Rewrites the process file of an `exec` (Podman's `--process FILE`) with `wrap`'s `args`
/// ([`in_own_session`], [`in_background`]); leaves it untouched when `wrap` gives none. Says
/// whether it did.
pub fn rewrite_process_file(file: &Path, wrap: impl FnOnce(&Value) -> Option<Vec<Value>>) -> bool {
    let Ok(bytes) = std::fs::read(file) else { return false };
    let Ok(mut process) = serde_json::from_slice::<Value>(&bytes) else { return false };
    let Some(args) = wrap(&process) else { return false };
    process["args"] = Value::Array(args);
    let Ok(text) = serde_json::to_vec(&process) else { return false };
    // (Podman wrote it for this one exec; crun reads it once planarian has exec'd it)
    std::fs::write(file, text).is_ok()
}

/// Blocks until process `pid` has exited (a pidfd's poll; a process not there has), at most
/// `max`. Without pidfds (kernels before 5.3), a short wait, the caller looking again.
pub fn wait_for_exit(pid: i32, max: Option<std::time::Duration>) {
    match crate::pidfd::open(pid) {
        Ok(fd) => {
            let _ = crate::pidfd::wait(&fd, max);
        }
        Err(e) if e.raw_os_error() == Some(nix::libc::ENOSYS) => {
            std::thread::sleep(std::time::Duration::from_millis(50))
        }
        Err(_) => {}
    }
}

/// The command of an exec's process file, as one line (for messages).
pub fn command_line(file: &Path) -> String {
    let Ok(bytes) = std::fs::read(file) else { return String::new() };
    let Ok(process) = serde_json::from_slice::<Value>(&bytes) else { return String::new() };
    let args: Vec<&str> = process["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    // (the setsid and the shell planarian put in front are not the user's)
    let mut args = &args[..];
    if args.first().is_some_and(|a| SETSID.contains(a)) {
        args = &args[1..];
    }
    if args.len() >= 4 && SH.contains(&args[0]) && args[2] == BACKGROUND {
        args = &args[4..];
    }
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

    #[test]
    fn a_detached_command_is_started_in_the_background_by_a_shell() {
        let me = std::process::id() as i32;
        if !SETSID.iter().any(|s| Path::new(s).exists())
            || !SH.iter().any(|s| Path::new(s).exists())
            || !nix::unistd::geteuid().is_root()
        {
            eprintln!("SKIPPED: needs root, a setsid and a shell on this host");
            return;
        }
        let p = json!({"args": ["sleep", "600"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "user": {"uid": 0}});
        let args = in_background(&p, me, false).expect("wrapped");
        assert!(SH.contains(&args[0].as_str().unwrap()), "{args:?}");
        assert_eq!(&args[1..], &[json!("-c"), json!(BACKGROUND), json!("sh"), json!("sleep"), json!("600")]);
        let args = in_background(&p, me, true).expect("wrapped");
        assert!(args[0].as_str().unwrap().ends_with("/setsid") && SH.contains(&args[1].as_str().unwrap()), "{args:?}");
        assert_eq!(in_background(&json!({"args": ["no-such-command-here"], "cwd": "/"}), me, false), None);
        // The shell really starts it and ends, its stdio none of the caller's: the command
        // writes into a FIFO this test reads (the read waits for it).
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ran");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let out = std::process::Command::new(args[1].as_str().unwrap())
            .args(["-c", BACKGROUND, "sh", "sh", "-c", "echo out; echo err >&2; echo ran > \"$0\""])
            .arg(&fifo)
            .output()
            .unwrap();
        assert!(out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(), "{out:?}");
        assert_eq!(std::fs::read_to_string(&fifo).unwrap(), "ran\n");
        // The command line planarian shows is the user's.
        let pf = dir.path().join("process.json");
        std::fs::write(&pf, serde_json::to_vec(&json!({"args": args})).unwrap()).unwrap();
        assert_eq!(command_line(&pf), "sleep 600");
    }
}
