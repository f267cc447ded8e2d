//! Signals and timers, put back in place: each process's signal dispositions, queued signals
//! (the process's and each thread's, real-time ones with their `siginfo` in queue order),
//! interval timers and POSIX timers with the time they had left, and each thread's alternate
//! signal stack — what CRIU's restorer sets, set here by system calls run inside the process.
//!
//! The order matters ([`Signals::apply`]), with every thread blocking every signal meanwhile
//! (the caller's [`block_all`]; the statepoint's masks are set last, with the registers):
//! 1. the process's timers are disarmed, so that none fires into the queues being emptied;
//! 2. each thread's queue and the process's are emptied (`rt_sigtimedwait` with no wait, in
//!    each thread) and checked empty in `/proc`;
//! 3. the dispositions are set (`rt_sigaction`, the 62 CRIU records);
//! 4. the statepoint's signals are queued again: the process's by the thread group leader
//!    (`rt_sigqueueinfo`), each thread's by itself (`rt_tgsigqueueinfo`) — sent to itself, a
//!    signal's `siginfo` is taken as it is;
//! 5. alternate stacks (`sigaltstack`, run on a stack of ours: the kernel refuses to change the
//!    stack of a thread that runs on it);
//! 6. the timers are armed with the time they had left (as CRIU does: a timer with nothing left
//!    but an interval fires after one interval).
//!
//! Refused, before anything changed: a stop, continue or kill signal queued at the statepoint
//! (it changes the process's state, not only its queue) or a SIGTRAP (each step raises one), an
//! ignored SIGTRAP, a process whose POSIX timers are not the statepoint's (created or deleted
//! since: a timer's ID cannot be chosen), 32-bit dispositions. Not put back: a POSIX timer's
//! overrun count (of its last delivered expiration; CRIU does not either).

use super::{io, ptrace, refuse, Error, Result, Thread};
use criu_hooks::images::{Core, ITimer, PosixTimer, SigAction};
use nix::libc;
use std::os::unix::fs::FileExt;
use sys::proc::Proc;

/// What one process's signals and timers are put back to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Signals {
    sigactions: Vec<SigAction>,
    shared: Vec<Vec<u8>>,
    itimers: [ITimer; 3],
    posix: Vec<PosixTimer>,
    /// Per thread, in the process's order: its queued signals and alternate stack.
    threads: Vec<(Vec<Vec<u8>>, Option<AltStack>)>,
}

/// `ss_sp`, `ss_size`, `ss_flags`.
type AltStack = (u64, u64, u32);

const SIGINFO_SIZE: usize = 128;
/// Signals whose arrival changes a process's state (stop, continue, death), not only its queue;
/// and SIGTRAP, which each step over a system call raises (a queued one would be taken for it).
pub(super) const STATE_SIGNALS: [i32; 7] =
    [libc::SIGKILL, libc::SIGSTOP, libc::SIGCONT, libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU, libc::SIGTRAP];
const SS_ONSTACK: u32 = 1;
const SS_DISABLE: u32 = 2;
const SIGEV_THREAD_ID: u32 = 4;

fn signo(info: &[u8]) -> i32 {
    i32::from_le_bytes(info[..4].try_into().unwrap())
}

/// One live POSIX timer, as `/proc/PID/timers` shows it: ID, signal, `sigev_value`, notify
/// (its `sigev_notify` and the host TID it names), clock.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LiveTimer {
    id: u32,
    signo: u32,
    sival: u64,
    notify: u32,
    target: i32,
    clock: u32,
}

