//! The threads of a frozen container, held with ptrace for a rollback in place: registers, FPU
//! state and signal masks set, and system calls run inside a process (`brk`, `mmap`, `munmap`,
//! `mprotect`, `madvise`) by stepping its thread over a `syscall` instruction of its vDSO — the
//! way CRIU's compel runs code in a task, without injecting any.
//!
//! Dropping a [`Tracee`] detaches it: the thread goes on from wherever its registers say.

use nix::libc;
use nix::sys::ptrace;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::io;
use std::time::{Duration, Instant};
use sys::proc::Proc;

// What `nix::sys::ptrace` does not cover — the XSAVE area (`PTRACE_GETREGSET` of
// `NT_X86_XSTATE`, whose size the kernel decides) and setting the signal mask — is asked of
// `libc::ptrace` directly.
const NT_X86_XSTATE: libc::c_int = 0x202;
#[cfg(test)]
const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;

fn check(r: libc::c_long, what: &str, tid: i32) -> io::Result<libc::c_long> {
    if r == -1 {
        let e = io::Error::last_os_error();
        Err(io::Error::new(e.kind(), format!("{what} of thread {tid}: {e}")))
    } else {
        Ok(r)
    }
}

/// A failed request of `nix::sys::ptrace`, named with its thread.
fn failed(what: &'static str, tid: i32) -> impl FnOnce(nix::errno::Errno) -> io::Error {
    move |e| {
        let e = io::Error::from(e);
        io::Error::new(e.kind(), format!("{what} of thread {tid}: {e}"))
    }
}

/// One thread stopped under ptrace.
pub struct Tracee {
    pub tid: i32,
}

