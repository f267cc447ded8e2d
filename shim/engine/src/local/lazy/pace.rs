//! The page server's pace: its background transfer takes only CPU time nothing else wants.
//!
//! A fork restored on demand answers before its memory is all there; the rest comes in the
//! background. When many forks are made at once (`fork --count N`), every server's transfer
//! competed with the other forks' restores for the same CPUs, and memory on demand lost to
//! memory restored whole. So the serving thread copies in the background as `SCHED_IDLE`, the
//! class the scheduler runs only on a CPU with nothing else to run, and answers a fault as a
//! normal thread:
//!
//! * a watcher thread, normal, waits on an epoll set of the processes' userfaultfds; when one is
//!   ready it counts a boost and gives the serving thread the normal class at once, even in the
//!   middle of a background run, then waits until the serving thread has read what was ready;
//! * the serving thread takes the idle class before a background run and then looks at the
//!   count: a boost since it last looked means an event may be waiting, and it stays normal for
//!   it (the watcher counts before it boosts, the serving thread sets before it looks: one of the
//!   two always sees the other);
//! * whoever waits for the memory to be all there (a snapshot, a rollback, a spare: [`hurry`])
//!   sends `SIGUSR1` to the server's session: the rest is transferred as a normal thread.
//!
//! Where the idle class cannot be had, the server runs as it did, normal throughout.

use nix::libc;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

/// Set by `SIGUSR1`: someone waits for the memory; no more idle class.
static HURRIED: AtomicBool = AtomicBool::new(false);
/// The serving thread, for the signal's handler to give it the normal class (0: none yet).
static SERVING: AtomicI32 = AtomicI32::new(0);

/// Whether someone waited for the memory ([`hurry`]).
pub fn hurried() -> bool {
    HURRIED.load(SeqCst)
}

/// The signal [`hurry`] sends.
pub const SIGNAL: nix::sys::signal::Signal = nix::sys::signal::Signal::SIGUSR1;

/// Tells the page server whose session is `server` that its memory is waited for.
pub fn hurry(server: i32) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(server), SIGNAL);
}

/// The process that starts the serving one ignores [`SIGNAL`] (it is sent to the whole session).
pub fn ignore_hurry() {
    // SAFETY: SIG_IGN is no handler.
    let _ = unsafe { nix::sys::signal::signal(SIGNAL, nix::sys::signal::SigHandler::SigIgn) };
}

extern "C" fn on_hurry(_: libc::c_int) {
    HURRIED.store(true, SeqCst);
    let tid = SERVING.load(SeqCst);
    if tid > 0 {
        // (a system call: safe in a handler)
        set_class(tid, libc::SCHED_OTHER);
    }
}

fn set_class(tid: i32, policy: libc::c_int) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: a plain system call on a thread of this process.
    unsafe { libc::sched_setscheduler(tid, policy, &param) == 0 }
}

fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// What the watcher and the serving thread share.
struct Shared {
    epoll: Epoll,
    /// Boosts given so far.
    boosts: AtomicU64,
    /// Written by the serving thread each time it has read its userfaultfds.
    drained: EventFd,
    /// In the epoll set: the watcher's end.
    stop: EventFd,
    stopping: AtomicBool,
    serving: i32,
}

/// The serving thread's pace (see the module's documentation). Dropped, the watcher ends and
/// the thread is normal again.
pub struct Pace {
    shared: Arc<Shared>,
    watcher: Option<std::thread::JoinHandle<()>>,
    /// What this thread last set itself to, and the boost count then.
    idle: bool,
    set_at: u64,
}