fn parse_timers(text: &str) -> Vec<LiveTimer> {
    let mut out = Vec::new();
    let mut lines = text.lines().map(str::trim).peekable();
    while let Some(first) = lines.next() {
        let Some(id) = first.strip_prefix("ID:").and_then(|v| v.trim().parse().ok()) else { continue };
        let mut t = LiveTimer { id, signo: 0, sival: 0, notify: 0, target: 0, clock: u32::MAX };
        while let Some(l) = lines.next_if(|l| !l.starts_with("ID:")) {
            let Some((k, v)) = l.split_once(':') else { continue };
            let v = v.trim();
            match k {
                "signal" => {
                    let (sig, val) = v.split_once('/').unwrap_or((v, "0"));
                    t.signo = sig.parse().unwrap_or(0);
                    t.sival = u64::from_str_radix(val, 16).unwrap_or(0);
                }
                "notify" => {
                    let (how, target) = v.split_once('/').unwrap_or((v, ""));
                    let kind = match how {
                        "signal" => libc::SIGEV_SIGNAL as u32,
                        "none" => libc::SIGEV_NONE as u32,
                        _ => libc::SIGEV_THREAD as u32,
                    };
                    t.notify = kind | if target.starts_with("tid.") { SIGEV_THREAD_ID } else { 0 };
                    t.target = target.split_once('.').and_then(|(_, n)| n.parse().ok()).unwrap_or(0);
                }
                // (a CPU clock's ID is negative; CRIU records it as unsigned)
                "ClockID" => t.clock = v.parse::<i32>().map_or(u32::MAX, |c| c as u32),
                _ => {}
            }
        }
        out.push(t);
    }
    out.sort_by_key(|t| t.id);
    out
}

/// The statepoint's signal and timer state of process `vpid` (host PID `host`), whose threads
/// and their images are `threads`; refused when it cannot be put back in place.
pub(super) fn check(vpid: u32, host: i32, threads: &[(Thread, Core)]) -> Result<Signals> {
    let Some((_, leader)) = threads.iter().find(|(t, _)| t.vtid == vpid) else {
        return refuse(format!("process {vpid}: no thread group leader among its threads"));
    };
    let queues = threads.iter().map(|(t, c)| (t.vtid, &c.signals)).chain([(vpid, &leader.shared_signals)]);
    for (tid, q) in queues {
        for info in q {
            if info.len() != SIGINFO_SIZE {
                return refuse(format!("thread {tid}: a queued signal of {} bytes at the statepoint", info.len()));
            }
            if STATE_SIGNALS.contains(&signo(info)) {
                return refuse(format!(
                    "thread {tid}: signal {} (a stop, continue, kill or trap) was queued at the statepoint",
                    signo(info)
                ));
            }
        }
    }
    if leader.sigactions.len() != 62 {
        return refuse(format!(
            "process {vpid}: {} signal dispositions in the statepoint, not 62",
            leader.sigactions.len()
        ));
    }
    if leader.sigactions.iter().any(|a| a.compat) {
        return refuse(format!("process {vpid}: a 32-bit signal disposition"));
    }
    // (each step over a system call raises SIGTRAP, and the kernel resets an ignored one to its
    // default: SIGTRAP is the fifth of CRIU's list)
    if leader.sigactions[libc::SIGTRAP as usize - 1].handler == libc::SIG_IGN as u64 {
        return refuse(format!("process {vpid}: SIGTRAP was ignored at the statepoint"));
    }
    let Some(itimers) = leader.itimers else {
        return refuse(format!("process {vpid}: no timers in the statepoint"));
    };
    let live = parse_timers(&Proc::of(host).read("timers")?);
    let mut then = leader.posix_timers.clone();
    then.sort_by_key(|t| t.id);
    let host_of = |vtid: i32| threads.iter().find(|(t, _)| t.vtid as i32 == vtid).map(|(t, _)| t.host);
    let same = |t: &PosixTimer, l: &LiveTimer| {
        (t.id, t.signo, t.sival, t.notify, t.clock) == (l.id, l.signo, l.sival, l.notify, l.clock)
            && (t.notify & SIGEV_THREAD_ID == 0 || t.thread.and_then(host_of) == Some(l.target))
    };
    if then.len() != live.len() || then.iter().zip(&live).any(|(t, l)| !same(t, l)) {
        let ids = |v: Vec<u32>| format!("{v:?}");
        return refuse(format!(
            "process {vpid}: its POSIX timers are not the statepoint's ({} then, {} now)",
            ids(then.iter().map(|t| t.id).collect()),
            ids(live.iter().map(|t| t.id).collect())
        ));
    }
    Ok(Signals {
        sigactions: leader.sigactions.clone(),
        shared: leader.shared_signals.clone(),
        itimers,
        posix: then,
        threads: threads.iter().map(|(_, c)| (c.signals.clone(), c.altstack)).collect(),
    })
}

