//! The page server's pace: its background work takes CPU time nothing else wants.
//!
//! A fork restored on demand answers before its memory is all there; the rest comes in the
//! background. When many forks are made at once (`fork --count N`), every server's transfer
//! competed with the other forks' restores for the same CPUs, and memory on demand lost to
//! memory restored whole. So each background run of pages is made as `SCHED_IDLE`, the class the
//! scheduler runs only when nothing else wants the CPU (and preempts for any other that wakes),
//! and the serving thread is normal everywhere else:
//!
//! * A fault does not wait behind an idle run: a watcher thread (normal) waits on an epoll set of
//!   the processes' userfaultfds (edge-triggered: one wake per new event) and gives the serving
//!   thread the normal class at once. It counts each wake first; the serving thread takes the
//!   idle class and then reads the count, so one of the two always sees the other, and the
//!   serving thread looks for events before the run when the count moved.
//! * An idle run holds the restored process's memory lock (`UFFDIO_COPY`, a read of
//!   `/proc/PID/mem`): starved by a busy machine, it would stall the process's own `munmap`,
//!   `mremap` or `fork` for as long. So a run still under way after [`LONGEST_IDLE_RUN`] is given
//!   the normal class by the watcher, which looks every half of that.
//! * Whoever waits for the memory to be all there (a snapshot, a rollback, a spare: [`hurry`])
//!   sends `SIGUSR1` to the server's session, read through a signalfd the watcher waits on too:
//!   from then on nothing is idle, and a run under way is given the normal class at once.
//! * Settling's comparison of the installed pages with the dump, the container running, is idle
//!   in the same way, run by run; its two frozen moments are not.
//!
//! The serving process hears the signal from before anyone can know it ([`listen`]); where the
//! idle class cannot be had and left again, or the signal not heard, nothing is idle.

use nix::libc;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

/// Someone waits for the memory: nothing idle any more.
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
    /// The watcher's wakes for events so far.
    boosts: AtomicU64,
    /// The serving thread has taken the idle class (the watcher gives it the normal one back).
    idle: AtomicBool,
    /// When its idle run began ([`now_ns`]; 0: none under way).
    since: AtomicU64,
    /// In the epoll set: the watcher's end.
    stop: EventFd,
    stopping: AtomicBool,
    serving: i32,
}

/// The key of the stop eventfd and of the signalfd in the epoll set (a userfaultfd's is 0).
const STOP: u64 = u64::MAX;
const HEARD_KEY: u64 = u64::MAX - 1;
/// The longest an idle run goes on before it is given the normal class: it may hold the
/// restored process's memory lock, and the process's own `munmap`, `mremap` or `fork` wait for
/// it (a bound on that wait when the machine is busy).
pub const LONGEST_IDLE_RUN: std::time::Duration = std::time::Duration::from_millis(250);

/// Nanoseconds since the first call, and never 0.
fn now_ns() -> u64 {
    static BASE: OnceLock<std::time::Instant> = OnceLock::new();
    BASE.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64 + 1
}