impl Tracee {
    /// Seizes thread `tid` and waits (10 s at most) until it stops.
    ///
    /// Should planarian die while it holds the thread (SIGKILL, a panic), the kernel kills the
    /// thread (`PTRACE_O_EXITKILL`): a process halfway put back — some of its pages written, its
    /// signals blocked — must not run on as if nothing happened. The statepoints are intact, and
    /// the next operation restores the rollback's target.
    pub fn seize(tid: i32) -> io::Result<Tracee> {
        ptrace::seize(Pid::from_raw(tid), ptrace::Options::PTRACE_O_EXITKILL).map_err(failed("PTRACE_SEIZE", tid))?;
        let t = Tracee { tid };
        ptrace::interrupt(t.pid()).map_err(failed("PTRACE_INTERRUPT", tid))?;
        t.wait_stop()?;
        Ok(t)
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.tid)
    }

    /// The signal of the thread's next stop (a ptrace event stop is SIGTRAP's).
    fn wait_stop(&self) -> io::Result<i32> {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match waitpid(self.pid(), Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Stopped(_, sig)) => return Ok(sig as i32),
                Ok(WaitStatus::PtraceEvent(_, sig, _)) => return Ok(sig as i32),
                Ok(WaitStatus::StillAlive) => {}
                Ok(other) => {
                    return Err(io::Error::other(format!("thread {} ended while held ({other:?})", self.tid)));
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    let e = io::Error::from(e);
                    return Err(io::Error::new(e.kind(), format!("waiting for thread {}: {e}", self.tid)));
                }
            }
            if Instant::now() > end {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("thread {} did not stop within 10 s", self.tid),
                ));
            }
            // A stop is reported through waitpid only (no descriptor to block on for a tracee
            // that is not our child): poll it.
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn regs(&self) -> io::Result<libc::user_regs_struct> {
        ptrace::getregs(self.pid()).map_err(failed("PTRACE_GETREGS", self.tid))
    }

    pub fn set_regs(&self, r: &libc::user_regs_struct) -> io::Result<()> {
        ptrace::setregs(self.pid(), *r).map_err(failed("PTRACE_SETREGS", self.tid))
    }

    /// The thread's XSAVE area (its first 512 bytes are FXSAVE's layout).
    pub fn xstate(&self) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; 64 << 10];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        check(
            // SAFETY: the kernel writes at most iov_len bytes into our buffer, and says how many.
            unsafe { libc::ptrace(libc::PTRACE_GETREGSET, self.tid, NT_X86_XSTATE, &mut iov as *mut _) },
            "PTRACE_GETREGSET",
            self.tid,
        )?;
        buf.truncate(iov.iov_len);
        Ok(buf)
    }

    pub fn set_xstate(&self, buf: &[u8]) -> io::Result<()> {
        let mut iov = libc::iovec { iov_base: buf.as_ptr() as *mut libc::c_void, iov_len: buf.len() };
        check(
            unsafe { libc::ptrace(libc::PTRACE_SETREGSET, self.tid, NT_X86_XSTATE, &mut iov as *mut _) },
            "PTRACE_SETREGSET",
            self.tid,
        )
        .map(drop)
    }

    /// (what the tests read back)
    #[cfg(test)]
    pub fn sigmask(&self) -> io::Result<u64> {
        let mut m = 0u64;
        check(
            unsafe { libc::ptrace(PTRACE_GETSIGMASK, self.tid, 8usize, &mut m as *mut u64) },
            "PTRACE_GETSIGMASK",
            self.tid,
        )?;
        Ok(m)
    }

    pub fn set_sigmask(&self, m: u64) -> io::Result<()> {
        check(
            unsafe { libc::ptrace(PTRACE_SETSIGMASK, self.tid, 8usize, &m as *const u64) },
            "PTRACE_SETSIGMASK",
            self.tid,
        )
        .map(drop)
    }

    /// Runs system call `nr` with `args` in the thread, stepping it over the `syscall`
    /// instruction at `insn`; its registers are put back after. The call's return value.
    /// The cgroup must not be frozen (a frozen thread would not step).
    pub fn syscall(&self, insn: u64, nr: libc::c_long, args: &[u64]) -> io::Result<i64> {
        self.step_syscall(insn, None, nr, args)
    }

    /// [`syscall`](Self::syscall) with the stack pointer at `sp` meanwhile (`sigaltstack`
    /// refuses to change the stack a thread stands on).
    pub fn syscall_on(&self, insn: u64, sp: u64, nr: libc::c_long, args: &[u64]) -> io::Result<i64> {
        self.step_syscall(insn, Some(sp), nr, args)
    }

    fn step_syscall(&self, insn: u64, sp: Option<u64>, nr: libc::c_long, args: &[u64]) -> io::Result<i64> {
        let saved = self.regs()?;
        let mut r = saved;
        r.rip = insn;
        if let Some(sp) = sp {
            r.rsp = sp;
        }
        r.rax = nr as u64;
        // No restart of a system call the thread was in when it stopped.
        r.orig_rax = u64::MAX;
        let slots = [&mut r.rdi, &mut r.rsi, &mut r.rdx, &mut r.r10, &mut r.r8, &mut r.r9];
        for (slot, a) in slots.into_iter().zip(args) {
            *slot = *a;
        }
        self.set_regs(&r)?;
        let stepped = (|| {
            ptrace::step(self.pid(), None).map_err(failed("PTRACE_SINGLESTEP", self.tid))?;
            let sig = self.wait_stop()?;
            if sig != libc::SIGTRAP {
                return Err(io::Error::other(format!(
                    "thread {} stopped with signal {sig} instead of after the system call",
                    self.tid
                )));
            }
            let after = self.regs()?;
            if after.rip != insn + 2 {
                return Err(io::Error::other(format!(
                    "thread {} did not step over the system call (at {:#x})",
                    self.tid, after.rip
                )));
            }
            Ok(after.rax as i64)
        })();
        self.set_regs(&saved)?;
        stepped
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        let _ = ptrace::detach(self.pid(), None);
    }
}

/// Runs `nr` and turns a negative return into the error it is.
pub fn call(t: &Tracee, insn: u64, name: &str, nr: libc::c_long, args: &[u64]) -> io::Result<i64> {
    let r = t.syscall(insn, nr, args)?;
    if (-4095..0).contains(&r) {
        let e = io::Error::from_raw_os_error(-r as i32);
        return Err(io::Error::new(e.kind(), format!("{name} in process {}: {e}", t.tid)));
    }
    Ok(r)
}

/// A `/proc` error as an I/O error that keeps its one line (the file it names).
fn into_io(e: sys::IoError) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

