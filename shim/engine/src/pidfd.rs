//! Processes held by a descriptor (a pidfd, Linux 5.3 on): once opened it names that process
//! and no other, however soon its PID is reused — killed through it, waited for on it, one of
//! its descriptors taken through it.

use nix::libc;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A descriptor of process `pid` (`ESRCH`: none is there; `ENOSYS`: a kernel without pidfds).
pub fn open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a PID and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor pidfd_open just returned, owned here alone.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

/// Sends the process SIGKILL (`ESRCH`: it has ended already).
pub fn kill(pidfd: &OwnedFd) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with a pidfd, a signal, no siginfo and no flags.
    if unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A duplicate of the process's descriptor `fd` (the same open file description: seeking it
/// moves the process's offset).
pub fn get_fd(pidfd: &OwnedFd, fd: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd(2) with a pidfd, a descriptor number and no flags; a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor pidfd_getfd just returned, owned here alone.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

/// Waits until the process has ended, at most `max` (none, or one past any clock: for ever);
/// whether it has.
pub fn wait(pidfd: &OwnedFd, max: Option<Duration>) -> io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = max.and_then(|m| Instant::now().checked_add(m));
    loop {
        let timeout = match deadline {
            // (rounded up: a wait that ends a little early would say "not ended" too soon)
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                let ms = left.as_micros().div_ceil(1000);
                PollTimeout::try_from(ms.min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(false),
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => return Ok(true),
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A child process of a test, killed and reaped however the test ends.
    pub(crate) struct Child(pub std::process::Child);
    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_child_is_killed_and_waited_for_through_its_descriptor() {
        let mut child = Child(std::process::Command::new("sleep").arg("1000").spawn().unwrap());
        let fd = open(child.0.id() as i32).unwrap();
        assert!(!wait(&fd, Some(Duration::ZERO)).unwrap(), "still running");
        kill(&fd).unwrap();
        assert!(wait(&fd, None).unwrap());
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.0.wait().unwrap().signal(), Some(libc::SIGKILL));
        // (reaped: the descriptor still names it, and no other process)
        assert_eq!(kill(&fd).unwrap_err().raw_os_error(), Some(libc::ESRCH));
        let own = open(std::process::id() as i32).unwrap();
        let dup = get_fd(&own, own.as_raw_fd() as u32).unwrap();
        assert_ne!(dup.as_raw_fd(), own.as_raw_fd());
    }
}
