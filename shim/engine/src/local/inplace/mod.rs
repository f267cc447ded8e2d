//! Rollback in place: the container's processes return to a statepoint without being stopped.
//! Podman, conmon, the network namespace and the cgroup never notice.
//!
//! It applies when the frozen process tree has the *shape* it had at the statepoint
//! ([`check`], the rules, every one a refusal that sends the rollback down the stop-and-restore
//! path):
//! * the statepoint's processes and threads, each still there (PIDs and TIDs in the container's
//!   PID namespace), with the same parents, process groups and sessions, none a zombie, stopped
//!   or traced; processes started since are ended ([`Plan::apply`]: killed while frozen, once
//!   the rollback goes forward; a child of the statepoint's processes that is not the
//!   statepoint's, ended, taken by its parent with `wait4`);
//! * 64-bit tasks, none being killed; signals and timers as [`signals`] allows (queued signals,
//!   dispositions, interval and POSIX timers, alternate stacks are put back);
//! * the same file-backed mappings (addresses, protection, offset, file name), the same stack
//!   and vDSO; no shared anonymous memory or System V shm, now or then. Private anonymous
//!   memory may differ: the heap is put back with `brk`, other mappings with `munmap`, `mmap`
//!   and `mprotect`, run inside the process;
//! * the same descriptors, as [`descriptors`] allows: regular files (the offset is set back),
//!   pipes, sockets, eventfd, timerfd, signalfd, epoll; terminals and other kinds refuse;
//! * the same credentials, seccomp mode, personality and scheduling policy; resource limits,
//!   `oom_score_adj`, nice values, umask, working directory and child-subreaper flag are put
//!   back ([`attrs`]).
//!
//! Not compared (not in CRIU's images, or not visible from outside): `set_tid_address`, robust
//! futex lists, rseq, the parent-death signal, a root directory changed by `chroot`, and the
//! `prctl` memory-layout fields; they belong to the same threads and rarely change.
//!
//! The steps, one module each: [`shape`] (the check above: the live tree, its memory layout,
//! descriptors, signals and attributes against the images), [`pages`] (what to write and drop),
//! [`apply`] (done to the held threads); [`ahead`] (pages written while the files are still
//! compared, put back when the rollback does not go on).
//!
//! [`Shape::plan`] then compares the statepoint's pages with the current ones, read without a
//! dump (each process's page map against the base the next dump would build on, see [`pages`]):
//! a page is written when its content comes from another image location than the statepoint's,
//! dropped (`MADV_DONTNEED`) when it was not there at the statepoint. [`Plan::apply`] holds every thread with ptrace, writes the pages
//! (`process_vm_writev` from the images' mappings; `/proc/PID/mem` where that cannot; transparent
//! huge pages off meanwhile), drops any page the process
//! has that the statepoint has not (`/proc/PID/pagemap`: khugepaged may have filled holes since
//! the dump), puts signals and timers back ([`signals`]), sets registers (`orig_ax = -1`: no
//! system-call restart on top of CRIU's own fix-ups), FPU state, signal masks, names and file
//! offsets, clears the soft-dirty bits (the
//! next dump is incremental on the statepoint's images), and checks that the mappings now are
//! the statepoint's.

pub mod ahead;
mod apply;
mod attrs;
mod descriptors;
mod pages;
pub mod ptrace;
mod shape;
mod signals;

pub use apply::Applied;
pub use pages::Plan;
pub use shape::check;

use criu_hooks::images;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tree is not in a shape a rollback in place can restore (before anything changed).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Image(#[from] images::ReadError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error(transparent)]
    Proc(#[from] sys::IoError),
    #[error("{0}")]
    Failed(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn refuse<T>(why: impl Into<String>) -> Result<T> {
    Err(Error::Refused(why.into()))
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// A live thread: its PID on the host and in the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Thread {
    host: i32,
    vtid: u32,
}

/// For the tests that fork a child which does not exec: the child closes every descriptor it
/// inherited beyond 0–2 at once. Otherwise it would keep the flocks other tests, running beside
/// it in this process, take and release (a store's lock, a fork's record), until it is killed.
#[cfg(test)]
fn close_inherited() {
    // SAFETY: closes descriptors of this (forked, single-threaded) child only.
    unsafe { nix::libc::syscall(nix::libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
}

/// A process's memory map as a test compares it: a file another test removed meanwhile (the
/// child inherited its mapping at the fork) is the same mapping.
#[cfg(test)]
fn maps_for_comparison(pid: i32) -> String {
    sys::proc::Proc::of(pid).read("maps").unwrap().replace(" (deleted)", "")
}

/// Those of `pids` (a container's, host PIDs) outside the tree of its init `init`: no chain of
/// parents among `pids` leads from them to `init` (an exec's command, a child of conmon, and
/// what it started). As `process N (COMMAND)`, N the PID in the container.
pub fn outside_tree(pids: &[i32], init: i32) -> Vec<String> {
    let status: std::collections::HashMap<i32, sys::proc::Status> =
        pids.iter().filter_map(|&p| Some((p, sys::proc::Proc::of(p).status().ok()?))).collect();
    let parent = |p: i32| status.get(&p).and_then(|s| s.number("PPid")).map(|pp| pp as i32);
    let held = |mut p: i32| {
        for _ in 0..=pids.len() {
            if p == init {
                return true;
            }
            match parent(p) {
                Some(pp) if status.contains_key(&pp) => p = pp,
                _ => return false,
            }
        }
        false
    };
    pids.iter()
        .filter(|&&p| status.contains_key(&p) && !held(p))
        .map(|&p| {
            let vpid = status[&p].number("NSpid").unwrap_or(p as u64);
            let cmd = sys::proc::Proc::of(p).cmdline().map(|a| a.join(" ")).unwrap_or_default();
            format!("process {vpid} ({})", cmd.chars().take(120).collect::<String>())
        })
        .collect()
}

/// The processes of a cgroup and its children (host PIDs).
pub fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .or_else(|_| std::fs::read_to_string(dir.join("tasks")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(cgroup_pids(&e.path()));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    /// This test process stands for a container's init: its child is in the tree; a grandchild
    /// listed without its parent (a child of conmon, outside) is not, and neither would be
    /// anything it started.
    #[test]
    fn processes_outside_the_tree_of_init() {
        use std::io::BufRead;
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 31 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(sh.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        let (a, s) = (child.id() as i32, sh.id() as i32);
        let outside = super::outside_tree(&[me, a, grandchild], me);
        let all = super::outside_tree(&[me, a, s, grandchild], me);
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(grandchild), nix::sys::signal::SIGKILL);
        for c in [&mut child, &mut sh] {
            let _ = c.kill();
            let _ = c.wait();
        }
        // (its command line may still be the shell's, or empty, while it execs `sleep`)
        assert!(outside.len() == 1 && outside[0].starts_with(&format!("process {grandchild} (")), "{outside:?}");
        assert!(all.is_empty(), "{all:?}");
    }
}