/// The address of a `syscall` instruction (0f 05) in process `pid`'s vDSO.
pub fn syscall_instruction(pid: i32) -> io::Result<u64> {
    let me = Proc::of(pid);
    let vdso = me
        .maps()
        .map_err(into_io)?
        .into_iter()
        .find(|m| m.path == "[vdso]")
        .ok_or_else(|| io::Error::other(format!("process {pid} has no vDSO")))?;
    let (s, e) = (vdso.start, vdso.end);
    let mut buf = vec![0u8; (e - s) as usize];
    let mem = me.open("mem").map_err(into_io)?;
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut buf, s)?;
    buf.windows(2)
        .position(|w| w == [0x0f, 0x05])
        .map(|i| s + i as u64)
        .ok_or_else(|| io::Error::other(format!("no syscall instruction in process {pid}'s vDSO")))
}

/// A duplicate of descriptor `fd` of process `pid` (the same open file description: seeking it
/// moves the process's offset).
pub fn dup_fd(pid: i32, fd: u32) -> io::Result<std::os::fd::OwnedFd> {
    crate::pidfd::get_fd(&crate::pidfd::open(pid)?, fd)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Runs system calls in a child of the test: the real ptrace path, on this machine's kernel.
    #[test]
    fn steps_a_child_over_system_calls_and_sets_its_state() {
        // SAFETY: the child only loops; it is killed at the end.
        let child = unsafe { libc::fork() };
        if child == 0 {
            super::super::close_inherited();
            loop {
                unsafe { libc::pause() };
            }
        }
        let done = Kill(child);
        let t = match Tracee::seize(child) {
            Ok(t) => t,
            // Some sandboxes forbid ptrace: nothing to test there.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return,
            Err(e) => panic!("{e}"),
        };
        let insn = syscall_instruction(child).unwrap();
        let pid = call(&t, insn, "getpid", libc::SYS_getpid, &[]).unwrap();
        assert_eq!(pid, i64::from(child));
        let len = 3 * 4096u64;
        let addr = call(
            &t,
            insn,
            "mmap",
            libc::SYS_mmap,
            &[0, len, 3, (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64, u64::MAX, 0],
        )
        .unwrap() as u64;
        let maps = std::fs::read_to_string(format!("/proc/{child}/maps")).unwrap();
        assert!(maps.contains(&format!("{addr:x}-{:x} rw-p", addr + len)), "{maps}");
        // Memory written through /proc/PID/mem, read back.
        let mem = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{child}/mem")).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&mem, b"planarian", addr + 4096).unwrap();
        let mut back = [0u8; 9];
        std::os::unix::fs::FileExt::read_exact_at(&mem, &mut back, addr + 4096).unwrap();
        assert_eq!(&back, b"planarian");
        call(&t, insn, "munmap", libc::SYS_munmap, &[addr, len]).unwrap();
        assert!(call(&t, insn, "madvise", libc::SYS_madvise, &[addr, len, 999])
            .unwrap_err()
            .to_string()
            .contains("madvise"));
        // Registers and mask come back as set.
        let before = t.regs().unwrap();
        t.set_sigmask(1 << 9).unwrap();
        assert_eq!(t.sigmask().unwrap(), 1 << 9);
        let mut r = before;
        r.r12 = 0x1234_5678;
        t.set_regs(&r).unwrap();
        assert_eq!(t.regs().unwrap().r12, 0x1234_5678);
        let x = t.xstate().unwrap();
        assert!(x.len() >= 512);
        t.set_xstate(&x).unwrap();
        drop(t);
        drop(done);
    }

    /// A tracer that ends while it holds a thread takes the thread with it.
    #[test]
    fn a_thread_held_by_a_tracer_that_ends_is_killed() {
        // SAFETY: the child only waits; it is reaped below.
        let child = unsafe { libc::fork() };
        if child == 0 {
            super::super::close_inherited();
            loop {
                unsafe { libc::pause() };
            }
        }
        let _k = Kill(child);
        let held = std::thread::spawn(move || match Tracee::seize(child) {
            // The tracer is this thread: it ends holding the child.
            Ok(t) => {
                std::mem::forget(t);
                true
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => false,
            Err(e) => panic!("{e}"),
        });
        if !held.join().unwrap() {
            return;
        }
        let mut status = 0;
        // SAFETY: our child; waitpid writes the status.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "status {status:#x}");
    }

    /// A child of a test, killed and reaped at the end.
    pub(in crate::local::inplace) struct Kill(pub i32);
    impl Drop for Kill {
        fn drop(&mut self) {
            unsafe {
                libc::kill(self.0, libc::SIGKILL);
                libc::waitpid(self.0, std::ptr::null_mut(), 0);
            }
        }
    }
}
