//! What a process and its threads are besides memory, signals and descriptors, against the
//! statepoint's images, and how it goes back:
//! * set back from outside: resource limits (`prlimit`), `oom_score_adj`, each thread's nice
//!   value (`setpriority` on its TID);
//! * set back by system calls run inside the process: its umask, its working directory (when it
//!   is no longer the statepoint's directory of that name, after the files went back), and
//!   whether it is a child subreaper;
//! * refused, since no call puts them back safely from here: other credentials (user and group
//!   IDs, supplementary groups, capability sets, `no_new_privs`: a process that dropped a
//!   privilege cannot be given it back), a seccomp mode, a personality or a scheduling policy or
//!   real-time priority that changed since the statepoint.
//!
//! User and group IDs are compared as the container's user namespace sees them, as CRIU records
//! them.

use super::signals::Held;
use super::{io, refuse, Error, Result, Thread};
use criu_hooks::images::{self, Core};
use nix::libc;
use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use sys::proc::{status_field, Proc};

/// What goes back on one process.
#[derive(Debug, Default)]
pub(super) struct Attrs {
    /// (resource, soft, hard) to set.
    rlimits: Vec<(u32, u64, u64)>,
    oom_score_adj: Option<i32>,
    /// (host TID, nice) to set.
    nice: Vec<(i32, i32)>,
    umask: Option<u32>,
    /// The statepoint's working directory, by its name inside the container.
    cwd: Option<String>,
    subreaper: Option<bool>,
}

/// Compares process `vpid` (host PID `host`) and its `threads` with the statepoint's.
pub(super) fn check(
    images: &std::path::Path,
    vpid: u32,
    host: i32,
    threads: &[(Thread, Core)],
    files: &HashMap<u32, images::File>,
) -> Result<Attrs> {
    let leader = threads
        .iter()
        .find(|(t, _)| t.vtid == vpid)
        .map(|(_, c)| c)
        .ok_or_else(|| Error::Failed(format!("process {vpid}: no leader among its threads")))?;
    let mut a = Attrs { subreaper: leader.child_subreaper, ..Attrs::default() };
    let me = Proc::of(host);
    let personality = me.read("personality").ok().and_then(|p| u32::from_str_radix(p.trim(), 16).ok());
    if personality.is_some_and(|p| p != leader.personality) {
        return refuse(format!("process {vpid}: its personality changed since the statepoint"));
    }
    for (res, &(cur, max)) in leader.rlimits.iter().enumerate() {
        let mut now = libc::rlimit64 { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: reads one limit of another process into `now`.
        if unsafe { libc::prlimit64(host, res as _, std::ptr::null(), &mut now) } != 0 {
            return Err(io(format!("read the limits of process {vpid}"))(std::io::Error::last_os_error()));
        }
        if (now.rlim_cur, now.rlim_max) != (cur, max) {
            a.rlimits.push((res as u32, cur, max));
        }
    }
    if let Some(adj) = leader.oom_score_adj {
        let now: Option<i32> = me.read("oom_score_adj").ok().and_then(|v| v.trim().parse().ok());
        if now != Some(adj) {
            a.oom_score_adj = Some(adj);
        }
    }
    let fs = images::fs(images, vpid)?;
    let status = me.status()?;
    if let Some(umask) = fs.umask {
        if status.field("Umask").and_then(|u| u32::from_str_radix(&u, 8).ok()) != Some(umask) {
            a.umask = Some(umask);
        }
    }
    match files.get(&fs.cwd_id) {
        Some(images::File::Regular { name, .. }) if name.starts_with('/') => a.cwd = Some(name.clone()),
        _ => return refuse(format!("process {vpid}: its working directory is not in the statepoint")),
    }
    let maps = IdMaps::of(host);
    for (t, core) in threads {
        if let Some(nice) = check_thread(host, vpid, t, core, &maps)? {
            a.nice.push((t.host, nice));
        }
    }
    Ok(a)
}

/// One thread's credentials, seccomp mode and scheduling policy against the statepoint's (a
/// change refuses); the nice value to put back, when it changed.
fn check_thread(host: i32, vpid: u32, t: &Thread, core: &Core, maps: &IdMaps) -> Result<Option<i32>> {
    let what = format!("thread {} of process {vpid}", t.vtid);
    let st = Proc::of(host).task(t.host).status()?;
    if let Some(then) = &core.creds {
        if let Some(why) = creds_differ(st.text(), then, maps) {
            return refuse(format!("{what}: its {why} changed since the statepoint"));
        }
    }
    let seccomp = st.field("Seccomp").and_then(|s| s.parse::<u32>().ok());
    if let (Some(now), Some(then)) = (seccomp, core.seccomp_mode) {
        if now != then {
            return refuse(format!("{what}: its seccomp mode is {now}, {then} at the statepoint"));
        }
    }
    let Some((nice, policy, prio)) = core.sched else { return Ok(None) };
    // (CRIU records the policy with SCHED_RESET_ON_FORK, /proc without it)
    let policy = policy & !(libc::SCHED_RESET_ON_FORK as u32);
    let (now_nice, now_prio, now_policy) = sched_of(host, t.host)?;
    if (now_policy, now_prio) != (policy, prio) {
        return refuse(format!("{what}: its scheduling policy or real-time priority changed since the statepoint"));
    }
    Ok((now_nice != nice).then_some(nice))
}

/// (nice, real-time priority, policy) of a thread, from `/proc/PID/task/TID/stat`.
fn sched_of(host: i32, tid: i32) -> Result<(i32, u32, u32)> {
    let task = Proc::of(host).task(tid);
    let stat = task.stat()?;
    let field = |n: usize| stat.field(n).and_then(|v| v.parse::<i64>().ok());
    match (field(19), field(40), field(41)) {
        (Some(nice), Some(prio), Some(policy)) => Ok((nice as i32, prio as u32, policy as u32)),
        _ => Err(Error::Failed(format!("{}: unreadable", task.path("stat").display()))),
    }
}

/// A process's user and group ID maps (`/proc/PID/uid_map`): the host's IDs as its user namespace
/// sees them.
struct IdMaps {
    uid: Vec<(u64, u64, u64)>,
    gid: Vec<(u64, u64, u64)>,
}

impl IdMaps {
    fn of(host: i32) -> IdMaps {
        let read = |f: &str| -> Vec<(u64, u64, u64)> {
            Proc::of(host)
                .read(f)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let v: Vec<u64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                    (v.len() == 3).then(|| (v[0], v[1], v[2]))
                })
                .collect()
        };
        IdMaps { uid: read("uid_map"), gid: read("gid_map") }
    }

    /// Host ID `id` inside the namespace (as CRIU records it); unmapped: the overflow ID.
    fn inside(map: &[(u64, u64, u64)], id: u64) -> u64 {
        map.iter().find(|(_, host, n)| id >= *host && id < host + n).map_or(65534, |(ns, host, _)| ns + (id - host))
    }
}