impl Pace {
    /// The serving thread's pace, or none where the idle class cannot be had (the server is then
    /// normal throughout). Call on the serving thread.
    pub fn new() -> Option<Pace> {
        let serving = gettid();
        // (whether the class can be had at all, and back: tried once)
        if !set_class(serving, libc::SCHED_IDLE) || !set_class(serving, libc::SCHED_OTHER) {
            return None;
        }
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).ok()?;
        let flags = EfdFlags::EFD_CLOEXEC;
        let (drained, stop) = (EventFd::from_flags(flags).ok()?, EventFd::from_flags(flags).ok()?);
        epoll.add(stop.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, u64::MAX)).ok()?;
        let shared = Arc::new(Shared {
            epoll,
            boosts: AtomicU64::new(0),
            drained,
            stop,
            stopping: AtomicBool::new(false),
            serving,
        });
        SERVING.store(serving, SeqCst);
        let handler = nix::sys::signal::SigAction::new(
            nix::sys::signal::SigHandler::Handler(on_hurry),
            nix::sys::signal::SaFlags::SA_RESTART,
            nix::sys::signal::SigSet::empty(),
        );
        // SAFETY: the handler only stores an atomic and makes one system call.
        unsafe { nix::sys::signal::sigaction(SIGNAL, &handler).ok()? };
        let s = shared.clone();
        let watcher = std::thread::Builder::new().name("pace".into()).spawn(move || watch(&s)).ok()?;
        Some(Pace { shared, watcher: Some(watcher), idle: false, set_at: 0 })
    }

    /// A process's userfaultfd, watched from now on (closed, it leaves the set by itself).
    pub fn watch(&self, uffd: BorrowedFd) {
        let _ = self.shared.epoll.add(uffd, EpollEvent::new(EpollFlags::EPOLLIN, 0));
    }

    /// The boost count, read before looking for events.
    pub fn seen(&self) -> u64 {
        self.shared.boosts.load(SeqCst)
    }

    /// Events were found: the thread is normal while it reads them.
    pub fn normal(&mut self) {
        if self.idle {
            set_class(self.shared.serving, libc::SCHED_OTHER);
            self.idle = false;
        }
    }

    /// The events found were read: the watcher may look again.
    pub fn drained(&self) {
        let _ = self.shared.drained.write(1);
    }

    /// Before a background run, with `seen` read before the last look for events: whether the
    /// thread may run it as idle now. False when a boost came since `seen` (an event may be
    /// waiting: look first) or someone waits for the memory (the thread is normal then).
    pub fn idle(&mut self, seen: u64) -> bool {
        if HURRIED.load(SeqCst) {
            self.normal();
            return true;
        }
        if self.idle && self.set_at == seen && self.seen() == seen {
            return true;
        }
        set_class(self.shared.serving, libc::SCHED_IDLE);
        self.idle = true;
        let now = self.seen();
        if now != seen {
            self.normal();
            return false;
        }
        self.set_at = now;
        true
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        self.shared.stopping.store(true, SeqCst);
        let _ = self.shared.stop.write(1);
        let _ = self.shared.drained.write(1);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        SERVING.store(0, SeqCst);
        self.normal();
    }
}

/// The watcher: a boost each time a userfaultfd is ready, then a wait until it was read.
fn watch(s: &Shared) {
    let mut events = [EpollEvent::empty(); 8];
    while !s.stopping.load(SeqCst) {
        match s.epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) if events[..n].iter().any(|e| e.data() != u64::MAX) => {}
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return,
        }
        if s.stopping.load(SeqCst) {
            return;
        }
        s.boosts.fetch_add(1, SeqCst);
        set_class(s.serving, libc::SCHED_OTHER);
        // (until the serving thread has read them: they stay ready till then)
        let _ = s.drained.read();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(tid: i32) -> libc::c_int {
        // SAFETY: a plain system call.
        unsafe { libc::sched_getscheduler(tid) }
    }

    /// The serving thread idles for a background run, is made normal by the watcher as soon as
    /// a watched descriptor is ready (without looking itself), stays normal when it looks after a
    /// boost, and is normal for good once hurried. (An eventfd stands for a userfaultfd: the
    /// watcher sees only readiness.)
    #[test]
    fn idle_for_the_background_normal_for_an_event_and_once_hurried() {
        std::thread::spawn(|| {
            let Some(mut pace) = Pace::new() else {
                panic!("SCHED_IDLE could not be had here");
            };
            let me = gettid();
            let ready = EventFd::from_flags(EfdFlags::EFD_NONBLOCK).unwrap();
            pace.watch(ready.as_fd());
            let seen = pace.seen();
            assert!(pace.idle(seen));
            assert_eq!(class(me), libc::SCHED_IDLE);
            assert!(pace.idle(seen), "still idle: no syscall, no boost");
            // An event: the watcher boosts this thread while it "runs" in the background.
            ready.write(1).unwrap();
            let t = std::time::Instant::now();
            // (the watcher counts, then boosts)
            while class(me) != libc::SCHED_OTHER {
                assert!(t.elapsed() < std::time::Duration::from_secs(30), "no boost came");
                std::thread::yield_now();
            }
            assert_ne!(pace.seen(), seen, "a boost counted");
            // Looking with the count read before the boost: stay normal, look for the event first.
            assert!(!pace.idle(seen));
            assert_eq!(class(me), libc::SCHED_OTHER);
            // The event read, the count read again: idle for the next run.
            ready.read().unwrap();
            pace.drained();
            let seen = pace.seen();
            assert!(pace.idle(seen));
            assert_eq!(class(me), libc::SCHED_IDLE);
            // Hurried: normal, and stays so.
            nix::sys::signal::raise(SIGNAL).unwrap();
            assert_eq!(class(me), libc::SCHED_OTHER);
            assert!(pace.idle(pace.seen()));
            assert_eq!(class(me), libc::SCHED_OTHER);
            drop(pace);
            assert_eq!(class(me), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
