//! The few things planarian asks Podman: which container a name means, where its files are, and
//! to restore it (so that Podman, conmon and the network stay in charge of the container).

use super::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct PodmanContainer {
    pub id: String,
    pub name: String,
    pub status: String,
    pub runtime: String,
    /// The bundle (Podman's userdata directory).
    pub bundle: PathBuf,
    pub upperdir: Option<PathBuf>,
    pub annotations: serde_json::Map<String, serde_json::Value>,
}

pub fn podman() -> Result<PathBuf> {
    Ok(crate::tools::locate("podman", None, "PATH")?)
}

fn run_podman(args: &[&str]) -> Result<std::process::Output> {
    let bin = podman()?;
    Command::new(&bin).args(args).output().map_err(|source| Error::Run { tool: bin, source })
}

/// Looks a container up by name or ID.
pub fn inspect(name: &str) -> Result<PodmanContainer> {
    let out = run_podman(&["container", "inspect", "--format", "json", name])?;
    if !out.status.success() {
        return Err(Error::NoSuchContainer(name.to_string()));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|source| Error::Json { what: format!("podman inspect {name}"), source })?;
    let c = &v[0];
    let s = |x: &serde_json::Value| x.as_str().unwrap_or_default().to_string();
    Ok(PodmanContainer {
        id: s(&c["Id"]),
        name: s(&c["Name"]),
        status: s(&c["State"]["Status"]),
        runtime: s(&c["OCIRuntime"]),
        bundle: PathBuf::from(s(&c["StaticDir"])),
        upperdir: c["GraphDriver"]["Data"]["UpperDir"].as_str().map(PathBuf::from),
        annotations: c["Config"]["Annotations"].as_object().cloned().unwrap_or_default(),
    })
}

/// Runs a podman command; the error is Podman's own last line.
pub fn run(args: &[&str]) -> Result<()> {
    let out = run_podman(args)?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        // Name the command, not its flags: "podman container clone: Error: …".
        let mut what = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if a == &"--runtime" {
                it.next();
            } else if !a.starts_with('-') && what.len() < 2 {
                what.push(*a);
            }
        }
        Err(Error::Podman { command: what.join(" "), message: err.lines().last().unwrap_or("failed").trim().to_string() })
    }
}

/// Waits until Podman has cleaned up after the container's processes ended (storage unmounted).
pub fn wait_stopped(id: &str, upperdir: Option<&Path>, timeout: Duration) -> Result<()> {
    let end = Instant::now() + timeout;
    loop {
        let c = inspect(id)?;
        let unmounted = upperdir.is_none_or(|u| !super::container::upperdir_mounted(u));
        if matches!(c.status.as_str(), "exited" | "stopped" | "configured" | "created") && unmounted {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(Error::DidNotStop { id: id.to_string(), secs: timeout.as_secs(), status: c.status });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A container that exists and runs on planarian, or a clear error.
pub fn planarian_container(name: &str) -> Result<PodmanContainer> {
    let pc = inspect(name)?;
    if pc.runtime != "planarian" {
        return Err(Error::NotPlanarian { name: name.to_string(), runtime: pc.runtime });
    }
    Ok(pc)
}
