//! Finding the external tools planarian drives (crun, criu, zfs, podman) by absolute path:
//! Podman calls some verbs with no PATH at all, so PATH is never consulted.

use std::path::{Path, PathBuf};

/// Directories searched, in order, for a tool whose path is not configured.
pub const SEARCH_DIRS: &[&str] = &["/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin", "/bin", "/sbin"];

#[derive(Debug, thiserror::Error)]
#[error("{tool} not found (looked in {looked}); {hint}")]
pub struct NotFound {
    pub tool: &'static str,
    pub looked: String,
    pub hint: String,
}

/// Finds `tool`: the configured path if there is one (it must then exist), else the first
/// executable file named `tool` in [`SEARCH_DIRS`].
pub fn locate(tool: &'static str, configured: Option<&Path>, config_key: &str) -> Result<PathBuf, NotFound> {
    let candidates: Vec<PathBuf> = match configured {
        Some(p) => vec![p.to_path_buf()],
        None => SEARCH_DIRS.iter().map(|d| Path::new(d).join(tool)).collect(),
    };
    if let Some(found) = candidates.iter().find(|p| is_executable(p)) {
        return Ok(found.clone());
    }
    Err(NotFound {
        tool,
        looked: candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        hint: match configured {
            Some(_) => format!("fix {config_key} in planarian.conf"),
            None => format!("install {tool} or set {config_key} in /etc/planarian/planarian.conf"),
        },
    })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Makes `cmd` a process of its own that outlives this runtime call: its own session (so no
/// signal to Podman's process group reaches it), and none of the descriptors conmon handed this
/// call (sync and start pipes, the console socket) — Podman waits for those to close.
pub fn detach(cmd: &mut std::process::Command) {
    detach_keeping(cmd, &[]);
}

/// [`detach`], the descriptors `keep` (this process's numbers) passed on across exec, and only
/// those.
pub fn detach_keeping(cmd: &mut std::process::Command, keep: &[std::os::fd::RawFd]) {
    use std::os::unix::process::CommandExt;
    let keep = keep.to_vec();
    // SAFETY: setsid(2) and fcntl(2) only, both async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            for fd in 3..1024 {
                let flag =
                    if keep.contains(&fd) { nix::fcntl::FdFlag::empty() } else { nix::fcntl::FdFlag::FD_CLOEXEC };
                let set =
                    nix::fcntl::fcntl(std::os::fd::BorrowedFd::borrow_raw(fd), nix::fcntl::FcntlArg::F_SETFD(flag));
                if keep.contains(&fd) {
                    set.map_err(std::io::Error::from)?;
                }
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_path_must_exist_and_is_named() {
        let e = locate("crun", Some(Path::new("/nonexistent/crun")), "[runtime] crun_path").unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("crun not found (looked in /nonexistent/crun)"), "{msg}");
        assert!(msg.contains("crun_path"), "{msg}");
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn search_lists_every_place_looked() {
        let e = locate("no-such-tool-planarian", None, "[runtime] x_path").unwrap_err();
        for d in SEARCH_DIRS {
            assert!(e.looked.contains(d), "{}", e.looked);
        }
    }

    #[test]
    fn finds_a_tool_that_exists() {
        // sh is in /bin or /usr/bin on every Linux this runs on.
        let p = locate("sh", None, "").unwrap();
        assert!(p.is_absolute());
    }
}
