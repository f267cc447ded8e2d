//! The page server's pace: its background work waits for CPU time nothing else wants.
//!
//! A fork restored on demand answers before its memory is all there; the rest comes in the
//! background. When many forks are made at once (`fork --count N`), every server's transfer
//! competed with the other forks' restores for the same CPUs, and memory on demand lost to
//! memory restored whole. So before each background run the serving thread passes a **gate**: it
//! takes `SCHED_IDLE` (the class the scheduler runs only when nothing else wants the CPU) and
//! yields, and once the scheduler runs it again it takes the normal class back and makes the run.
//! The copy itself is never made as the idle class: `UFFDIO_COPY` (and a read of
//! `/proc/PID/mem`) holds the restored process's memory lock, and a starved holder would stall
//! the container's own `munmap`, `mremap` or `fork` for seconds.
//!
//! * A fault does not wait at the gate: a watcher thread (normal) waits on an epoll set of the
//!   processes' userfaultfds (edge-triggered: one wake per new event) and, when the serving
//!   thread is at the gate, gives it the normal class at once. It counts each wake first; the
//!   serving thread takes the idle class and then reads the count, so one of the two always sees
//!   the other, and the serving thread looks for events before the run when the count moved.
//! * Whoever waits for the memory to be all there (a snapshot, a rollback, a spare: [`hurry`])
//!   sends `SIGUSR1` to the server's session, read through a signalfd the watcher waits on too:
//!   from then on no gate, and a thread at the gate is let through at once.
//! * Settling's comparison of the installed pages with the dump, the container running, passes
//!   the gate too, every run of pages; its two frozen moments do not.
//!
//! The serving process hears the signal from before anyone can know it ([`listen`]); where the
//! idle class cannot be had, or the signal not heard, there is no gate.

use nix::libc;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

/// Someone waits for the memory: no more gate.
static HURRIED: AtomicBool = AtomicBool::new(false);
/// Where this process hears [`hurry`] ([`listen`]).
static HEARD: OnceLock<SignalFd> = OnceLock::new();

/// The signal [`hurry`] sends.
pub const SIGNAL: Signal = Signal::SIGUSR1;

/// Tells the page server whose session is `server` that its memory is waited for.
pub fn hurry(server: i32) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(server), SIGNAL);
}

/// The process that starts the serving one ignores [`SIGNAL`] (it is sent to the whole session).
pub fn ignore_hurry() {
    // SAFETY: SIG_IGN is no handler.
    let _ = unsafe { nix::sys::signal::signal(SIGNAL, nix::sys::signal::SigHandler::SigIgn) };
}

/// The serving process hears [`hurry`] from now on: [`SIGNAL`] blocked (threads started later
/// inherit it; a blocked signal is kept even where it is ignored) and read through a signalfd.
/// Called before the process can be known, so that no hurry is lost. False where it cannot.
pub fn listen() -> bool {
    let mut set = SigSet::empty();
    set.add(SIGNAL);
    if nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None).is_err() {
        return false;
    }
    match SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC) {
        Ok(fd) => HEARD.set(fd).is_ok(),
        Err(_) => false,
    }
}

