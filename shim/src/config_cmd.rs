//! `planarian config [CONTAINER]`: the effective configuration, optionally for one container
//! (its `io.planarian.*` annotations applied), with the files it was read from.

use crate::cli::Invocation;
use crate::config::{self, Config};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

pub fn main(inv: &Invocation, args: &[OsString]) -> Result<i32, String> {
    let container = match args {
        [] => None,
        [c] if c.to_str().is_some_and(|c| !c.starts_with('-')) => c.to_str(),
        _ => return Err("usage: planarian config [CONTAINER-ID]".into()),
    };
    let base = Config::load().map_err(|e| e.to_string())?;
    let cfg = match container {
        None => base,
        Some(id) => {
            let annotations = container_annotations(inv, &base, id)?;
            base.with_annotations(annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .map_err(|e| format!("container {id}: {e}"))?
        }
    };
    let files: Vec<PathBuf> = config::config_files().into_iter().filter(|p| p.exists()).collect();
    println!("# read from: {}", if files.is_empty() { "(built-in defaults)".into() } else {
        files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    });
    if let Some(id) = container {
        println!("# with the io.planarian.* annotations of container {id}");
    }
    print!("{}", toml::to_string(&cfg).map_err(|e| e.to_string())?);
    Ok(0)
}

/// A container's annotations, read from the bundle crun recorded for it.
fn container_annotations(inv: &Invocation, cfg: &Config, id: &str) -> Result<Vec<(String, String)>, String> {
    let crun = crate::crun_from(cfg)?;
    let mut state = Command::new(&crun);
    if let Some(root) = &inv.root {
        state.arg("--root").arg(root);
    }
    let out = state.args(["state", id]).output().map_err(|e| format!("cannot run {}: {e}", crun.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("unknown container {id}: {}", err.lines().last().unwrap_or("").trim()));
    }
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("crun state {id}: {e}"))?;
    let bundle = state["bundle"].as_str().ok_or_else(|| format!("crun state {id} has no bundle"))?;
    let spec_path = PathBuf::from(bundle).join("config.json");
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&spec_path).map_err(|e| format!("cannot read {}: {e}", spec_path.display()))?,
    )
    .map_err(|e| format!("{}: {e}", spec_path.display()))?;
    Ok(spec["annotations"]
        .as_object()
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default())
}