/// Every held thread blocks every signal (SIGKILL and SIGSTOP aside) but SIGTRAP, so that none
/// is delivered while system calls run in it; each thread's mask is set to the statepoint's
/// afterwards. SIGTRAP stays unblocked: each step over a system call raises one, and the kernel
/// resets a blocked SIGTRAP's disposition to its default for the whole process (CRIU's compel
/// leaves it unblocked too).
pub(super) fn block_all(tracees: &[ptrace::Tracee]) -> Result<()> {
    let mask = !(1u64 << (libc::SIGTRAP - 1));
    for t in tracees {
        t.set_sigmask(mask).map_err(io(format!("block the signals of thread {}", t.tid)))?;
    }
    Ok(())
}

/// Offsets in the scratch page of what the system calls read.
const AT_SET: u64 = 0;
const AT_ZERO_TIME: u64 = 16;
const AT_ACTION: u64 = 64;
const AT_ITIMER: u64 = 128;
const AT_POSIX: u64 = 192;
const AT_INFO: u64 = 256;
const AT_STACK: u64 = 512;
const SCRATCH: u64 = 4096;

/// The process being put back: its threads held, system calls run in them.
pub(super) struct Held<'a> {
    pub vpid: u32,
    pub host: i32,
    pub insn: u64,
    /// The process's threads, in the order of [`Signals`]'s: (tracee, TID in the container).
    pub threads: Vec<(&'a ptrace::Tracee, u32)>,
    pub calls: &'a mut u64,
}

impl Held<'_> {
    pub(super) fn call(&mut self, t: usize, name: &str, nr: libc::c_long, args: &[u64]) -> Result<i64> {
        *self.calls += 1;
        ptrace::call(self.threads[t].0, self.insn, name, nr, args).map_err(io(format!("process {}", self.vpid)))
    }

    /// Runs `f` with a page of `size` bytes mapped in the process by thread `t` (its address,
    /// and the process's memory open for writing), and unmaps it after, whatever `f` returned.
    pub(super) fn with_scratch<T>(
        &mut self,
        t: usize,
        size: u64,
        f: impl FnOnce(&mut Held, &std::fs::File, u64) -> Result<T>,
    ) -> Result<T> {
        let mem = Proc::of(self.host).open_mem_rw()?;
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let base = self.call(t, "mmap", libc::SYS_mmap, &[0, size, prot, flags, u64::MAX, 0])? as u64;
        let r = f(self, &mem, base);
        let unmapped = self.call(t, "munmap", libc::SYS_munmap, &[base, size]);
        r.and_then(|v| unmapped.map(|_| v))
    }

    pub(super) fn leader(&self) -> Result<usize> {
        self.threads
            .iter()
            .position(|(_, v)| *v == self.vpid)
            .ok_or_else(|| Error::Failed(format!("process {}: its leader is not held", self.vpid)))
    }
}

fn timeval(t: (u64, u64)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&t.0.to_le_bytes());
    b[8..].copy_from_slice(&t.1.to_le_bytes());
    b
}

/// An `itimerval` or `itimerspec` (the same layout: interval, then value) arming a timer with
/// what it had left; nothing left but an interval is one interval (as CRIU restores it).
fn arming(interval: (u64, u64), value: (u64, u64)) -> [u8; 32] {
    let value = if value == (0, 0) { interval } else { value };
    let mut b = [0u8; 32];
    b[..16].copy_from_slice(&timeval(interval));
    b[16..].copy_from_slice(&timeval(value));
    b
}

impl Signals {
    /// Puts the process's signals and timers back (see the module's steps). Every thread of
    /// the process blocks every signal on entry ([`block_all`]).
    pub(super) fn apply(&self, h: &mut Held) -> Result<()> {
        let leader = h.leader()?;
        h.with_scratch(leader, SCRATCH, |h, mem, base| self.apply_with(h, leader, mem, base))
    }

