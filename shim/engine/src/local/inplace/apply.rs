//! A plan applied: every thread held with ptrace, the memory layout and pages put back, signals,
//! attributes and descriptors, then soft-dirty bits cleared and registers set last.

use super::pages::{strays, write_pages, Pages, Plan};
use super::shape::{coverage, Process, Segments};
use super::{cgroup_pids, descriptors, io, ptrace, signals, Error, Result, Thread};
use crate::pidfd;
use criu_hooks::images::{self, PAGE_SIZE};
use nix::libc;
use sys::proc::Proc;

/// What a rollback in place did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    pub pages_written: u64,
    pub pages_dropped: u64,
    pub system_calls: u64,
    /// The processes it ended, as the statepoint does not have them (`process 12 (sleep)`).
    pub ended: Vec<String>,
}

impl Plan {
    /// The host PIDs the plan was made for.
    pub fn pids(&self) -> &[i32] {
        &self.shape.pids
    }

    /// Applies the plan to the tree of cgroup `freezer`, frozen on entry and on return (on
    /// success and on failure). From the first write on, a failure leaves the tree between the
    /// two states: the caller restores the statepoint (stopped, by a restore).
    pub fn apply(&self, freezer: &crate::local::freezer::Freezer) -> Result<Applied> {
        let mut tracees = Vec::new();
        for p in &self.shape.procs {
            for (t, _) in &p.threads {
                tracees.push(
                    ptrace::Tracee::seize(t.host)
                        .map_err(io(format!("hold thread {} of process {}", t.vtid, p.vpid)))?,
                );
            }
        }
        // What the statepoint does not have is killed while frozen: it runs no more, and ends at
        // once (cgroup v2) or once thawed (a cgroup v1 freezer holds even a killed task).
        let ending = end_later(&self.shape.later)?;
        // Held by ptrace, the threads do not run when the cgroup thaws; they must be thawed to
        // step over a system call (CRIU does the same between its seize and its dump).
        freezer.thaw().map_err(|e| Error::Failed(format!("thaw for the system calls: {e}")))?;
        crate::log::mark("held");
        let r = ended(&ending).and_then(|()| self.apply_held(&tracees)).map(|mut a| {
            a.ended = ending.into_iter().map(|(_, what)| what).collect();
            a
        });
        let refrozen = freezer.freeze();
        let now = cgroup_pids(freezer.dir());
        drop(tracees);
        let applied = r?;
        refrozen.map_err(|e| Error::Failed(format!("freeze again: {e}")))?;
        if now != self.shape.pids {
            return Err(Error::Failed(format!(
                "the container's processes changed during the rollback ({:?} → {now:?})",
                self.shape.pids
            )));
        }
        Ok(applied)
    }

    /// The plan, done to the held threads: each process's memory, signals, attributes and
    /// descriptors, then what comes last for all ([`Plan::finish`]).
    fn apply_held(&self, tracees: &[ptrace::Tracee]) -> Result<Applied> {
        let mut applied = Applied { pages_written: self.pages_ahead, ..Applied::default() };
        let mut ti = 0;
        signals::block_all(tracees)?;
        // Each process's main thread and vDSO `syscall`, and whether it had THP turned off.
        let mut held = Vec::new();
        for (p, pages) in self.shape.procs.iter().zip(&self.pages) {
            let main = &tracees[ti];
            crate::fault::point("rollback.in-place.memory").map_err(|e| Error::Failed(e.to_string()))?;
            let insn = ptrace::syscall_instruction(p.host).map_err(io(format!("process {}", p.vpid)))?;
            self.reap_later(p, main, insn, &mut applied)?;
            let thp_off = put_back_memory(p, pages, main, insn, &mut applied)?;
            crate::log::mark("memory checked");
            held.push((ti, insn, thp_off));
            let threads = p.threads.iter().enumerate().map(|(i, (th, _))| (&tracees[ti + i], th.vtid)).collect();
            let mut h = signals::Held { vpid: p.vpid, host: p.host, insn, threads, calls: &mut applied.system_calls };
            p.signals.apply(&mut h)?;
            p.attrs.apply(&mut h)?;
            crate::log::mark("signals and attributes");
            ti += p.threads.len();
            descriptors::apply(p.host, p.vpid, &p.fixes)?;
        }
        crate::fault::point("rollback.in-place.registers").map_err(|e| Error::Failed(e.to_string()))?;
        self.finish(tracees, &held, &mut applied)?;
        Ok(applied)
    }

