//! The few things planarian asks Podman — which container a name means, where its files are, to
//! clone, create, restore, rename, kill and remove one (so that Podman, conmon and the network
//! stay in charge of the container) — each a typed function; no caller builds a Podman command
//! line. The error of a failed command is Podman's own last line, with the command named.

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
    /// Run by a CRI engine (containerd), not by Podman: what goes through Podman (a stop and
    /// restore, a fork's clone) cannot be done to it.
    pub cri: bool,
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
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|source| Error::Json { what: format!("podman inspect {name}"), source })?;
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
        cri: false,
    })
}

/// An image's layers on Podman's overlay driver, top first (the order its containers' overlay
/// lists them in). Podman's own error when it does not know the image.
pub fn image_layers(image: &str) -> Result<Vec<PathBuf>> {
    let out = output(&["image", "inspect", "--format", "json", image])?;
    let v: serde_json::Value = serde_json::from_str(&out)
        .map_err(|source| Error::Json { what: format!("podman image inspect {image}"), source })?;
    layers_in(&v, image)
}

/// The layers in `podman image inspect`'s answer `v` about `image`.
fn layers_in(v: &serde_json::Value, image: &str) -> Result<Vec<PathBuf>> {
    let gd = &v[0]["GraphDriver"];
    let driver = gd["Name"].as_str().unwrap_or_default();
    let upper = gd["Data"]["UpperDir"].as_str().filter(|_| driver == "overlay");
    let Some(upper) = upper else {
        return Err(Error::Podman {
            command: "image inspect".into(),
            message: format!("{image} is not on the overlay storage driver (it is on {driver:?})"),
        });
    };
    let mut layers = vec![PathBuf::from(upper)];
    layers.extend(
        gd["Data"]["LowerDir"].as_str().unwrap_or_default().split(':').filter(|p| !p.is_empty()).map(PathBuf::from),
    );
    Ok(layers)
}

/// `podman --runtime RUNTIME container clone SRC NAME`: a new container configured as `src`,
/// not started.
pub fn clone_container(runtime: &str, src: &str, name: &str) -> Result<()> {
    run(&["--runtime", runtime, "container", "clone", src, name])
}

/// `podman --runtime RUNTIME create ARGS…` (a recipe's arguments, the image last).
pub fn create(runtime: &str, args: &[String]) -> Result<()> {
    let mut all = vec!["--runtime", runtime, "create"];
    all.extend(args.iter().map(String::as_str));
    run(&all)
}

/// Container `name` initialised and stopped: its storage, network and bundle made, no process —
/// what `podman container restore` restores into.
pub fn init_stopped(name: &str) -> Result<()> {
    run(&["container", "init", name])?;
    run(&["container", "stop", "-t", "0", name])
}

/// `podman container restore [--tcp-established] ID` of the checkpoint in the container's
/// bundle; with `stats`, what Podman says of the restore's time (`--print-stats`), when it says.
pub fn restore(id: &str, tcp_established: bool, stats: bool) -> Result<Option<RestoreStats>> {
    let mut args = vec!["container", "restore"];
    if stats {
        args.push("--print-stats");
    }
    if tcp_established {
        args.push("--tcp-established");
    }
    args.push(id);
    Ok(RestoreStats::parse(&output(&args)?))
}

/// `podman rename ID NAME`.
pub fn rename(id: &str, name: &str) -> Result<()> {
    run(&["rename", id, name])
}

/// `podman kill ID`: its processes killed (SIGKILL), Podman cleans up after them.
pub fn kill(id: &str) -> Result<()> {
    run(&["kill", id])
}

/// `podman rm -f -t 0 NAME`: the container removed, running or not, at once.
pub fn remove(name: &str) -> Result<()> {
    run(&["rm", "-f", "-t", "0", name])
}

/// What `podman container inspect` says of container `name`, whole (a recipe reads it).
pub fn inspect_json(name: &str) -> Result<serde_json::Value> {
    let out = output(&["container", "inspect", name])?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|source| Error::Json { what: format!("podman inspect {name}"), source })?;
    Ok(v[0].clone())
}

/// Runs a podman command; the error is Podman's own last line.
fn run(args: &[&str]) -> Result<()> {
    output(args).map(drop)
}