/// The serving thread's pace (see the module's documentation). Dropped, the watcher ends.
pub struct Pace {
    shared: Arc<Shared>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl Pace {
    /// The serving thread's pace, or none where its background work cannot be idle (the server
    /// then runs as a normal thread throughout). Call on the serving thread, after [`listen`].
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
            idle: AtomicBool::new(false),
            since: AtomicU64::new(0),
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

    /// A run of background work as the idle class, with `seen` read before the last look for
    /// events; the thread is normal again after it. `Some((what run gave, whether it was idle))`
    /// (not idle once someone waits for the memory); `None`, not run: the watcher woke for an
    /// event since `seen`, which may wait: look first.
    pub fn idle<R>(&self, seen: u64, run: impl FnOnce() -> R) -> Option<(R, bool)> {
        let s = &*self.shared;
        if hurried() {
            return Some((run(), false));
        }
        s.idle.store(true, SeqCst);
        set_class(s.serving, libc::SCHED_IDLE);
        // (set, then looked at: a wake in between is seen here, or gives the class back)
        if s.boosts.load(SeqCst) != seen || hurried() {
            self.normal();
            return None;
        }
        s.since.store(now_ns(), SeqCst);
        let r = run();
        s.since.store(0, SeqCst);
        self.normal();
        Some((r, true))
    }

    fn normal(&self) {
        let s = &*self.shared;
        s.idle.store(false, SeqCst);
        set_class(s.serving, libc::SCHED_OTHER);
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

/// The watcher: each wake for a new userfaultfd event (or a hurry) counted, and the serving
/// thread given the normal class when it is idle; an idle run under way for longer than
/// [`LONGEST_IDLE_RUN`] given it too.
fn watch(s: &Shared) {
    let mut events = [EpollEvent::empty(); 8];
    let tick = EpollTimeout::try_from(LONGEST_IDLE_RUN / 2).unwrap_or(EpollTimeout::NONE);
    loop {
        let n = match s.epoll.wait(&mut events, tick) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(_) => return,
        };
        if s.stopping.load(SeqCst) {
            return;
        }
        if n > 0 {
            if events[..n].iter().any(|e| e.data() == HEARD_KEY) {
                // (every signal read, a later hurry too, or the signalfd stays ready: a spin)
                while HEARD.get().is_some_and(|fd| matches!(fd.read_signal(), Ok(Some(_)))) {}
                HURRIED.store(true, SeqCst);
            }
            s.boosts.fetch_add(1, SeqCst);
        }
        // (the start read on both sides of the look at the class: one of an earlier run, read
        // before this run began, does not cut this one short)
        let since = s.since.load(SeqCst);
        let idle = s.idle.load(SeqCst);
        let long = since != 0
            && s.since.load(SeqCst) == since
            && now_ns().saturating_sub(since) > LONGEST_IDLE_RUN.as_nanos() as u64;
        if idle && (n > 0 || long) {
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

    /// A run is made as the idle class and the thread is normal after it; a new event on a
    /// watched descriptor during a run gives the thread the normal class, and a run asked with
    /// the count read before that event is not made (look first); a run that goes on too long is
    /// given the normal class without any event; once hurried, nothing is idle. (An eventfd
    /// stands for a userfaultfd: the watcher sees only readiness.)
    #[test]
    fn idle_runs_keep_to_their_protocol() {
        assert!(Pace::new().is_none(), "nothing idle before the process listens for a hurry");
        assert!(listen());
        std::thread::spawn(|| {
            let pace = Pace::new().expect("the idle class here, and back");
            let me = gettid();
            let ready = EventFd::from_flags(EfdFlags::EFD_NONBLOCK).unwrap();
            pace.watch(ready.as_fd());
            // (idle, unless this thread was starved past LONGEST_IDLE_RUN before it looked)
            let t = Instant::now();
            let r = pace.idle(pace.seen(), || (class(me), t.elapsed()));
            assert!(
                r.is_some_and(|((c, took), idle)| idle && (c == libc::SCHED_IDLE || took >= LONGEST_IDLE_RUN)),
                "{r:?}"
            );
            assert_eq!(class(me), libc::SCHED_OTHER, "normal after the run");

            // An event during a run: the watcher gives the class back.
            let seen = pace.seen();
            let r = pace.idle(seen, || {
                ready.write(1).unwrap();
                until("the event counted, and the normal class given", || {
                    pace.seen() != seen && class(me) == libc::SCHED_OTHER
                });
            });
            assert_eq!(r, Some(((), true)));
            // Asked with the count from before that event: not run.
            assert_eq!(pace.idle(seen, || unreachable!("run after an event came")), None::<((), bool)>);
            assert_eq!(class(me), libc::SCHED_OTHER);

            // A run that goes on: given the normal class after LONGEST_IDLE_RUN, with no event.
            let t = Instant::now();
            let r = pace.idle(pace.seen(), || {
                until("given the normal class for a long run", || class(me) == libc::SCHED_OTHER);
                t.elapsed()
            });
            assert!(r.is_some_and(|(took, idle)| idle && took >= LONGEST_IDLE_RUN), "{r:?}");

            // Hurried: nothing idle from now on, the signal read once.
            nix::sys::signal::raise(SIGNAL).unwrap();
            assert!(hurried());
            assert_eq!(pace.idle(pace.seen(), || class(me)), Some((libc::SCHED_OTHER, false)));
        })
        .join()
        .unwrap();
    }
}