    /// The children of process `p` that are not the statepoint's — processes it ended, or that
    /// ended before the rollback and were never waited for — taken by `p` itself
    /// (`wait4`, run by its main thread `main`), as the statepoint had none of them. One still
    /// running fails.
    fn reap_later(&self, p: &Process, main: &ptrace::Tracee, insn: u64, applied: &mut Applied) -> Result<()> {
        let ours = &self.shape.pids;
        let proc = Proc::of(p.host);
        let mut children = Vec::new();
        for tid in proc.threads()? {
            let text = proc.task(tid).read("children")?;
            children.extend(text.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
        }
        // (a child's PID in the parent's namespace: at the parent's own level, not a nested one)
        let level = proc.status()?.ns_pids().len();
        for child in children.into_iter().filter(|c| !ours.contains(c)) {
            let st = Proc::of(child).status()?;
            let vpid = level
                .checked_sub(1)
                .and_then(|l| st.ns_pids().get(l).copied())
                .filter(|&v| v > 0)
                .map(u64::from)
                .ok_or_else(|| {
                    Error::Failed(format!("process {}: its child {child} has no PID in the container", p.vpid))
                })?;
            if st.state() != 'Z' {
                return Err(Error::Failed(format!(
                    "process {vpid}, a child of process {} the statepoint does not have, still runs",
                    p.vpid
                )));
            }
            applied.system_calls += 1;
            let got = ptrace::call(
                main,
                insn,
                "wait4",
                libc::SYS_wait4,
                &[vpid, 0, (libc::WNOHANG | libc::__WALL) as u64, 0],
            )
            .map_err(io(format!("process {}", p.vpid)))?;
            if got != vpid as i64 {
                return Err(Error::Failed(format!("process {}: wait4 for its child {vpid} gave {got}", p.vpid)));
            }
        }
        Ok(())
    }

    /// Last, for every process: soft-dirty bits cleared, transparent huge pages back on where
    /// they were, then registers and masks (`held`: each process's main thread, its `syscall`
    /// instruction, and whether THP was off before).
    fn finish(&self, tracees: &[ptrace::Tracee], held: &[(usize, u64, bool)], applied: &mut Applied) -> Result<()> {
        for p in &self.shape.procs {
            // The next dump is incremental on the statepoint's images: what runs from here on
            // is what it dumps.
            Proc::of(p.host).clear_soft_dirty()?;
        }
        crate::log::mark("soft-dirty cleared");
        for (p, &(t, insn, thp_off)) in self.shape.procs.iter().zip(held) {
            if !thp_off {
                applied.system_calls += 1;
                ptrace::call(
                    &tracees[t],
                    insn,
                    "prctl",
                    libc::SYS_prctl,
                    &[libc::PR_SET_THP_DISABLE as u64, 0, 0, 0, 0],
                )
                .map_err(io(format!("process {}", p.vpid)))?;
            }
        }
        // Registers and masks last: no system call runs in a thread after them (each step
        // raises a SIGTRAP, which a statepoint's mask may block).
        let threads = self.shape.procs.iter().flat_map(|p| p.threads.iter().map(move |(th, core)| (p.vpid, th, core)));
        for (t, (vpid, th, core)) in tracees.iter().zip(threads) {
            set_thread(t, th, core).map_err(io(format!("thread {} of process {vpid}", th.vtid)))?;
        }
        Ok(())
    }
}

/// One process's private memory put back, through system calls its main thread `main` runs
/// (at `insn`): the layout (`brk`, `munmap`, `mmap`, `mprotect`), the pages the statepoint has
/// not dropped, its pages written, strays dropped, then checked. Transparent huge pages are off
/// from here until [`Plan::finish`]; returns whether they were off before.
fn put_back_memory(
    p: &Process,
    pages: &Pages,
    main: &ptrace::Tracee,
    insn: u64,
    applied: &mut Applied,
) -> Result<bool> {
    let mut sys = |name: &str, nr: libc::c_long, args: &[u64]| -> Result<i64> {
        applied.system_calls += 1;
        ptrace::call(main, insn, name, nr, args).map_err(io(format!("process {}", p.vpid)))
    };
    // No transparent huge page while the memory is put back: a page written where the
    // process has none would fault in a whole 2 MiB one, and khugepaged (which ignores
    // the freezer) collapsing a range fills its holes with pages the statepoint does not
    // have. Turned back on once the soft-dirty bits are cleared: a collapse after that
    // marks what it fills as dirty, so the next dump carries it.
    let thp_off = sys("prctl", libc::SYS_prctl, &[libc::PR_GET_THP_DISABLE as u64, 0, 0, 0, 0])? != 0;
    if !thp_off {
        sys("prctl", libc::SYS_prctl, &[libc::PR_SET_THP_DISABLE as u64, 1, 0, 0, 0])?;
    }
    let l = &p.layout;
    if let Some(brk) = l.brk {
        let got = sys("brk", libc::SYS_brk, &[brk])?;
        if got as u64 != brk {
            return Err(Error::Failed(format!("process {}: brk({brk:#x}) gave {got:#x}", p.vpid)));
        }
    }
    for &(s, e) in &l.unmap {
        sys("munmap", libc::SYS_munmap, &[s, e - s])?;
    }
    for &(s, e, prot, flags) in &l.map {
        let keep = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_GROWSDOWN) as u32;
        let fl = (flags & keep) | (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u32;
        let got = sys("mmap", libc::SYS_mmap, &[s, e - s, u64::from(prot), u64::from(fl), u64::MAX, 0])?;
        if got as u64 != s {
            return Err(Error::Failed(format!("process {}: mmap at {s:#x} gave {got:#x}", p.vpid)));
        }
    }
    for &(s, e, prot) in &l.protect {
        sys("mprotect", libc::SYS_mprotect, &[s, e - s, u64::from(prot)])?;
    }
    let mut dropped = 0;
    for &(s, e) in &pages.drop {
        sys("madvise", libc::SYS_madvise, &[s, e - s, libc::MADV_DONTNEED as u64])?;
        dropped += (e - s) / PAGE_SIZE;
    }
    crate::log::mark("layout");
    let written = write_pages(p.host, &pages.write)?.pages;
    crate::log::mark("pages written");
    // Pages present now that neither the statepoint nor the dump of the current state
    // had (a range khugepaged collapsed after that dump, filling its holes): left, they
    // read the same (zeros), but the process holds memory the statepoint did not.
    for (s, e) in strays(p.host, &pages.had)? {
        sys("madvise", libc::SYS_madvise, &[s, e - s, libc::MADV_DONTNEED as u64])?;
        dropped += (e - s) / PAGE_SIZE;
    }
    applied.pages_written += written;
    applied.pages_dropped += dropped;
    check_layout(p)?;
    Ok(thp_off)
}

/// After the layout was changed: the process's private anonymous memory is the statepoint's.
fn check_layout(p: &Process) -> Result<()> {
    let now: Segments =
        Proc::of(p.host).maps()?.iter().filter(|m| m.is_anon_private()).map(|m| (m.start, m.end, m.prot, 0)).collect();
    let (a, b) = (coverage(&now), coverage(&p.target_anon));
    if a != b {
        let diff: Vec<_> = a
            .iter()
            .filter(|x| !b.contains(x))
            .chain(b.iter().filter(|x| !a.contains(x)))
            .take(4)
            .map(|x| format!("{:#x}-{:#x}", x.0, x.1))
            .collect();
        return Err(Error::Failed(format!(
            "process {}: private memory differs from the statepoint's after the rollback at {}",
            p.vpid,
            diff.join(", ")
        )));
    }
    Ok(())
}

/// Registers (CRIU's, with their system-call restart already worked out: `orig_ax = -1`),
/// FPU and SSE/AVX state, blocked signals and name of one thread.
fn set_thread(t: &ptrace::Tracee, th: &Thread, core: &images::Core) -> std::io::Result<()> {
    let g = &core.gpregs;
    // SAFETY: all-zero is a valid user_regs_struct; every field is set below.
    let mut r: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    let fields: [&mut u64; 27] = [
        &mut r.r15,
        &mut r.r14,
        &mut r.r13,
        &mut r.r12,
        &mut r.rbp,
        &mut r.rbx,
        &mut r.r11,
        &mut r.r10,
        &mut r.r9,
        &mut r.r8,
        &mut r.rax,
        &mut r.rcx,
        &mut r.rdx,
        &mut r.rsi,
        &mut r.rdi,
        &mut r.orig_rax,
        &mut r.rip,
        &mut r.cs,
        &mut r.eflags,
        &mut r.rsp,
        &mut r.ss,
        &mut r.fs_base,
        &mut r.gs_base,
        &mut r.ds,
        &mut r.es,
        &mut r.fs,
        &mut r.gs,
    ];
    for (slot, v) in fields.into_iter().zip(g) {
        *slot = *v;
    }
    r.orig_rax = u64::MAX;
    t.set_regs(&r)?;
    if core.fpregs.fxsave.len() == 512 {
        let mut x = t.xstate()?;
        // FXSAVE: x87, MXCSR, st0-7, xmm0-15 (bytes 416.. are reserved or the kernel's own).
        x[..416].copy_from_slice(&core.fpregs.fxsave[..416]);
        if let Some(bv) = core.fpregs.xstate_bv {
            if x.len() >= 576 + 256 && core.fpregs.ymmh.len() == 256 {
                x[576..832].copy_from_slice(&core.fpregs.ymmh);
            }
            if x.len() >= 520 {
                let live = u64::from_le_bytes(x[512..520].try_into().unwrap());
                let bv = (live & !0x7) | (bv & 0x7);
                x[512..520].copy_from_slice(&bv.to_le_bytes());
            }
        }
        t.set_xstate(&x)?;
    }
    t.set_sigmask(core.blocked)?;
    let me = Proc::of(th.host);
    if !core.comm.is_empty() && me.read("comm").map(|c| c.trim_end().to_string()).unwrap_or_default() != core.comm {
        me.write("comm", &core.comm).map_err(|e| std::io::Error::new(e.kind(), e.to_string()))?;
    }
    Ok(())
}

/// The processes the statepoint does not have, each killed (`pidfd_send_signal`, SIGKILL): their
/// pidfds, to wait for their end, and their names (`process 12 (sleep)`). One already gone, or
/// whose PID another process has since, is neither.
fn end_later(later: &[super::shape::Later]) -> Result<Vec<(std::os::fd::OwnedFd, String)>> {
    let mut out = Vec::new();
    for l in later {
        let what = format!("process {} ({})", l.vpid, l.comm);
        let fd = match pidfd::open(l.host) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
            Err(e) => {
                return Err(Error::Failed(format!("pidfd_open of {what}, which the statepoint does not have: {e}")))
            }
        };
        if Proc::of(l.host).state_and_start().map(|s| s.1) != Some(l.start) {
            continue;
        }
        if let Err(e) = pidfd::kill(&fd) {
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(Error::Failed(format!("killing {what}, which the statepoint does not have: {e}")));
            }
        }
        out.push((fd, what));
    }
    Ok(out)
}

/// How long a killed process may take to end (a task in an uninterruptible wait, a slow disk).
const ENDING: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits until each process of [`end_later`] has ended.
fn ended(ending: &[(std::os::fd::OwnedFd, String)]) -> Result<()> {
    let deadline = std::time::Instant::now() + ENDING;
    for (fd, what) in ending {
        match pidfd::wait(fd, Some(deadline.saturating_duration_since(std::time::Instant::now()))) {
            Ok(true) => {}
            Ok(false) => {
                return Err(Error::Failed(format!(
                    "{what}, which the statepoint does not have, did not end within {} s",
                    ENDING.as_secs()
                )))
            }
            Err(e) => return Err(Error::Failed(format!("waiting for {what} to end: {e}"))),
        }
    }
    if !ending.is_empty() {
        crate::log::mark("later processes ended");
    }
    Ok(())
}