/// Runs a podman command; its standard output, or the error of [`run`].
fn output(args: &[&str]) -> Result<String> {
    let out = run_podman(args)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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
        Err(Error::Podman {
            command: what.join(" "),
            message: err.lines().last().unwrap_or("failed").trim().to_string(),
        })
    }
}

/// Waits until Podman has cleaned up after the container's processes ended (storage unmounted).
/// Where its files are an overlay, the wait is for that overlay's unmount, which Podman's
/// cleanup does after it has recorded the container exited: then one `podman inspect` confirms
/// it. (Asking Podman every 100 ms meant a Podman process each time, competing for the CPUs
/// with the very cleanup waited for.)
pub fn wait_stopped(id: &str, upperdir: Option<&Path>, timeout: Duration) -> Result<()> {
    let end = Instant::now() + timeout;
    loop {
        let unmounted = upperdir.is_none_or(|u| super::container::wait_upperdir_unmounted(u, end));
        let c = inspect(id)?;
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

/// What `podman container restore --print-stats` says of a restore: Podman's whole time, the
/// runtime's (conmon and `planarian restore`), CRIU's restore and the pages it restored.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RestoreStats {
    pub podman_ms: f64,
    pub runtime_ms: f64,
    pub criu_ms: f64,
    pub pages: u64,
}

impl RestoreStats {
    /// From Podman's JSON (durations in microseconds).
    pub fn parse(json: &str) -> Option<RestoreStats> {
        let v: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
        let c = &v["container_statistics"][0];
        let us = |x: &serde_json::Value| x.as_f64().map(|u| u / 1000.0);
        Some(RestoreStats {
            podman_ms: us(&v["podman_restore_duration"])?,
            runtime_ms: us(&c["runtime_restore_duration"]).unwrap_or(0.0),
            criu_ms: us(&c["criu_statistics"]["restore_time"]).unwrap_or(0.0),
            pages: c["criu_statistics"]["pages_restored"].as_u64().unwrap_or(0),
        })
    }

    /// `podman 5.77 s = runtime 4.10 s (CRIU 1.21 s, 8192 pages) + Podman's own 1.67 s`.
    pub fn breakdown(&self) -> String {
        format!(
            "runtime {:.2} s (CRIU {:.2} s, {} pages) + Podman's own {:.2} s",
            self.runtime_ms / 1000.0,
            self.criu_ms / 1000.0,
            self.pages,
            (self.podman_ms - self.runtime_ms).max(0.0) / 1000.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_layers_top_first_on_overlay_only() {
        let v = serde_json::json!([{"GraphDriver": {"Name": "overlay", "Data": {
            "UpperDir": "/s/overlay/top/diff", "LowerDir": "/s/overlay/mid/diff:/s/overlay/base/diff"}}}]);
        let want: Vec<PathBuf> =
            ["/s/overlay/top/diff", "/s/overlay/mid/diff", "/s/overlay/base/diff"].iter().map(PathBuf::from).collect();
        assert_eq!(layers_in(&v, "img").unwrap(), want);
        // A one-layer image has no LowerDir.
        let one =
            serde_json::json!([{"GraphDriver": {"Name": "overlay", "Data": {"UpperDir": "/s/overlay/only/diff"}}}]);
        assert_eq!(layers_in(&one, "img").unwrap(), vec![PathBuf::from("/s/overlay/only/diff")]);
        let vfs = serde_json::json!([{"GraphDriver": {"Name": "vfs", "Data": {}}}]);
        let e = layers_in(&vfs, "img").unwrap_err().to_string();
        assert!(e.contains("img is not on the overlay storage driver") && e.contains("vfs"), "{e}");
    }

    #[test]
    fn restore_stats_as_podman_prints_them() {
        let json = r#"{"podman_restore_duration": 5770000, "container_statistics": [{"Id": "abc", "runtime_restore_duration": 4100000,
            "criu_statistics": {"forking_time": 1000, "restore_time": 1210000, "pages_restored": 8192}}]}"#;
        let s = RestoreStats::parse(json).unwrap();
        assert_eq!((s.podman_ms, s.runtime_ms, s.criu_ms, s.pages), (5770.0, 4100.0, 1210.0, 8192));
        assert_eq!(s.breakdown(), "runtime 4.10 s (CRIU 1.21 s, 8192 pages) + Podman's own 1.67 s");
        assert!(RestoreStats::parse("not json").is_none());
    }
}