/// Whether someone waited for the memory ([`hurry`]).
pub fn hurried() -> bool {
    if HURRIED.load(SeqCst) {
        return true;
    }
    if HEARD.get().is_some_and(|fd| matches!(fd.read_signal(), Ok(Some(_)))) {
        HURRIED.store(true, SeqCst);
    }
    HURRIED.load(SeqCst)
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

/// Whether a thread here may take the idle class and leave it again (leaving it needs
/// `CAP_SYS_NICE` or `RLIMIT_NICE`): tried on a thread of its own, thrown away after.
fn idle_class_can_be_left() -> bool {
    std::thread::spawn(|| set_class(gettid(), libc::SCHED_IDLE) && set_class(gettid(), libc::SCHED_OTHER))
        .join()
        .unwrap_or(false)
}

/// What the watcher and the serving thread share.
struct Shared {
    epoll: Epoll,
    /// The watcher's wakes so far.
    boosts: AtomicU64,
    /// The serving thread is at the gate (the watcher lets it through).
    gated: AtomicBool,
    /// In the epoll set: the watcher's end.
    stop: EventFd,
    stopping: AtomicBool,
    serving: i32,
}

/// The key of the stop eventfd and of the signalfd in the epoll set (a userfaultfd's is 0).
const STOP: u64 = u64::MAX;
const HEARD_KEY: u64 = u64::MAX - 1;

/// The serving thread's pace (see the module's documentation). Dropped, the watcher ends.
pub struct Pace {
    shared: Arc<Shared>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl Pace {
    /// The serving thread's pace, or none where there can be no gate (the server then runs as
    /// a normal thread throughout). Call on the serving thread, after [`listen`].
    pub fn new() -> Option<Pace> {
        let heard = HEARD.get()?;
        if !idle_class_can_be_left() {
            return None;
        }
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).ok()?;
        let stop = EventFd::from_flags(EfdFlags::EFD_CLOEXEC).ok()?;
        epoll.add(stop.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, STOP)).ok()?;
        epoll.add(heard.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, HEARD_KEY)).ok()?;
        let shared = Arc::new(Shared {
            epoll,
            boosts: AtomicU64::new(0),
            gated: AtomicBool::new(false),
            stop,
            stopping: AtomicBool::new(false),
            serving: gettid(),
        });
        let s = shared.clone();
        let watcher = std::thread::Builder::new().name("pace".into()).spawn(move || watch(&s)).ok()?;
        Some(Pace { shared, watcher: Some(watcher) })
    }

    /// A process's userfaultfd, watched from now on (closed, it leaves the set by itself).
    pub fn watch(&self, uffd: BorrowedFd) {
        let _ = self.shared.epoll.add(uffd, EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0));
    }

    /// The watcher's count, read before looking for events.
    pub fn seen(&self) -> u64 {
        self.shared.boosts.load(SeqCst)
    }

    /// The gate before a background run, with `seen` read before the last look for events: the
    /// thread waits as the idle class until the scheduler runs it again, and is normal after.
    /// True: make the run, as a run the gate held (false for `held`: someone waits for the memory,
    /// and there was no gate). None: the watcher woke since `seen` (an event or a hurry may
    /// wait): look first.
    pub fn gate(&self, seen: u64) -> Option<bool> {
        let s = &*self.shared;
        if hurried() {
            return Some(false);
        }
        s.gated.store(true, SeqCst);
        set_class(s.serving, libc::SCHED_IDLE);
        if s.boosts.load(SeqCst) == seen {
            // SAFETY: a plain system call.
            unsafe { libc::sched_yield() };
        }
        set_class(s.serving, libc::SCHED_OTHER);
        s.gated.store(false, SeqCst);
        (s.boosts.load(SeqCst) == seen).then_some(true)
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        self.shared.stopping.store(true, SeqCst);
        let _ = self.shared.stop.write(1);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

/// The watcher: a count of each wake (a new userfaultfd event, a hurry), and the serving thread
/// let through the gate when it is there.
fn watch(s: &Shared) {
    let mut events = [EpollEvent::empty(); 8];
    loop {
        let n = match s.epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return,
        };
        if s.stopping.load(SeqCst) {
            return;
        }
        if events[..n].iter().any(|e| e.data() == HEARD_KEY) {
            // (read, so the signalfd is not ready again)
            hurried();
        }
        s.boosts.fetch_add(1, SeqCst);
        if s.gated.load(SeqCst) {
            set_class(s.serving, libc::SCHED_OTHER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn class(tid: i32) -> libc::c_int {
        // SAFETY: a plain system call.
        unsafe { libc::sched_getscheduler(tid) }
    }

    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(30), "never: {what}");
            std::thread::yield_now();
        }
    }

    /// The gate leaves the thread normal; a new event on a watched descriptor is counted, and
    /// gives a thread at the gate (only then) the normal class; a gate after a count that moved
    /// does not wait and says to look first; once hurried, no gate. (An eventfd stands for a
    /// userfaultfd: the watcher sees only readiness. The wait at the gate itself is the
    /// scheduler's: not asserted, the machine's load decides it.)
    #[test]
    fn the_gate_and_the_watcher_keep_to_their_protocol() {
        assert!(Pace::new().is_none(), "no gate before the process listens for a hurry");
        assert!(listen());
        std::thread::spawn(|| {
            let pace = Pace::new().expect("the idle class here, and back");
            let me = gettid();
            let ready = EventFd::from_flags(EfdFlags::EFD_NONBLOCK).unwrap();
            pace.watch(ready.as_fd());
            assert_eq!(pace.gate(pace.seen()), Some(true));
            assert_eq!(class(me), libc::SCHED_OTHER, "normal after the gate");

            // Idle but not at the gate: an event is counted, the class left alone.
            set_class(me, libc::SCHED_IDLE);
            let seen = pace.seen();
            ready.write(1).unwrap();
            until("the event counted", || pace.seen() != seen);
            assert_eq!(class(me), libc::SCHED_IDLE);
            // A gate with the count read before it: no wait, look first; normal after.
            assert_eq!(pace.gate(seen), None);
            assert_eq!(class(me), libc::SCHED_OTHER);

            // At the gate (as the thread is while the scheduler holds it): the next event (a new
            // one: the descriptor still holds the last) lets it through.
            pace.shared.gated.store(true, SeqCst);
            set_class(me, libc::SCHED_IDLE);
            ready.write(1).unwrap();
            until("let through", || class(me) == libc::SCHED_OTHER);
            pace.shared.gated.store(false, SeqCst);

            // Hurried: no gate from now on, the signal read once.
            nix::sys::signal::raise(SIGNAL).unwrap();
            assert!(hurried());
            assert_eq!(pace.gate(pace.seen()), Some(false));
            assert_eq!(class(me), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