    fn apply_with(&self, h: &mut Held, leader: usize, mem: &std::fs::File, base: u64) -> Result<()> {
        let page = Scratch { mem, base, vpid: h.vpid };
        self.stop_timers(h, leader, &page)?;
        empty_queues(h, &page)?;
        self.dispositions(h, leader, &page)?;
        self.queue_again(h, leader, &page)?;
        self.alternate_stacks(h, &page)?;
        self.arm_timers(h, leader, &page)
    }

    /// 1. No timer fires into the queues while they are emptied.
    fn stop_timers(&self, h: &mut Held, leader: usize, page: &Scratch) -> Result<()> {
        page.put(AT_POSIX, &[0u8; 32])?;
        for which in 0..3u64 {
            h.call(leader, "setitimer", libc::SYS_setitimer, &[which, page.at(AT_POSIX), 0])?;
        }
        for t in &self.posix {
            h.call(leader, "timer_settime", libc::SYS_timer_settime, &[u64::from(t.id), 0, page.at(AT_POSIX), 0])?;
        }
        Ok(())
    }

    /// 3. Dispositions: signals 1 to 64 without SIGKILL and SIGSTOP, in CRIU's order.
    fn dispositions(&self, h: &mut Held, leader: usize, page: &Scratch) -> Result<()> {
        let signals = (1..=64u64).filter(|&s| s != libc::SIGKILL as u64 && s != libc::SIGSTOP as u64);
        for (sig, a) in signals.zip(&self.sigactions) {
            let mut b = [0u8; 32];
            for (i, w) in [a.handler, a.flags, a.restorer, a.mask].iter().enumerate() {
                b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
            }
            page.put(AT_ACTION, &b)?;
            h.call(leader, "rt_sigaction", libc::SYS_rt_sigaction, &[sig, page.at(AT_ACTION), 0, 8])?;
        }
        Ok(())
    }

    /// 4. The statepoint's queues, in their order: the process's, then each thread's.
    fn queue_again(&self, h: &mut Held, leader: usize, page: &Scratch) -> Result<()> {
        let vpid = h.vpid;
        for info in &self.shared {
            page.put(AT_INFO, info)?;
            let args = [u64::from(vpid), signo(info) as u64, page.at(AT_INFO)];
            h.call(leader, "rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo, &args)?;
        }
        // (each thread queues its own: the kernel takes a siginfo saying "sent by a process"
        // only from the thread it is sent to)
        for (t, (queue, _)) in self.threads.iter().enumerate() {
            let vtid = h.threads[t].1;
            for info in queue {
                page.put(AT_INFO, info)?;
                let args = [u64::from(vpid), u64::from(vtid), signo(info) as u64, page.at(AT_INFO)];
                h.call(t, "rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo, &args)?;
            }
        }
        Ok(())
    }

    /// 5. Alternate stacks, each set by its own thread standing on our page.
    fn alternate_stacks(&self, h: &mut Held, page: &Scratch) -> Result<()> {
        for (t, (_, stack)) in self.threads.iter().enumerate() {
            let Some((sp, size, flags)) = *stack else { continue };
            let flags = flags & !SS_ONSTACK;
            let (sp, size) = if flags & SS_DISABLE != 0 { (0, 0) } else { (sp, size) };
            let mut b = [0u8; 24];
            b[..8].copy_from_slice(&sp.to_le_bytes());
            b[8..12].copy_from_slice(&flags.to_le_bytes());
            b[16..].copy_from_slice(&size.to_le_bytes());
            page.put(AT_STACK, &b)?;
            *h.calls += 1;
            h.threads[t]
                .0
                .syscall_on(h.insn, page.at(SCRATCH - 64), libc::SYS_sigaltstack, &[page.at(AT_STACK), 0])
                .and_then(|r| {
                    if (-4095..0).contains(&r) {
                        Err(std::io::Error::from_raw_os_error(-r as i32))
                    } else {
                        Ok(())
                    }
                })
                .map_err(io(format!("sigaltstack of thread {}", h.threads[t].1)))?;
        }
        Ok(())
    }

    /// 6. The timers, with the time they had left.
    fn arm_timers(&self, h: &mut Held, leader: usize, page: &Scratch) -> Result<()> {
        for (which, it) in self.itimers.iter().enumerate() {
            if it.armed() {
                page.put(AT_ITIMER, &arming(it.interval, it.value))?;
                h.call(leader, "setitimer", libc::SYS_setitimer, &[which as u64, page.at(AT_ITIMER), 0])?;
            }
        }
        for t in self.posix.iter().filter(|t| t.value != (0, 0) || t.interval != (0, 0)) {
            page.put(AT_POSIX, &arming(t.interval, t.value))?;
            h.call(leader, "timer_settime", libc::SYS_timer_settime, &[u64::from(t.id), 0, page.at(AT_POSIX), 0])?;
        }
        Ok(())
    }
}

/// The scratch page mapped in the process for the system calls' arguments.
struct Scratch<'a> {
    mem: &'a std::fs::File,
    base: u64,
    vpid: u32,
}

impl Scratch<'_> {
    /// The address of offset `off` of the page in the process.
    fn at(&self, off: u64) -> u64 {
        self.base + off
    }