/// What of a thread's credentials (its `/proc` status `st`) differs from `then`, if anything.
fn creds_differ(st: &str, then: &images::Creds, maps: &IdMaps) -> Option<&'static str> {
    let ids = |key: &str, map: &[(u64, u64, u64)]| -> Vec<u32> {
        // (every value of the line: status_field keeps the last)
        st.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|v| v.parse::<u64>().ok())
            .map(|v| IdMaps::inside(map, v) as u32)
            .collect()
    };
    if ids("Uid", &maps.uid) != then.uids {
        return Some("user IDs");
    }
    if ids("Gid", &maps.gid) != then.gids {
        return Some("group IDs");
    }
    let mut groups = ids("Groups", &maps.gid);
    let mut then_groups = then.groups.clone();
    groups.sort_unstable();
    then_groups.sort_unstable();
    if groups != then_groups {
        return Some("supplementary groups");
    }
    let cap = |k: &str| status_field(st, k).and_then(|v| u64::from_str_radix(&v, 16).ok()).unwrap_or(0);
    let now = [cap("CapInh"), cap("CapPrm"), cap("CapEff"), cap("CapBnd"), cap("CapAmb")];
    if now != then.caps {
        return Some("capabilities");
    }
    let nnp = status_field(st, "NoNewPrivs").map(|v| v == "1");
    if then.no_new_privs.is_some() && nnp.is_some() && nnp != then.no_new_privs {
        return Some("no_new_privs");
    }
    None
}

const SCRATCH: u64 = 4096;

impl Attrs {
    /// Puts them back on the held process (inside: through `h`, its leader standing on a
    /// scratch page of ours for the directory's name).
    pub(super) fn apply(&self, h: &mut Held) -> Result<()> {
        let (vpid, host) = (h.vpid, h.host);
        for &(res, cur, max) in &self.rlimits {
            let l = libc::rlimit64 { rlim_cur: cur, rlim_max: max };
            // SAFETY: sets one limit of another process from `l`.
            if unsafe { libc::prlimit64(host, res as _, &l, std::ptr::null_mut()) } != 0 {
                return Err(io(format!("set limit {res} of process {vpid}"))(std::io::Error::last_os_error()));
            }
        }
        if let Some(adj) = self.oom_score_adj {
            Proc::of(host).write("oom_score_adj", &adj.to_string())?;
        }
        for &(tid, nice) in &self.nice {
            // SAFETY: sets the nice value of one thread.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
                return Err(io(format!("set the nice value of thread {tid}"))(std::io::Error::last_os_error()));
            }
        }
        let leader = h.leader()?;
        if let Some(umask) = self.umask {
            h.call(leader, "umask", libc::SYS_umask, &[u64::from(umask)])?;
        }
        if let Some(v) = self.subreaper {
            h.call(leader, "prctl", libc::SYS_prctl, &[libc::PR_SET_CHILD_SUBREAPER as u64, u64::from(v), 0, 0, 0])?;
        }
        if let Some(cwd) = self.cwd.as_deref().filter(|c| !same_dir(host, c)) {
            let mut name = cwd.as_bytes().to_vec();
            name.push(0);
            if name.len() as u64 > SCRATCH {
                return Err(Error::Failed(format!("process {vpid}: a working directory name of {} bytes", name.len())));
            }
            h.with_scratch(leader, SCRATCH, |h, mem, base| {
                mem.write_all_at(&name, base).map_err(io(format!("write process {vpid}'s memory")))?;
                h.call(leader, "chdir", libc::SYS_chdir, &[base])
            })?;
            if !same_dir(host, cwd) {
                return Err(Error::Failed(format!("process {vpid}: not in {cwd} after chdir")));
            }
        }
        Ok(())
    }
}

