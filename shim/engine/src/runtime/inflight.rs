//! Tool calls in flight: a statepoint waits for them.
//!
//! A tool call takes the container's lock shared (the MCP sidecar for each call that changes
//! something; the runtime for `exec`), and a snapshot or rollback takes it exclusive. conmon runs
//! `exec --detach`: crun starts the command and returns at once, so the lock would be let go
//! while the command still runs, and a snapshot could freeze it midway. So after a detached
//! `exec`, planarian leaves a small holder process with the lock (the same open file) and a
//! pidfd of the command: it lets go when the command exits, or at the latest
//! `[checkpoint] in_flight_wait_seconds` after it started — a command that runs longer (a server
//! started with `podman exec -d`) is part of the sandbox's state, captured running, and must not
//! keep statepoints away for good. The holder names the command in the store's `in-flight/PID`
//! file, for the message of a statepoint that waits for it.
//!
//! A command started with `podman exec -d` is no tool call: nobody waits for its output, it is
//! the sandbox's own work (a server, a watcher), captured running by any statepoint. conmon's
//! arguments are the same for both (`--exec-attach`); what differs is the session's attach
//! socket: Podman connects to it before it tells conmon to start the command, so by the time the
//! runtime runs a client of `podman exec` is connected (accepted, or waiting to be), while no one
//! is for `-d` ([`client_attached`]). Such a command gets no holder.
//!
//! A statepoint waits for the lock at most that long (and a little more: the holders' own
//! bounds), saying what it waits for; then (an MCP call that does not end) it fails, changing
//! nothing.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

const DIR: &str = "in-flight";

fn dir(store_dir: &Path) -> PathBuf {
    store_dir.join(DIR)
}

/// Holds `lock` (a container's lock, held shared) until process `pid` exits, at most `max`, in
/// a detached holder process; this process goes on at once. Nothing when the process is gone
/// already.
pub fn hold_until_exit(lock: File, pid: i32, store_dir: &Path, what: &str, max: Duration) -> Result<(), String> {
    use nix::libc;
    // (it exited already: nothing to wait for)
    let Ok(pidfd) = crate::pidfd::open(pid) else { return Ok(()) };
    let note = dir(store_dir).join(pid.to_string());
    std::fs::create_dir_all(dir(store_dir)).map_err(|e| format!("cannot create {}: {e}", dir(store_dir).display()))?;
    std::fs::write(&note, what).map_err(|e| format!("cannot write {}: {e}", note.display()))?;
    let keep = [lock.as_raw_fd(), pidfd.as_raw_fd()];
    // (every other descriptor is closed in the child, whenever it was opened: one another
    // thread opens between a listing and the fork, a lock of another container, must not stay
    // held by the holder)
    let mut kept = keep;
    kept.sort_unstable();
    let note_c = std::ffi::CString::new(note.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    let devnull = c"/dev/null";
    // SAFETY: the child only makes system calls on values made before the fork, and leaves by
    // _exit.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => unsafe {
            libc::setsid();
            let mut from = 3u32;
            for fd in kept.iter().map(|&fd| fd as u32).filter(|&fd| fd >= 3) {
                if fd > from {
                    libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32);
                }
                from = fd + 1;
            }
            libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32);
            // Nothing of the caller's: conmon reads the runtime's output until it is closed.
            let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            let mut p = libc::pollfd { fd: keep[1], events: libc::POLLIN, revents: 0 };
            let ms = max.as_millis().min(i32::MAX as u128) as i32;
            // (an interrupted wait simply ends early: the bound is an upper one)
            libc::poll(&mut p, 1, ms);
            libc::unlink(note_c.as_ptr());
            libc::_exit(0)
        },
        Ok(nix::unistd::ForkResult::Parent { .. }) => {
            drop(lock);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&note);
            Err(format!("cannot fork the holder of the container's lock: {e}"))
        }
    }
}

/// Whether a client is attached to the exec session that conmon `conmon` (the runtime's parent)
/// runs: a connection to its attach socket (a listening socket bound to `…/attach`) that it
/// accepted, or one waiting in that socket's queue (the listener, read through a copy of
/// conmon's descriptor, is readable). `None` when `conmon` is not conmon running an exec session
/// to attach to (`--exec-attach`, as Podman starts it) with its attach socket (another caller's
/// exec, a CRI engine's: a tool call, held as ever).
pub fn client_attached(conmon: i32) -> Option<bool> {
    let p = sys::proc::Proc::of(conmon);
    // (Podman's exec sessions: conmon told to wait for a client to attach, or for none)
    if p.read("comm").ok()?.trim() != "conmon" || !p.cmdline().ok()?.iter().any(|a| a == "--exec-attach") {
        return None;
    }
    // conmon's sockets bound to `…/attach` (an accepted connection shows its listener's path)
    let attach = || -> Option<Vec<(i32, sys::proc::UnixSocket)>> {
        let fds = p.socket_fds().ok()?;
        let fd_of = |inode: u64| fds.iter().find(|(i, _)| *i == inode).map(|&(_, fd)| fd);
        Some(
            p.unix_sockets()
                .ok()?
                .into_iter()
                .filter(|u| u.path.as_deref().is_some_and(|p| p.ends_with("/attach")))
                .filter_map(|u| Some((fd_of(u.inode)?, u)))
                .collect(),
        )
    };
    let accepted = |a: &[(i32, sys::proc::UnixSocket)]| a.iter().any(|(_, u)| u.connected && !u.listening);
    let first = attach()?;
    if accepted(&first) {
        return Some(true);
    }
    let &(fd, _) = first.iter().find(|(_, u)| u.listening)?;
    let listener = crate::local::inplace::ptrace::dup_fd(conmon, fd as u32).ok()?;
    let mut pfd = nix::libc::pollfd { fd: listener.as_raw_fd(), events: nix::libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, pointing at `pfd`; no wait.
    let n = unsafe { nix::libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        return None;
    }
    if n > 0 && pfd.revents & nix::libc::POLLIN != 0 {
        return Some(true);
    }
    // (accepted between the first look and the poll: there now)
    Some(accepted(&attach()?))
}

/// The commands in flight in a container (their holders' notes), as `pid N: COMMAND`.
pub fn list(store_dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir(store_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            // (a note left by a holder that was killed names no live process)
            sys::proc::Proc::of(pid)
                .dir()
                .exists()
                .then(|| format!("pid {pid}: {}", std::fs::read_to_string(e.path()).unwrap_or_default().trim()))
        })
        .collect();
    out.sort();
    out
}

/// Takes `file`'s lock exclusive, waiting at most `wait`; `waiting` is told what it waits for
/// first. `Err` with what was still in flight when the wait ran out.
pub fn lock_within(
    file: File,
    store_dir: &Path,
    wait: Duration,
    waiting: &mut dyn FnMut(&str),
) -> Result<File, String> {
    if file.try_lock().is_ok() {
        return Ok(file);
    }
    let what = |list: Vec<String>| if list.is_empty() { "a tool call".to_string() } else { list.join("; ") };
    waiting(&what(list(store_dir)));
    let (tx, rx) = std::sync::mpsc::channel();
    let mine = file.try_clone().map_err(|e| e.to_string())?;
    // (the lock is the open file's: taken through a clone, it is `file`'s; if the wait ran out
    // meanwhile, the clone is dropped with the last reference and the lock let go)
    std::thread::spawn(move || {
        if mine.lock().is_ok() {
            let _ = tx.send(mine);
        }
    });
    match rx.recv_timeout(wait) {
        Ok(_clone) => Ok(file),
        Err(_) => Err(what(list(store_dir))),
    }
}