    /// Writes `b` at offset `off` of the page.
    fn put(&self, off: u64, b: &[u8]) -> Result<()> {
        self.mem.write_all_at(b, self.base + off).map_err(io(format!("write process {}'s memory", self.vpid)))
    }
}

/// 2. Every queue emptied, each thread taking its own and the process's.
fn empty_queues(h: &mut Held, page: &Scratch) -> Result<()> {
    let vpid = h.vpid;
    page.put(AT_SET, &u64::MAX.to_le_bytes())?;
    page.put(AT_ZERO_TIME, &[0u8; 16])?;
    for t in 0..h.threads.len() {
        let mut taken = 0;
        loop {
            let args = [page.at(AT_SET), 0, page.at(AT_ZERO_TIME), 8];
            match ptrace::call(h.threads[t].0, h.insn, "rt_sigtimedwait", libc::SYS_rt_sigtimedwait, &args) {
                Ok(_) if taken < 100_000 => taken += 1,
                Ok(_) => return Err(Error::Failed(format!("process {vpid}: signals keep arriving"))),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(io(format!("process {vpid}"))(e)),
            }
            *h.calls += 1;
        }
        *h.calls += 1;
    }
    for &(t, vtid) in &h.threads {
        let st = Proc::of(h.host).task(t.tid).status()?;
        let pending = |k: &str| st.field(k).is_some_and(|v| !v.trim_start_matches('0').is_empty());
        if pending("SigPnd") || pending("ShdPnd") {
            return Err(Error::Failed(format!(
                "thread {vtid}: a signal is still queued after the queues were emptied"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::proc::status_field;

    /// A siginfo as `sigqueue` makes it: signal, `SI_QUEUE`, sender, value.
    fn queued(sig: i32, pid: i32, value: u64) -> Vec<u8> {
        let mut b = vec![0u8; SIGINFO_SIZE];
        b[..4].copy_from_slice(&sig.to_le_bytes());
        b[8..12].copy_from_slice(&libc::SI_QUEUE.to_le_bytes());
        b[16..20].copy_from_slice(&pid.to_le_bytes());
        b[24..32].copy_from_slice(&value.to_le_bytes());
        b
    }

    fn status_mask(pid: i32, key: &str) -> u64 {
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        u64::from_str_radix(&status_field(&st, key).unwrap(), 16).unwrap()
    }

    /// The real path, on a child of the test: a queued signal of its own is taken away, the
    /// statepoint's (with its siginfo) queued instead, a disposition and a timer set.
    #[test]
    fn a_child_gets_the_statepoints_signals_and_timers() {
        // SAFETY: the child only blocks two signals and waits; it is killed at the end.
        let child = unsafe { libc::fork() };
        if child == 0 {
            super::super::close_inherited();
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGUSR1);
                libc::sigaddset(&mut set, libc::SIGRTMIN() + 3);
                libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                loop {
                    libc::pause();
                }
            }
        }
        let _k = ptrace::tests::Kill(child);
        let usr1 = 1u64 << (libc::SIGUSR1 - 1);
        let start = std::time::Instant::now();
        while status_mask(child, "SigBlk") & usr1 == 0 {
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "the child did not block its signals");
            std::thread::yield_now();
        }
        // SAFETY: a signal the child blocks.
        unsafe { libc::kill(child, libc::SIGUSR1) };
        assert_eq!(status_mask(child, "ShdPnd"), usr1);
        let t = match ptrace::Tracee::seize(child) {
            Ok(t) => t,
            // Some sandboxes forbid ptrace: nothing to test there.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return,
            Err(e) => panic!("{e}"),
        };
        let rt = libc::SIGRTMIN() + 3;
        let mut sigactions = vec![SigAction::default(); 62];
        // SIGUSR2 (12: the 11th of CRIU's list, which has no 9) ignored.
        sigactions[10].handler = 1;
        let s = Signals {
            sigactions,
            shared: vec![queued(rt, child, 0xfeed)],
            itimers: [ITimer { interval: (0, 0), value: (1000, 0) }, ITimer::default(), ITimer::default()],
            posix: Vec::new(),
            threads: vec![(vec![queued(libc::SIGUSR1, child, 5)], None)],
        };
        let maps_before = super::super::maps_for_comparison(child);
        block_all(std::slice::from_ref(&t)).unwrap();
        let mut calls = 0;
        let insn = ptrace::syscall_instruction(child).unwrap();
        let mut h =
            Held { vpid: child as u32, host: child, insn, threads: vec![(&t, child as u32)], calls: &mut calls };
        s.apply(&mut h).unwrap();
        assert!(calls > 62, "{calls} system calls");
        assert_eq!(status_mask(child, "ShdPnd"), 1u64 << (rt - 1), "only the statepoint's signal is queued");
        assert_eq!(status_mask(child, "SigPnd"), usr1, "the thread's own, queued to it");
        assert_eq!(status_mask(child, "SigIgn") & (1 << 11), 1 << 11, "SIGUSR2 ignored");
        // The queued siginfo is the statepoint's, byte for byte where the kernel keeps it.
        let mut info = [0u8; SIGINFO_SIZE];
        #[repr(C)]
        struct Peek {
            off: u64,
            flags: u32,
            nr: i32,
        }
        let args = Peek { off: 0, flags: 1, nr: 1 };
        // SAFETY: PTRACE_PEEKSIGINFO writes one siginfo into our buffer.
        let n = unsafe { libc::ptrace(0x4209, child, &args as *const Peek, info.as_mut_ptr()) };
        assert_eq!(n, 1);
        assert_eq!(&info[..32], &queued(rt, child, 0xfeed)[..32]);
        // The scratch page is gone: the memory layout is as it was.
        assert_eq!(super::super::maps_for_comparison(child), maps_before);
        drop(t);
    }

    #[test]
    fn proc_timers_parse() {
        let text = "ID: 0\nsignal: 14/0000000000000000\nnotify: signal/pid.123\nClockID: 1\n\
                    ID: 5\nsignal: 34/00007f0000001000\nnotify: signal/tid.130\nClockID: 0\n\
                    ID: 2\nsignal: 0/0000000000000000\nnotify: none/pid.123\nClockID: 1\n";
        let t = parse_timers(text);
        assert_eq!(
            t,
            vec![
                LiveTimer { id: 0, signo: 14, sival: 0, notify: 0, target: 123, clock: 1 },
                LiveTimer { id: 2, signo: 0, sival: 0, notify: 1, target: 123, clock: 1 },
                LiveTimer { id: 5, signo: 34, sival: 0x7f0000001000, notify: 4, target: 130, clock: 0 },
            ]
        );
        assert!(parse_timers("").is_empty());
    }

    #[test]
    fn timers_are_armed_with_what_they_had_left() {
        let b = arming((0, 500), (3, 7));
        assert_eq!(
            (&b[..8], &b[8..16], &b[16..24], &b[24..]),
            (&[0u8; 8][..], &500u64.to_le_bytes()[..], &3u64.to_le_bytes()[..], &7u64.to_le_bytes()[..])
        );
        // Nothing left, an interval: one interval.
        assert_eq!(&arming((2, 0), (0, 0))[16..24], &2u64.to_le_bytes());
    }
}