/// Whether process `host`'s working directory is the directory named `name` in its root now.
fn same_dir(host: i32, name: &str) -> bool {
    let me = Proc::of(host);
    let now = std::fs::metadata(me.path("cwd"));
    let then = std::fs::metadata(format!("{}{name}", me.root().display()));
    matches!((now, then), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()))
}

#[cfg(test)]
mod tests {
    use super::super::ptrace;
    use super::*;

    #[test]
    fn ids_are_seen_as_the_namespace_sees_them() {
        let st =
            "Uid:\t100000\t100000\t100000\t100000\nGid:\t100005\t100005\t100005\t100005\nGroups:\t100005 100027 \n\
                  CapInh:\t0000000000000000\nCapPrm:\t00000000a80425fb\nCapEff:\t00000000a80425fb\n\
                  CapBnd:\t00000000a80425fb\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\n";
        let maps = IdMaps { uid: vec![(0, 100000, 65536)], gid: vec![(0, 100000, 65536)] };
        let then = images::Creds {
            uids: [0; 4],
            gids: [5; 4],
            caps: [0, 0xa804_25fb, 0xa804_25fb, 0xa804_25fb, 0],
            groups: vec![27, 5],
            no_new_privs: Some(false),
        };
        assert_eq!(creds_differ(st, &then, &maps), None);
        let dropped = images::Creds { caps: [0, 0xa804_25fb, 0, 0xa804_25fb, 0], ..then.clone() };
        assert_eq!(creds_differ(st, &dropped, &maps), Some("capabilities"));
        let other = images::Creds { uids: [1000; 4], ..then };
        assert_eq!(creds_differ(st, &other, &maps), Some("user IDs"));
    }

    /// The real path, on a child of the test: its umask, working directory, a limit, its nice
    /// value and subreaper flag go back.
    #[test]
    fn a_child_gets_its_umask_directory_limits_and_nice_value_back() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("attrs");
        std::fs::create_dir_all(&dir).unwrap();
        let cdir = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
        // SAFETY: the child changes only its own attributes and waits; it is killed at the end.
        let child = unsafe { libc::fork() };
        if child == 0 {
            super::super::close_inherited();
            unsafe {
                libc::umask(0o077);
                libc::chdir(cdir.as_ptr());
                let l = libc::rlimit64 { rlim_cur: 64, rlim_max: 128 };
                libc::prlimit64(0, libc::RLIMIT_NOFILE, &l, std::ptr::null_mut());
                libc::setpriority(libc::PRIO_PROCESS, 0, 3);
                libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
                libc::raise(libc::SIGSTOP);
                loop {
                    libc::pause();
                }
            }
        }
        let _k = ptrace::tests::Kill(child);
        let stopped = || std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default().contains(") T ");
        let start = std::time::Instant::now();
        while !stopped() {
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "the child did not stop");
            std::thread::yield_now();
        }
        // SAFETY: the child goes on to pause.
        unsafe { libc::kill(child, libc::SIGCONT) };
        let t = match ptrace::Tracee::seize(child) {
            Ok(t) => t,
            // Some sandboxes forbid ptrace: nothing to test there.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return,
            Err(e) => panic!("{e}"),
        };
        let a = Attrs {
            // (within what this test may set without privileges: a hard limit lowered, a nice
            // value raised; planarian as root may raise and lower them)
            rlimits: vec![(libc::RLIMIT_NOFILE, 100, 120)],
            oom_score_adj: None,
            nice: vec![(child, 7)],
            umask: Some(0o022),
            cwd: Some("/".into()),
            subreaper: Some(false),
        };
        let maps_before = super::super::maps_for_comparison(child);
        let mut calls = 0;
        let insn = ptrace::syscall_instruction(child).unwrap();
        let mut h =
            Held { vpid: child as u32, host: child, insn, threads: vec![(&t, child as u32)], calls: &mut calls };
        a.apply(&mut h).unwrap();
        let st = std::fs::read_to_string(format!("/proc/{child}/status")).unwrap();
        assert_eq!(status_field(&st, "Umask").as_deref(), Some("0022"));
        assert!(same_dir(child, "/"), "back in /");
        let mut l = libc::rlimit64 { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: reads one limit.
        unsafe { libc::prlimit64(child, libc::RLIMIT_NOFILE, std::ptr::null(), &mut l) };
        assert_eq!((l.rlim_cur, l.rlim_max), (100, 120));
        assert_eq!(sched_of(child, child).unwrap().0, 7);
        assert_eq!(super::super::maps_for_comparison(child), maps_before, "no scratch page left");
        drop(t);
    }
}
